"""The health check and the dense fallback in the TensorFlow ScaleCom (:mod:`hvd_scalecom.health` holds
the options, the schedule, the rule and the summary).

The TensorFlow ScaleCom runs inside ``tf.function`` graphs, so whether a step is a check, whether a
tensor falls back, and the checks' results live in per-variable ``tf.Variable``s updated by graph ops:
the measures (:func:`measure`, as :func:`hvd_scalecom.torch.health.measure`) and the fallback's rule
(:func:`hvd_scalecom.health.next_streaks`, run with ``tf.where``). Between steps, Python reads them back
into a :class:`~hvd_scalecom.health.HealthMonitor` for ``stats()["health"]``, ``state_dict()`` and the
warning.
"""

import warnings

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_scalecom.health import HealthMonitor, Measures, next_streaks, warning_text
from hvd_scalecom.traffic import itemsize

# One variable's health counters (int64) and sums (float64), by position.
COUNTS = ("check_step", "hits", "low", "good", "dense", "checks", "dense_steps",  # as HealthMonitor's
          "alarm_step", "alarm_hits",  # the check at which the checks first stayed low (-1: none)
          "check_steps", "fallback_steps")  # steps sent as a check, as a fallback (for the bytes)
SUMS = ("selected", "topk", "total", "alarm_selected", "alarm_topk", "alarm_total")
_C = {name: i for i, name in enumerate(COUNTS)}
_FRESH_COUNTS = [-1 if name in ("check_step", "alarm_step") else 0 for name in COUNTS]
PLAIN, CHECK, FALLBACK = 0, 1, 2  # how a step sent a tensor (kinds), for stats(step)'s bytes


def ordered_sum(values):
    """The sum of the float64 ``values`` in ascending order, as a sequential (cumulative) sum: the same
    bits on every rank holding the same multiset of values (:func:`hvd_scalecom.torch.health.ordered_sum`)."""
    return tf.concat([[tf.constant(0.0, tf.float64)], tf.cumsum(tf.sort(values))], 0)[-1]


def measure(reduced, indices, k, numel):
    """``(hits, ||P[I]||^2, ||P[G]||^2, ||P||^2)`` of a check (int64, then float64 scalars): ``reduced``
    is ``P`` (``numel`` entries, any float dtype; a mean or a sum), ``indices`` the leader's ``I`` (k of
    them), ``G = top_k(|P|)``. The two k-sums are :func:`ordered_sum`\\ s, so every rank decides alike."""
    squares = tf.square(tf.cast(tf.reshape(reduced, [numel]), tf.float64))
    top = tf.math.top_k(squares, k, sorted=False, index_type=indices.dtype)
    in_top = tf.scatter_nd(tf.expand_dims(top.indices, 1), tf.ones([k], tf.int64),
                           tf.constant([numel], indices.dtype))
    hits = tf.reduce_sum(tf.gather(in_top, indices))
    return hits, ordered_sum(tf.gather(squares, indices)), ordered_sum(top.values), tf.reduce_sum(squares)


def _where(condition, if_true, if_false):
    """``tf.where`` where one side may be a Python number (given the other side's dtype)."""
    if not isinstance(if_true, tf.Tensor):
        if_true = tf.constant(if_true, if_false.dtype if isinstance(if_false, tf.Tensor) else None)
    if not isinstance(if_false, tf.Tensor):
        if_false = tf.constant(if_false, if_true.dtype)
    return tf.where(condition, if_true, if_false)


class SlotHealth:
    """One variable's health state: ``counts`` (int64, :data:`COUNTS`), ``sums`` (float64, :data:`SUMS`)
    and ``kinds`` (how each of the last ``kept`` steps sent it, at ``step % kept``)."""

    def __init__(self, index, kept):
        self.counts = tf.Variable(_FRESH_COUNTS, dtype=tf.int64, trainable=False, name=f"health_counts_{index}")
        self.sums = tf.Variable(tf.zeros([len(SUMS)], tf.float64), trainable=False, name=f"health_sums_{index}")
        self.kinds = tf.Variable(tf.zeros([kept], tf.int64), trainable=False, name=f"health_kinds_{index}")

    def variables(self):
        return [self.counts, self.sums, self.kinds]

    def values(self):
        """``({count name: int}, {sum name: float})``, read eagerly."""
        counts, sums = self.counts.numpy(), self.sums.numpy()
        return ({n: int(counts[i]) for i, n in enumerate(COUNTS)}, {n: float(sums[i]) for i, n in enumerate(SUMS)})

    def monitor_entry(self, k):
        """This variable's entry of :meth:`HealthMonitor.state_dict`."""
        counts, sums = self.values()
        measured = counts["check_step"] >= 0
        return {"step": counts["check_step"] if measured else None,
                "measures": {"hits": counts["hits"], "k": k, "selected": sums["selected"], "topk": sums["topk"],
                             "total": sums["total"]} if measured else None,
                **{key: counts[key] for key in ("low", "good", "checks", "dense_steps")},
                "dense": bool(counts["dense"])}

    def load(self, entry):
        """Restore a (checked) :meth:`monitor_entry`; ``None``: fresh. The byte tallies, the step kinds
        and the warning's record restart, as the other statistics do at a restore."""
        counts, sums = list(_FRESH_COUNTS), [0.0] * len(SUMS)
        if entry is not None:
            for key in ("low", "good", "checks", "dense_steps"):
                counts[_C[key]] = entry[key]
            counts[_C["dense"]] = int(entry["dense"])
            if entry["measures"] is not None:
                counts[_C["check_step"]] = entry["step"]
                counts[_C["hits"]] = entry["measures"]["hits"]
                sums[:3] = [entry["measures"][key] for key in ("selected", "topk", "total")]
        self.counts.assign(counts)
        self.sums.assign(sums)
        self.kinds.assign(tf.zeros_like(self.kinds))


