"""Sketched SGD's per-step equations (Ivkin et al., NeurIPS 2019, Alg. 1) on torch tensors.

Terms: ``u`` momentum and ``v`` error accumulation (their Alg. 1's u and v), one row per worker or a
single flat vector on one Horovod rank; ``S(.)`` an ``r x c`` count sketch
(:class:`hvd_scalecom.torch.sketch.CountSketch`), ``P`` the candidate factor. Per step:

1. ``u <- rho u + g``; ``v <- v + u``                          (:func:`accumulate_`)
2. round 1: the sketches are summed, ``S = sum_i S(v_i)``       (by the caller: an allreduce)
3. the ``P k`` coordinates of largest estimated ``|sum_i v_i|``  (:func:`heavy_candidates`; a
   non-finite ``S`` skips steps 3-5 instead, :func:`skip_nonfinite_`)
4. round 2: their exact sums ``sum_i v_i[candidates]``; the top k of those are applied
   (:func:`select_applied`), as ``scatter(I, values) / n``
5. ``u[I] = v[I] = 0`` on every worker                          (:func:`zero_applied_`)

Everything here is local arithmetic: the Horovod compressor (:mod:`hvd_scalecom.torch.sketched_sgd`)
and a one-process simulation call the same functions around their own "allreduce".
No Horovod import, so these serve the simulator too.
"""

import functools

import torch

from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.dtypes import wire_dtype


def momentum_(u, g, rho):
    """Step 1's momentum in place, ``u <- rho u + g`` (alone: dense tensors and warm-up steps)."""
    u.mul_(rho).add_(g.reshape(u.shape))


def accumulate_(u, v, g, rho):
    """Step 1 in place: ``u <- rho u + g``, ``v <- v + u`` (``g`` of ``u``'s shape or flat-compatible)."""
    momentum_(u, g, rho)
    v.add_(u)


def heavy_candidates(sketch, table, count):
    """Step 3: the ``count`` coordinates of largest ``|estimate|`` of the summed sketch ``table``, int64
    and ascending; of the coordinates tied at the count-th magnitude, the lowest indices (``table``
    finite: see :func:`skip_nonfinite_`).

    Every rank holds the same reduced table, so every rank finds the same candidates, in the same
    order, without sending any index: round 2 sums ``v_i[candidates]`` position by position, so the
    set and its order must not depend on which path (C, torch operations, CUDA) found them. They come
    from ScaleCom's exact top-k (:func:`hvd_scalecom.torch.clt_k.select_top_k`, ``"threshold"``: on
    the CPU one C pass over the estimate instead of ``torch.topk``), then the entries reaching its
    smallest magnitude are taken again in index order (one read-only pass and its ``nonzero``).
    """
    estimate = sketch.estimate(table)
    count = min(sketch.numel, count)
    chosen = clt_k.select_top_k(estimate, count, "threshold")
    if count == 0 or count == sketch.numel:
        return torch.arange(count, device=estimate.device)
    magnitude = estimate.abs()
    kth = magnitude[chosen].amin()
    reaching = torch.nonzero(magnitude >= kth).flatten()     # ascending: every larger one and all ties
    tied = magnitude[reaching] == kth
    spare = count - int((~tied).sum())                       # how many of the ties are taken
    return reaching[~tied | (tied.cumsum(0) <= spare)]


def select_applied(candidates, exact, k):
    """Step 4: ``(I, sums)``, the ``k`` candidates of largest exact ``|sum|`` and those sums."""
    chosen = torch.topk(exact.abs(), min(k, exact.numel()), sorted=False).indices
    return candidates[chosen], exact[chosen]


def applied_update(indices, sums, numel, n, dtype=torch.float32):
    """The update every worker applies: ``scatter(I, sums) / n`` (the mean over workers)."""
    update = torch.zeros(numel, dtype=dtype, device=sums.device)
    update[indices] = sums.to(dtype) / n
    return update


def zero_applied_(u, v, indices):
    """Step 5: zero the applied coordinates of the momentum and the error accumulation (last axis)."""
    u[..., indices] = 0.0
    v[..., indices] = 0.0


def skip_nonfinite_(u, v, numel, dtype=torch.float32):
    """A step whose reduced sketch is not finite (the same table on every rank, so every rank takes
    this path): no round 2; the non-finite entries of this rank's ``u`` and ``v`` (those a non-finite
    gradient brought in, on the rank that had it) are reset to 0, and the step's update, returned, is
    NaN, so that the optimizer sees a non-finite gradient as it would without compression. The rest
    of ``u`` and ``v`` is kept, including the finite gradients every rank accumulated in this step."""
    reset_nonfinite_(u, v)
    return torch.full((numel,), float("nan"), dtype=dtype, device=v.device)


def reset_nonfinite_(*states):
    """Set the non-finite entries of ``states`` to 0 (a rank's momentum or error after a non-finite
    gradient, once it has been sent: the NaN reaches the optimizer, the state keeps none)."""
    for state in states:
        if not clt_k.all_finite(state):
            state.masked_fill_(~torch.isfinite(state), 0.0)


def warmup_wire_dtype(dtypes):
    """The dtype a warm-up step's momentum of the sketched gradients (of ``dtypes``) travels in, whole:
    their wire dtypes (:func:`hvd_scalecom.torch.dtypes.wire_dtype`) promoted, so each gradient's own
    where they agree, as the optimizer's dense allreduce would send it."""
    return functools.reduce(torch.promote_types, [wire_dtype(d) for d in dtypes])


def vector_dtype(dtypes):
    """The dtype of the sketched vector's momentum and error (u, v) for gradients of ``dtypes``: fp32,
    or wider where one is (float64)."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)
