"""The collectives of a Sketched SGD step on one Horovod rank beyond the optimizer's own (Ivkin et al.,
NeurIPS 2019, Alg. 1, the steps of :mod:`hvd_scalecom.torch.sketched_steps`), and the errors that say
why a step failed.

Round 1, ``<name>.sketch``: a Sum of the ``r x c`` tables ``S = sum_i S(v_i)`` (in warm-up, of the whole
momentum ``u``), posted by the step's last ``compress`` of a sketched tensor. Round 2,
``<name>.candidates``: a Sum of ``v_i`` at the ``P k`` candidates, from the step's first ``decompress``.

Invariant (why no hook order deadlocks): nothing in ``compress`` waits, and Horovod calls every
``compress`` of a step before the first ``decompress``; each round is one collective of a fixed name per
step. So when a rank waits for a round, every rank has posted it or will, without waiting first.
"""

import time
from typing import NamedTuple

import horovod.torch as hvd
import torch

from hvd_scalecom.agreement import DTYPES_HINT
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.sketched_steps import (
    accumulate_,
    applied_update,
    heavy_candidates,
    momentum_,
    reset_nonfinite_,
    select_applied,
    skip_nonfinite_,
    zero_applied_,
)


class StepRound:
    """The sketched part of one step on this rank: which tensors were compressed (and, until the
    step's last one is, their gradients: u and v take them in all at once, so that a step that never
    completes leaves them as they were), the round-1 table in flight, and (after round 2) the update."""

    __slots__ = ("t", "warmup", "compressed", "pending", "decompressed", "table", "handle", "update")

    def __init__(self, t, warmup):
        self.t = t
        self.warmup = warmup  # a warm-up step: the table is the whole momentum u, reduced densely
        self.compressed = set()
        self.pending = []
        self.decompressed = 0
        self.table = None
        self.handle = None
        self.update = None

# What the first step's configuration check tells a rank whose entry differs from the others'.
AGREEMENT_HINTS = {
    "parameter_digest": "(parameter_digest covers the names and shapes of named_parameters.)",
    "parameter_dtypes": DTYPES_HINT,
    "loss_scaler": "(a loss_scaler given on some ranks only: the others' momentum and "
                   "error accumulation would not follow the loss scale.)",
    "name": "(name prefixes SketchedSGD's allreduces: give it the same value on every rank.)",
    "sketched_digest": "(sketched_digest covers which parameters are sketched: freeze the same parameters "
                       "on every rank before building SketchedSGD.)",
    "steps": "(steps lists the parameters' distinct step counters, which decide warm-up and which tensors "
             "a step sketches: restore every rank from a state of the same step.)"}


class RoundTwo(NamedTuple):
    """What :func:`round_two` did: ``indices`` ``I`` applied (None in warm-up, empty when skipped),
    ``waited`` seconds, ``candidate_bytes`` sent and ``nonfinite`` (the reduced sketch was not finite)."""
    indices: object
    waited: float
    candidate_bytes: int
    nonfinite: bool


def process_set_kwargs(process_set):
    return {} if process_set is None else {"process_set": process_set}


def post_round_one(r, u, v, offset, sketch, rho, warmup_dtype, name, process_set):
    """The step's last ``compress`` of a sketched tensor: takes in the gradients of ``r.pending``,
    ``u <- rho u + g``, ``v <- v + u`` on each one's slice (``offset``: parameter index -> start), and
    posts round 1, ``S(v)`` (in warm-up: ``u <- rho u + g`` alone, and ``u`` whole in ``warmup_dtype``).
    Returns the bytes of the table sent (0 in warm-up: those count as dense)."""
    if r.warmup:
        for j, grad in r.pending:
            momentum_(u[offset[j]:offset[j] + grad.numel()], grad, rho)     # u <- rho u + g
        r.table = u.to(warmup_dtype, copy=True)  # (fresh: reduced in place)
        reset_nonfinite_(u)  # (once sent: a non-finite gradient reaches the optimizer, not u)
    else:
        for j, grad in r.pending:
            part = slice(offset[j], offset[j] + grad.numel())
            accumulate_(u[part], v[part], grad, rho)                       # u <- rho u + g, v <- v + u
        r.table = sketch.sketch(v)
    r.pending = None
    r.handle = post_sketch(r.table, name, process_set)
    return 0 if r.warmup else r.table.numel() * v.element_size()


def post_sketch(table, name, process_set):
    """Posts ``table`` as ``<name>.sketch``, a Sum; a collective of that name still in flight (another
    SketchedSGD of the same ``name`` in the same step) is a ValueError naming it."""
    try:
        return hvd.allreduce_async_(table, name=f"{name}.sketch", op=hvd.Sum, **process_set_kwargs(process_set))
    except ValueError as err:
        if "same name" not in str(err):
            raise
        raise ValueError(f"SketchedSGD(name={name!r}): Horovod has another '{name}.sketch' "
                         f"allreduce in flight, from another SketchedSGD of the same name whose step "
                         f"overlaps this one (two optimizers stepped after one backward): give each "
                         f"SketchedSGD its own name=. Horovod: {err}") from err