class HealthGraph:
    """The health check of :class:`~hvd_scalecom.tensorflow.ScaleCom` (a base class of it): reads
    ``health`` (a :class:`~hvd_scalecom.health.HealthCheck`), ``config``, ``_slots`` (each with a
    ``health``: :class:`SlotHealth` when checks run) and ``_process_set``."""

    # -- graph ops of a step ------------------------------------------------------------------------

    def _health_modes(self, slot, t):
        """``(is_check, falling_back)`` of step ``t`` (boolean tensors): a compressed step that checks,
        and whether the tensor is sent densely (decided at an earlier step's end)."""
        warmup = self.config.warmup_steps
        is_check = tf.logical_and(t >= warmup, tf.math.floormod(t - warmup, self.health.check_every) == 0)
        return is_check, slot.health.counts[_C["dense"]] > 0

    def _health_indices(self, slot, is_check, falling_back, exchange, index_dtype, start):
        """``exchange()`` (the indices and when this rank began waiting), except in a fallback step
        that is no check: no exchange, placeholders."""
        if self.health.fallback is None:
            return exchange()

        def none():
            return tf.zeros([slot.k], index_dtype), tf.identity(start)

        indices, wait_from = tf.cond(tf.logical_or(is_check, tf.logical_not(falling_back)), exchange, none)
        return tf.ensure_shape(indices, [slot.k]), wait_from

    def _health_values(self, slot, tensor, finite, values, is_check, falling_back, sent_dtype):
        """What this rank sends: ``values`` (``p[I]``), or ``p`` densely in a check or fallback step (NaN
        where the gradient is not finite, as ``values``)."""
        def dense():
            p = slot.memory + tf.cast(tf.reshape(tensor, [-1]), slot.memory.dtype)
            return tf.where(finite, tf.cast(p, sent_dtype), tf.constant(float("nan"), sent_dtype))

        sends_dense = tf.logical_or(is_check, falling_back)
        return tf.ensure_shape(tf.cond(sends_dense, dense, lambda: tf.identity(values)), [None])

    def _health_output(self, slot, reduced, indices, is_check, falling_back, scatter):
        """The step's gradient from what was reduced: ``P`` in a fallback step, ``scatter(I, P[I])`` in
        a check, ``scatter(I, reduced)`` (``scatter``) otherwise."""
        def dense():
            return tf.reshape(tf.cast(reduced, slot.grad_dtype), slot.shape)

        def sparse():
            return tf.cond(is_check, lambda: scatter(tf.gather(reduced, indices)), lambda: scatter(reduced))

        return tf.cond(falling_back, dense, sparse)

    def _health_record(self, slot, t, reduced, indices, compressed, is_check, falling_back):
        """After a step's reduction: count how it was sent, and a check's measures and decision."""
        health = slot.health
        check = tf.logical_and(compressed, is_check)
        fallback = tf.logical_and(compressed, falling_back)
        kind = tf.where(check, tf.constant(CHECK, tf.int64),
                        tf.where(fallback, tf.constant(FALLBACK, tf.int64), tf.constant(PLAIN, tf.int64)))
        health.kinds.scatter_nd_update([[tf.cast(t % int(health.kinds.shape[0]), tf.int32)]], [kind])
        health.counts.scatter_nd_add(
            [[_C["dense_steps"]], [_C["check_steps"]], [_C["fallback_steps"]]],
            tf.stack([tf.cast(fallback, tf.int64), tf.cast(check, tf.int64),
                      tf.cast(tf.logical_and(fallback, tf.logical_not(check)), tf.int64)]))

        def record():
            hits, selected, topk, total = measure(reduced, indices, slot.k, slot.numel)
            finite = tf.reduce_all(tf.math.is_finite(tf.stack([selected, topk, total])))
            counts, sums = health.counts.read_value(), health.sums.read_value()
            captured = tf.where(topk > 0, selected / tf.where(topk > 0, topk, 1.0), tf.constant(1.0, tf.float64))
            dense, low, good, stays_low = next_streaks(
                counts[_C["dense"]] > 0, counts[_C["low"]], counts[_C["good"]], captured < self.health.min_captured,
                self.health.patience, self.health.fallback, _where)
            alarm = tf.logical_and(stays_low, counts[_C["alarm_step"]] < 0)
            new = {"check_step": t, "hits": hits, "low": low, "good": good, "dense": tf.cast(dense, tf.int64),
                   "checks": counts[_C["checks"]] + 1,
                   "alarm_step": tf.where(alarm, t, counts[_C["alarm_step"]]),
                   "alarm_hits": tf.where(alarm, hits, counts[_C["alarm_hits"]])}
            new_counts = tf.stack([new.get(name, counts[i]) for i, name in enumerate(COUNTS)])
            measured = tf.stack([selected, topk, total])
            new_sums = tf.concat([measured, tf.where(alarm, measured, sums[3:])], 0)
            with tf.control_dependencies([health.counts.assign(tf.where(finite, new_counts, counts)),
                                          health.sums.assign(tf.where(finite, new_sums, sums))]):
                return tf.constant(0)

        def skip():
            return tf.constant(0)

        return tf.cond(check, record, skip)

    # -- between steps (eager) ------------------------------------------------------------------------

    def _health_monitor(self):
        """A :class:`HealthMonitor` holding what the variables hold (``warn=False``: see :meth:`_health_warn`)."""
        monitor = HealthMonitor(self.health, [s.name for s in self._checked_slots()], warn=False)
        monitor.load_state_dict({s.name: s.health.monitor_entry(s.k) for s in self._checked_slots()})
        return monitor

    def _checked_slots(self):
        """The variables the checks cover (the compressed ones)."""
        return [s for s in self._slots if s.health is not None]

    def _health_warn(self):
        """Warn once per ScaleCom, on the process set's rank 0, when some variable's checks first stayed
        low (the earliest such check; Python-side, so from ``stats()`` between steps)."""
        if self._health_warned:
            return
        alarms = []
        for slot in self._checked_slots():
            counts, sums = slot.health.values()
            if counts["alarm_step"] >= 0:
                alarms.append((counts["alarm_step"], slot.index, slot.name, Measures(
                    counts["alarm_hits"], slot.k, sums["alarm_selected"], sums["alarm_topk"], sums["alarm_total"])))
        leads = not hvd.is_initialized() or self._process_set.included() and self._process_set.rank() == 0
        if alarms and leads:
            self._health_warned = True
            step, _, name, measures = min(alarms, key=lambda a: a[:2])
            warnings.warn(warning_text(name, step, measures, self.health), stacklevel=4)  # (stats()'s caller)

    def _health_stats(self, this_step, total, step):
        """``stats()``'s bytes of check and fallback steps (a check sends ``p`` densely as its values,
        a fallback step densely with no indices; counted in the values' dtype), its ``"health"``
        (:meth:`HealthMonitor.summary`) and the warning."""
        for slot in self._checked_slots():
            counts, _ = slot.health.values()
            size = itemsize(self._value_dtype or slot.grad_dtype)
            index_bytes = self._index_bytes(slot)
            done = int(slot.step.numpy())
            if done - int(slot.health.kinds.shape[0]) <= step < done:
                kind = int(slot.health.kinds.numpy()[step % int(slot.health.kinds.shape[0])])
                _resend(this_step, kind, slot, size, index_bytes, 1)
            _resend(total, CHECK, slot, size, index_bytes, counts["check_steps"])
            _resend(total, FALLBACK, slot, size, index_bytes, counts["fallback_steps"])
        self._health_warn()
        return self._health_monitor().summary()

    def _health_state(self):
        return self._health_monitor().state_dict()

    def _checked_health_state(self, state):
        """The per-variable health entries of ``state`` (``None`` each for a state without health),
        checked by :meth:`HealthMonitor.load_state_dict` before anything changes."""
        saved = state.get("health")
        if saved is None:
            return {s.name: None for s in self._checked_slots()}
        HealthMonitor(self.health, [s.name for s in self._checked_slots()], warn=False).load_state_dict(saved)
        return saved

    def _load_health(self, entries):
        for slot in self._checked_slots():
            slot.health.load(entries[slot.name])
        self._health_warned = False


def _resend(traffic, kind, slot, size, index_bytes, times):
    """Turn ``times`` compressed steps of ``slot`` counted in ``traffic`` into check (``p`` as values)
    or fallback (``p`` dense, no indices) steps."""
    if kind == CHECK:
        traffic.value_bytes += times * (slot.numel - slot.k) * size
    elif kind == FALLBACK:
        traffic.value_bytes -= times * slot.k * size
        traffic.index_bytes -= times * index_bytes
        traffic.dense_bytes += times * slot.numel * size
