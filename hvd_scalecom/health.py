"""ScaleCom's premise checked in a running job, and the fallback for tensors where it fails.

ScaleCom (Chen et al., NeurIPS 2020, Alg. 1) sends the entries ``I = top_k(|p_j|)`` of the leader
``j``'s own error-compensated gradient; it pays off when they stand for the top-k of the average
``P = mean_i p_i`` (the paper's "commutative" property, Sec. 3). With ``check_every=N``, one
compressed step in N of each tensor is a *check step*: it reduces ``p`` densely instead of ``p[I]``
(its output and memory update are the compressed step's own; only the bytes differ), and from ``P``

    overlap  = |I ∩ G| / k,                  G = top_k(|P|)
    captured = ||P[I]||^2 / ||P[G]||^2        (1 where ||P[G]|| = 0)

with the energy shares ``||P[I]||^2 / ||P||^2`` and ``||P[G]||^2 / ||P||^2`` beside them.

``fallback="dense"``: after ``patience`` checks in a row with ``captured < min_captured`` a tensor is
sent densely, ``out = P`` and ``m <- 0``, until ``patience`` checks in a row (still one in N steps)
reach ``min_captured`` again. All that was owed, ``p = m + g``, was sent: the low-pass filter with
every entry selected would keep ``(1 - beta) m`` and send the backlog about ``1 / beta`` times over.

Every rank computes the measures from the same reduced ``P`` and the same ``I``, summing the k
squares in ascending order (a sort, then a sequential sum), so every rank reaches the same decision
without a collective of its own. This module holds the schedule and the decisions; each frontend
computes the four sums (``hvd_scalecom.torch.health``, ``hvd_scalecom.tensorflow.health``).
"""

import dataclasses
import warnings

from hvd_scalecom.config import INT64_LIMIT, check_int, check_real

FALLBACKS = (None, "dense")


@dataclasses.dataclass(frozen=True)
class HealthCheck:
    """The health check's options (every rank must agree on them).

    check_every: one compressed step in ``check_every`` of each tensor is a check step (``None``: no
        checks). The first check is a tensor's first compressed step.
    fallback: ``None`` (checks only report) or ``"dense"`` (see the module's docstring).
    min_captured: the ``captured`` below which a check counts as low, in [0, 1].
    patience: low (or, in fallback, good) checks in a row before a tensor changes how it is sent.
    """

    check_every: "int | None" = None
    fallback: "str | None" = None
    min_captured: float = 0.5
    patience: int = 2

    def __post_init__(self):
        if self.check_every is not None:
            check_int(self.check_every, "check_every", 1)
            if self.check_every >= INT64_LIMIT:
                raise ValueError(f"check_every must be below 2**63, got {self.check_every}")
            object.__setattr__(self, "check_every", int(self.check_every))
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.fallback is not None and self.check_every is None:
            raise ValueError(f"fallback={self.fallback!r} needs check_every (the checks decide when to "
                             f"fall back and when to return), got check_every=None")
        object.__setattr__(self, "min_captured", float(check_real(self.min_captured, "min_captured", 0.0, 1.0)))
        check_int(self.patience, "patience", 1)
        object.__setattr__(self, "patience", int(self.patience))

    @property
    def enabled(self):
        return self.check_every is not None

    def is_check_step(self, step, warmup_steps):
        """Whether a compressed step ``step`` (>= ``warmup_steps``) of a tensor is a check step."""
        return self.check_every is not None and (step - warmup_steps) % self.check_every == 0

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Measures:
    """One check of one tensor: ``hits = |I ∩ G|`` of ``k``, and the squared norms ``||P[I]||^2``
    (``selected``), ``||P[G]||^2`` (``topk``) and ``||P||^2`` (``total``)."""

    hits: int
    k: int
    selected: float
    topk: float
    total: float

    @property
    def overlap(self):
        return self.hits / self.k if self.k else 1.0

    @property
    def captured(self):
        return self.selected / self.topk if self.topk > 0 else 1.0

    def share(self, energy):
        return energy / self.total if self.total > 0 else 1.0

    def is_finite(self):
        return all(x == x and abs(x) != float("inf") for x in (self.selected, self.topk, self.total))


class _TensorHealth:
    __slots__ = ("step", "measures", "low", "good", "dense", "checks", "dense_steps")

    def __init__(self):
        self.step = None  # the step of the last check
        self.measures = None  # its Measures
        self.low = 0  # low checks in a row (while compressed)
        self.good = 0  # good checks in a row (while sent densely)
        self.dense = False  # sent densely (fallback) from the step after the deciding check
        self.checks = 0
        self.dense_steps = 0


