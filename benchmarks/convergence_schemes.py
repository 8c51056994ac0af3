"""The schemes of the convergence benchmark, how their traffic is matched to ScaleCom's, and the
training loop that runs one (task, scheme, n) configuration in the simulator.

Matching (bytes are the simulator's exact accounting: bytes sent per worker per step, averaged over
workers and over steps, indices, values and the dense small tensors together):

* the top-k family keeps ScaleCom's k (``ratio``, per tensor, same ``min_numel``): local top-k,
  global top-k, gTop-k and random-k select the same number of entries; their bytes then differ
  by construction (allgather for local top-k, log2 n exchanges for gTop-k, no indices for random-k)
  and that difference is the point;
* the others are matched on bytes: for each n, one free knob is set (by bisection) so that the
  scheme's bytes per worker per compressed step come closest to ScaleCom's at that n (beta does not
  change bytes), measured by running the simulator itself on random gradients. The knob: Qsparse's
  ``ratio`` (H = 8 and SignTop-k as in the authors' code); Sketched SGD's ``ratio`` (its k), with the
  sketch in FetchSGD's proportions (5 rows, 10 k columns, 2 k candidates fetched in round 2; a
  byte-matched pilot at n = 64 on digits with a larger k and a smaller sketch collided so much that
  it diverged); PowerSGD's ``rank`` (an integer: the nearest in bytes);
* dense and FP16 are the references.
"""

import dataclasses
import math
import time

import torch

from hvd_scalecom.sim import (
    FP16,
    Dense,
    GlobalTopK,
    GTopK,
    LocalTopK,
    PowerSGD,
    QsparseLocalSGD,
    RandomK,
    ScaleCom,
    Simulator,
    SketchedSGD,
    per_worker_gradients,
)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Hyper-parameters every scheme of a task shares.

    The peak learning rate is ``lr * (n / reference_n) ** scaling`` (``scaling = 1``: linear scaling
    with the global batch, which grows with n at a fixed per-worker ``batch``; ``0.5``: square root),
    reached by a linear warm-up over ``warmup`` steps, then cosine-decayed to 0 at ``steps``.
    ``compression_warmup``: dense steps before any scheme starts compressing (every scheme's
    ``warmup_steps``).
    """

    steps: int
    batch: int
    lr: float
    scaling: float = 1.0
    reference_n: int = 4
    warmup: int = 0
    momentum: float = 0.9
    compression_warmup: int = 0
    eval_every: int = 16
    ratio: float = 0.01
    min_numel: int = 1024

    def peak_lr(self, n):
        return self.lr * (n / self.reference_n) ** self.scaling

    def lr_at(self, t, n):
        warm = min(1.0, (t + 1) / self.warmup) if self.warmup else 1.0
        return self.peak_lr(n) * warm * 0.5 * (1.0 + math.cos(math.pi * t / self.steps))


@dataclasses.dataclass(frozen=True)
class SchemeSpec:
    """One row of the comparison: ``key``, a ``label`` and how it is built (see :func:`build`)."""

    key: str
    label: str
    matched: str  # how its traffic relates to ScaleCom's: "reference", "same k", "bytes"


SCHEMES = (
    SchemeSpec("dense", "dense SGD (fp32 allreduce)", "reference"),
    SchemeSpec("fp16", "FP16 allreduce", "reference"),
    SchemeSpec("scalecom_b1", "ScaleCom, beta 1 (no filter)", "same k"),
    SchemeSpec("scalecom", "ScaleCom, beta 0.1 (low-pass filter)", "same k"),
    SchemeSpec("local_topk", "local top-k + EF (allgather)", "same k"),
    SchemeSpec("global_topk", "global top-k + EF (oracle indices)", "same k"),
    SchemeSpec("gtopk", "gTop-k (pairwise merges)", "same k"),
    SchemeSpec("random_k", "random-k + EF (shared seed)", "same k"),
    SchemeSpec("sketched", "Sketched SGD (count sketch)", "bytes"),
    SchemeSpec("powersgd", "PowerSGD (rank r, EF)", "bytes"),
    SchemeSpec("qsparse", "Qsparse-local-SGD (H = 8, SignTop-k)", "bytes"),
)
BY_KEY = {s.key: s for s in SCHEMES}
SCALECOM_BETA = 0.1
QSPARSE_LOCAL_STEPS = 8
SKETCH_ROWS, SKETCH_CANDIDATES = 5, 2  # FetchSGD's r = 5, p2 = 2, and columns c = 10 k (its ratio)


def build(key, recipe, n, knob=None, local_steps=None):
    """The scheme ``key`` under ``recipe``; ``knob`` is the matched parameter of the "bytes" schemes;
    ``local_steps``: Qsparse's H, if not ``QSPARSE_LOCAL_STEPS``."""
    common = {"warmup_steps": recipe.compression_warmup, "min_numel": recipe.min_numel}
    r = recipe.ratio
    if key == "dense":
        return Dense()
    if key == "fp16":
        return FP16()
    if key == "scalecom_b1":
        return ScaleCom(ratio=r, beta=1.0, **common)
    if key == "scalecom":
        return ScaleCom(ratio=r, beta=SCALECOM_BETA, **common)
    if key == "scalecom_exact":  # torch.topk's selection: the same top-k but for ties at the k-th magnitude
        return ScaleCom(ratio=r, beta=SCALECOM_BETA, selection="exact", **common)
    if key == "scalecom_pipelined":  # indices one step stale (the pipelined mode)
        return ScaleCom(ratio=r, beta=SCALECOM_BETA, pipelined=True, **common)
    if key.startswith("scalecom_beta"):  # scalecom_beta0.3 and the like, for the beta sweep
        return ScaleCom(ratio=r, beta=float(key[len("scalecom_beta"):]), **common)
    if key.startswith("scalecom:"):  # "scalecom:check_every=8,fallback=dense,min_captured=0.5,ratio=0.1"
        return ScaleCom(**{"ratio": r, "beta": SCALECOM_BETA, **common, **scalecom_options(key)})
    if key == "local_topk":
        return LocalTopK(ratio=r, **common)
    if key == "global_topk":
        return GlobalTopK(ratio=r, traffic="clt-k", **common)
    if key == "gtopk":
        return GTopK(ratio=r, **common)
    if key == "random_k":
        return RandomK(ratio=r, **common)
    if key == "sketched":
        return SketchedSGD(ratio=float(knob or r), rows=SKETCH_ROWS, columns=None,
                           candidates=SKETCH_CANDIDATES, momentum=recipe.momentum, **common)
    if key == "powersgd":
        return PowerSGD(rank=int(knob or 1), **common)
    if key == "qsparse":
        return QsparseLocalSGD(lr=recipe.peak_lr(n), local_steps=local_steps or QSPARSE_LOCAL_STEPS,
                               ratio=float(knob or r),
                               operator="sign_top_k", momentum=recipe.momentum, min_numel=recipe.min_numel)
    raise ValueError(f"unknown scheme {key!r}")