def wait_round_one(r):
    """Waits for round 1 of ``r``; returns the seconds waited (Horovod's errors pass through)."""
    wait_from = time.perf_counter()
    hvd.synchronize(r.handle)                                  # S = sum_i S(v_i) (warm-up: sum_i u_i)
    return time.perf_counter() - wait_from


def round_two(r, sketch, u, v, k, num_candidates, size, name, process_set):
    """After round 1: sets ``r.update`` (in warm-up ``sum_i u_i / n``) and zeroes u and v at ``I``; a
    reduced sketch that is not finite skips round 2 on every rank (:func:`sketched_steps.skip_nonfinite_`).
    Returns a :class:`RoundTwo`."""
    numel = v.numel()
    table, r.table, r.handle = r.table, None, None
    if r.warmup:  # dense momentum SGD: mean_i u_i
        r.update = table.to(v.dtype) / size
        return RoundTwo(None, 0.0, 0, False)
    if not clt_k.all_finite(table):  # the same table on every rank: all skip round 2
        r.update = skip_nonfinite_(u, v, numel, dtype=v.dtype)
        return RoundTwo(torch.zeros(0, dtype=torch.int64, device=v.device), 0.0, 0, True)
    candidates = heavy_candidates(sketch, table, num_candidates)
    wait_from = time.perf_counter()
    exact = hvd.allreduce(v[candidates], name=f"{name}.candidates", op=hvd.Sum,  # sum_i v_i[candidates]
                          **process_set_kwargs(process_set))
    waited = time.perf_counter() - wait_from
    indices, sums = select_applied(candidates, exact, k)
    r.update = applied_update(indices, sums, numel, size, dtype=v.dtype)
    zero_applied_(u, v, indices)
    return RoundTwo(indices, waited, exact.numel() * exact.element_size(), False)


def lockstep_message(name, t, r, steps):
    """A sketched tensor ``name`` at step ``t`` while round ``r`` of another step is in progress."""
    return (f"SketchedSGD: the sketched tensors are not reduced in lockstep ({name!r} is at "
            f"step {t}, the step in progress is {r.t}; steps reduced so far: {steps}). Every "
            f"parameter that SketchedSGD sketches must be reduced by the optimizer every step (not "
            f"frozen after SketchedSGD was built but before the optimizer, no sparse gradients "
            f"without sparse_as_dense=True).")


def incomplete_step_message(name, missing):
    """``name`` decompressed before the sketched tensors ``missing`` were compressed."""
    return (f"SketchedSGD: {name!r} was decompressed before the sketched tensors {missing} "
            f"were compressed in this step, so the step's sketch is incomplete (the sketched tensors' "
            f"momentum, error accumulation and step counters are left as they were before it). Every "
            f"sketched tensor's update needs all of them: hvd.allreduce(p.grad, compression=SketchedSGD) "
            f"of one gradient at a time cannot work (reduce them all in one hvd.grouped_allreduce, or "
            f"through hvd.DistributedOptimizer). Under hvd.DistributedOptimizer, pass only the "
            f"parameters the optimizer reduces every step (parameters frozen after SketchedSGD was "
            f"built but before the optimizer, or sparse gradients without sparse_as_dense=True, are "
            f"not: freeze parameters before building both).")


def mismatch_message(r, name, warmup_steps, prefix, err):
    """Round 1 of ``r`` failed by Horovod for mismatched shapes or dtypes: the ranks' step counters lie on
    either side of the end of warm-up (a flat ``u`` met an ``r x c`` table). ``name``: the tensor
    decompressed; ``prefix``: the collectives' name."""
    mine, theirs = (("in warm-up: it sent the whole momentum u, reduced densely", "past warm-up: its "
                     "r x c sketch") if r.warmup else
                    ("past warm-up: it sent its r x c sketch", "in warm-up: the whole momentum u"))
    return (f"SketchedSGD: the ranks' step counters differ on either side of the end of warm-up "
            f"(warmup_steps={warmup_steps}), so they reduced {name!r} and the other sketched tensors "
            f"in different ways: this rank is at step {r.t}, {mine}, as '{prefix}.sketch', and another "
            f"rank is {theirs}. A load_state_dict() of another step on some ranks does this: restore every "
            f"rank from a state_dict() of the same step (this step's gradients are in this rank's momentum "
            f"and error accumulation, and its step counters have moved on). Horovod: {err}")