class HealthMonitor:
    """The checks' results and the fallback decisions of one compressor, per tensor name.

    ``warn``: whether this rank warns (once, when a tensor's checks first stay low; one rank of the
    job is enough)."""

    def __init__(self, health, names, warn=True):
        if not isinstance(health, HealthCheck):
            raise TypeError(f"health must be a HealthCheck, got {type(health).__name__}")
        self.health = health
        self._tensors = {name: _TensorHealth() for name in names}
        self._warn = warn
        self._warned = False

    def sends_dense(self, name):
        """Whether tensor ``name`` is sent densely (fallback) at its next step."""
        return self._tensors[name].dense

    def count_dense_step(self, name):
        self._tensors[name].dense_steps += 1

    def record(self, name, step, measures):
        """The check of tensor ``name`` at ``step``; a non-finite one (a skipped step) decides nothing.
        Returns whether the tensor now changes how it is sent (from its next step)."""
        entry = self._tensors[name]
        if not measures.is_finite():
            return False
        entry.step, entry.measures = step, measures
        entry.checks += 1
        was_dense = entry.dense
        entry.dense, entry.low, entry.good, stays_low = next_streaks(
            entry.dense, entry.low, entry.good, measures.captured < self.health.min_captured,
            self.health.patience, self.health.fallback)
        if stays_low:
            self._warn_once(name, step)
        changed = entry.dense != was_dense
        return changed

    def summary(self):
        """For ``stats()``: over each tensor's latest check, ``overlap`` (k-weighted), ``captured``
        (``sum ||P[I]||^2 / sum ||P[G]||^2``), ``selected_share`` and ``topk_share`` of ``sum ||P||^2``;
        ``checks`` and ``dense_steps`` (tensor-steps sent densely by the fallback) over the run;
        ``dense_tensors`` (now falling back); and ``by_tensor``, the same per tensor."""
        latest = [e.measures for e in self._tensors.values() if e.measures is not None]
        total = Measures(sum(m.hits for m in latest), sum(m.k for m in latest), sum(m.selected for m in latest),
                         sum(m.topk for m in latest), sum(m.total for m in latest))
        by_tensor = {name: self._describe(e) for name, e in self._tensors.items() if e.measures is not None}
        return {"checks": sum(e.checks for e in self._tensors.values()),
                "dense_steps": sum(e.dense_steps for e in self._tensors.values()),
                "dense_tensors": sum(e.dense for e in self._tensors.values()),
                **(_scalars(total) if latest else {}), "by_tensor": by_tensor}

    def _describe(self, entry):
        return {"step": entry.step, **_scalars(entry.measures), "dense": entry.dense, "checks": entry.checks}

    def _warn_once(self, name, step):
        if self._warned or not self._warn:
            return
        self._warned = True
        warnings.warn(warning_text(name, step, self._tensors[name].measures, self.health), stacklevel=3)

    def state_dict(self):
        return {name: {"step": e.step, "measures": None if e.measures is None else dataclasses.asdict(e.measures),
                       "low": e.low, "good": e.good, "dense": e.dense, "checks": e.checks,
                       "dense_steps": e.dense_steps}
                for name, e in self._tensors.items()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s result (checked first; nothing changes on a bad one)."""
        if not isinstance(state, dict) or set(state) != set(self._tensors):
            raise ValueError(f"health state must have an entry for each of {sorted(self._tensors)}")
        restored = {}
        for name, saved in state.items():
            entry = _TensorHealth()
            try:
                entry.step = None if saved["step"] is None else check_int(saved["step"], "step", 0)
                entry.measures = None if saved["measures"] is None else Measures(**saved["measures"])
                for key in ("low", "good", "checks", "dense_steps"):
                    setattr(entry, key, check_int(saved[key], key, 0))
                if not isinstance(saved["dense"], bool):
                    raise TypeError(f"dense must be a bool, got {saved['dense']!r}")
                entry.dense = saved["dense"]
            except (KeyError, TypeError, ValueError) as error:
                raise ValueError(f"health state of {name!r} is malformed: {error}") from None
            restored[name] = entry
        self._tensors = restored


def _choose(condition, if_true, if_false):
    return if_true if condition else if_false


def next_streaks(dense, low, good, is_low, patience, fallback, choose=_choose):
    """The fallback's rule for one finite check (``is_low``: ``captured < min_captured``): the tensor's
    ``(dense, low, good)`` after it, and whether its checks now stay low (``patience`` low ones in a row
    while compressed: the warning). While compressed, low checks in a row fall back (``fallback="dense"``)
    at ``patience``; while dense, good checks in a row return at ``patience``; each resets the other.

    ``choose(condition, if_true, if_false)`` is Python's conditional by default; the TensorFlow frontend
    passes ``tf.where`` and runs the same rule as graph ops on its per-tensor variables."""
    low_after = choose(is_low, low + 1, 0)
    good_after = choose(is_low, 0, good + 1)
    stays_low = low_after >= patience  # (while compressed)
    recovers = good_after >= patience  # (while dense)
    falls_back = stays_low if fallback == "dense" else False
    return (choose(dense, choose(recovers, False, True), falls_back),
            choose(dense, low, choose(falls_back, 0, low_after)),
            choose(dense, choose(recovers, 0, good_after), good),
            choose(dense, False, stays_low))


def warning_text(name, step, measures, health):
    """The warning when tensor ``name``'s checks stay low (its check at ``step`` gave ``measures``)."""
    action = ("it is sent densely until its checks recover" if health.fallback == "dense" else
              "pass fallback='dense' to send such tensors densely until they recover")
    return (f"ScaleCom's health check: for {name!r} the leader's top-k carried {measures.captured:.2f} of the "
            f"energy the global top-k would (overlap {measures.overlap:.2f}) at step {step}, below min_captured="
            f"{health.min_captured} for {health.patience} checks in a row: the workers' largest "
            f"entries differ, so ScaleCom's indices miss the sum's. {action.capitalize()}; a larger ratio, "
            f"a longer warm-up or a lower learning rate may help (docs/convergence.md). (Warned once; "
            f"stats()['health'] has every tensor's figures.)")


def _scalars(m):
    return {"overlap": m.overlap, "captured": m.captured, "selected_share": m.share(m.selected),
            "topk_share": m.share(m.topk)}