SCALECOM_OPTIONS = {"check_every": int, "fallback": str, "min_captured": float, "patience": int, "ratio": float,
                    "beta": float}


def scalecom_options(key):
    """ScaleCom's arguments in a key ``"scalecom:NAME=VALUE,..."`` (names of :data:`SCALECOM_OPTIONS`)."""
    options = {}
    for item in key.partition(":")[2].split(","):
        name, eq, value = item.partition("=")
        if not eq or name not in SCALECOM_OPTIONS:
            raise ValueError(f"scheme {key!r}: expected NAME=VALUE with NAME one of {', '.join(SCALECOM_OPTIONS)}, "
                             f"got {item!r}")
        options[name] = SCALECOM_OPTIONS[name](value)
    return options


# -- traffic matching ---------------------------------------------------------------------------------

def bytes_per_step(scheme, n, model, steps=1):
    """Mean bytes sent per worker per step of ``scheme`` over ``steps`` steps of random gradients."""
    sim = Simulator(scheme, n, model.named_parameters(), diagnostics=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        sim.step_stacked([torch.randn(n, *p.shape, generator=generator) for p in model.parameters()])
    totals = sim.totals()
    return totals["sent_bytes"] / totals["steps"]


def scalecom_bytes(recipe, n, model):
    """ScaleCom's bytes sent per worker per compressed step (the target of the "bytes" schemes)."""
    return bytes_per_step(build("scalecom", dataclasses.replace(recipe, compression_warmup=0), n), n, model)


def match_knob(key, recipe, n, model, target):
    """The knob of a "bytes" scheme whose bytes per worker per compressed step come closest to ``target``.

    Qsparse is measured over one synchronisation (``local_steps = 1``) and its bytes divided by H:
    it sends the same payload every H-th step.
    """
    recipe = dataclasses.replace(recipe, compression_warmup=0)
    cost = {}

    def measure(x):
        if x not in cost:
            if key == "qsparse":  # one step synchronises
                cost[x] = bytes_per_step(build(key, recipe, n, x, local_steps=1), n, model) / QSPARSE_LOCAL_STEPS
            else:
                cost[x] = bytes_per_step(build(key, recipe, n, x), n, model)
        return cost[x]

    if key == "powersgd":
        ranks = [1]
        while measure(ranks[-1]) < target and ranks[-1] < 64:
            ranks.append(ranks[-1] + 1)
        best = min(ranks, key=lambda x: abs(measure(x) - target))
    elif key in ("sketched", "qsparse"):
        lo, hi = 1e-5, 1.0
        for _ in range(18):  # bisection in log space: ratio to within 0.1 %
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if measure(mid) < target else (lo, mid)
        best = min((lo, hi), key=lambda x: abs(measure(x) - target))
    else:
        raise ValueError(f"{key!r} has no knob to match")
    return best, measure(best)


# -- one configuration --------------------------------------------------------------------------------

def train(task, key, n, recipe, seed=0, knob=None, progress=None):
    """Train ``task``'s model with scheme ``key`` on ``n`` simulated workers; return the run's record.

    The record holds the final metrics, the evaluation curve, per-step bytes sent per worker, and
    per-step diagnostics (ScaleCom's overlap, every scheme's mean residue norm), plus timing.
    Qsparse-local-SGD has no dense warm-up of its own: during ``recipe.compression_warmup`` it is
    replaced by dense SGD (same optimizer), and starts its local steps from the warmed-up model.
    """
    model = task.model(seed)
    scheme = build(key, recipe, n, knob)
    warm = recipe.compression_warmup if isinstance(scheme, QsparseLocalSGD) else 0
    sampler = task.sampler(n, recipe.batch, seed)
    curve = [{"step": 0, **task.evaluate(model)}]
    history = []
    start, cpu = time.perf_counter(), time.process_time()
    sim = optimizer = None
    for t in range(recipe.steps):
        if t == 0 or t == warm:
            if sim is not None:
                history += sim.history
            current = Dense() if t < warm else scheme
            sim = Simulator(current, n, model.named_parameters(), diagnostics=key.startswith("scalecom"))
            sim.step_count = t
            optimizer = None
            if current.kind == "gradient":  # Sketched SGD runs its own momentum (as in the paper)
                momentum = 0.0 if isinstance(current, SketchedSGD) else recipe.momentum
                optimizer = torch.optim.SGD(model.parameters(), lr=recipe.lr_at(t, n), momentum=momentum)
        lr = recipe.lr_at(t, n)
        if optimizer is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        else:
            sim.scheme.lr = lr
        x, y = sampler()
        grads = per_worker_gradients(model, task.loss, sim.worker_params(), x, y)
        sim.step_stacked(grads).apply_to(model.parameters(), optimizer)
        if (t + 1) % recipe.eval_every == 0 or t + 1 == recipe.steps:
            curve.append({"step": t + 1, **task.evaluate(model)})
            if progress:
                progress(t + 1, curve[-1])
            if not all(math.isfinite(v) for v in curve[-1].values()):
                break
    history += sim.history
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    health = _health_record(history, recipe.compression_warmup, getattr(scheme, "health_summary", lambda: None)())
    final = dict(curve[-1])
    sent = [h["sent_bytes"] for h in history]
    compressed = sent[recipe.compression_warmup:] or sent
    return {
        "task": task.name, "scheme": key, "label": BY_KEY[key].label if key in BY_KEY else key,
        "n": n, "seed": seed, "knob": knob, "final": final,
        "diverged": not all(math.isfinite(v) for v in final.values()) or len(history) < recipe.steps,
        "bytes_per_step": sum(compressed) / len(compressed),
        "bytes_per_step_run": sum(sent) / len(sent),
        "index_bytes_per_step": _mean_after(history, "sent_index_bytes", recipe.compression_warmup),
        "value_bytes_per_step": _mean_after(history, "sent_value_bytes", recipe.compression_warmup),
        "dense_bytes_per_step": _mean_after(history, "sent_dense_bytes", recipe.compression_warmup),
        "uncompressed_bytes_per_step": history[0]["uncompressed_sent_bytes"],
        "curve": curve,
        "overlap": [_rounded(h.get("overlap")) for h in history],
        "residue_norm": [_rounded(h.get("residue_norm")) for h in history],
        "seconds": seconds, "cpu_seconds": cpu,
        "steps": len(history),
        **({"health": health} if health else {}),
    }


def _health_record(history, skip, summary):
    """ScaleCom's health check over a run: per step ``captured`` and ``overlap`` (None where no tensor
    was checked) and ``dense_tensors`` (sent densely from the next step on); ``summary``, the monitor's
    at the end (its latest checks); ``plain_bytes_per_step``, the mean bytes of the compressed steps
    that neither checked nor fell back (those of ScaleCom without the check)."""
    if summary is None:
        return None
    steps = history[skip:]
    plain = [h["sent_bytes"] for previous, h in zip(history[skip - 1:] if skip else [{}] + history, steps)
             if "health_checks" not in h and not previous.get("health_dense_tensors")]
    return {"captured": [_rounded(h.get("health_captured")) for h in history],
            "overlap": [_rounded(h.get("health_overlap")) for h in history],
            "dense_tensors": [h.get("health_dense_tensors") for h in history],
            "plain_bytes_per_step": sum(plain) / len(plain) if plain else None,
            "summary": summary}


def _mean_after(history, key, skip):
    values = [h[key] for h in history[skip:]] or [h[key] for h in history]
    return sum(values) / len(values)


def _rounded(x, digits=5):
    """``x`` to ``digits`` significant digits; None where nothing was recorded, non-finite kept as it is
    (a residue that overflowed is not one that was not measured)."""
    return x if x is None or not math.isfinite(x) else float(f"{x:.{digits}g}")
