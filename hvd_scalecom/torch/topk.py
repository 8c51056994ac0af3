"""Index selections of the top-k baselines, on torch tensors whose rows are workers.

``P`` is ``(n, d)``: row i is worker i's error-compensated vector ``p_i = m_i + g_i`` of one tensor.
Values and residue memories go through :func:`hvd_scalecom.torch.clt_k.take` and
:func:`~hvd_scalecom.torch.clt_k.filter_memory_`, the functions ScaleCom uses; this module only
decides *which* entries travel.

* local top-k (Aji & Heafield 2017; Stich et al. 2018): each worker its own ``I_i = top_k(|p_i|)``;
* random-k with a shared seed: every worker draws the same ``I`` without communicating;
* gTop-k (Shi et al., arXiv:1901.04359, Alg. 2 "gTopKAllReduce"): local top-k sets merged pairwise
  over ``log2 n`` rounds, each merge summing equal indices and keeping the top k of the sum.

No Python loops over entries; gTop-k loops over its ``log2 n`` rounds only.
"""

import torch


def select_top_k_rows(P, k):
    """Local top-k: ``(n, k)`` int64 indices of the ``k`` largest ``|P[i]|`` in every row i."""
    n, numel = P.shape
    if k >= numel:
        return torch.arange(numel, device=P.device).expand(n, numel).clone()
    return torch.topk(P.abs(), k, dim=1, sorted=False).indices


def flat_indices(indices, n, numel):
    """Indices into the row-major flat view of an ``(n, numel)`` tensor.

    ``indices`` is ``(k,)`` (the same set on every row, as CLT-k's and random-k's) or ``(n, k)`` (one set
    per row); the result is ``(n * k,)``, row by row.
    """
    offsets = torch.arange(n, device=indices.device).unsqueeze(1) * numel
    return (indices.expand(n, -1) + offsets).reshape(-1)


def shared_random_indices(numel, k, seed, step, tensor_index, device=None):
    """Random-k: ``k`` distinct indices of a tensor, a function of ``(seed, step, tensor_index)`` only.

    Every worker calls this with the same arguments and gets the same set, so only the k values travel
    (no indices). A private generator is used: the caller's global RNG stream is untouched.
    """
    mixed = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 1_000_003 + int(tensor_index)) % (2**63 - 1)
    generator = torch.Generator().manual_seed(mixed)
    return torch.randperm(numel, generator=generator)[:k].to(device)


def gtopk_merge(indices, values, numel):
    """gTop-k's tree reduction of ``n = 2**R`` workers' sparse sets (Shi et al. 2019, Alg. 2).

    indices, values: ``(n, k)``, worker i's local top-k ``I_i`` and ``p_i[I_i]``.
    Round r pairs the groups of ``2**r`` workers that differ in bit r of the rank (recursive doubling:
    both partners exchange their k pairs and compute the same merge): values at equal indices are
    summed and the k largest magnitudes of the sum are kept; the rest is dropped.

    Returns ``(I, v, contributed)``: the global set ``I`` (k,), its summed values ``v`` (k,), and
    ``contributed`` (n, k) bool, whether worker i's entry j survived every merge and so is part of
    ``v``. ``v == sum over i of values[i] where contributed[i]`` (per index), up to summation order.
    """
    n, k = indices.shape
    if n & (n - 1):
        raise ValueError(f"gTop-k merges pairwise and needs a power-of-two number of workers, got {n}")
    device = indices.device
    group_of = torch.arange(n, device=device)
    contributed = torch.ones(n, k, dtype=torch.bool, device=device)
    current_i, current_v = indices, values
    groups = n
    while groups > 1:
        groups //= 2
        group_of = group_of // 2
        pair_i = current_i.reshape(groups, 2 * k)   # rows 2g and 2g+1 side by side
        pair_v = current_v.reshape(groups, 2 * k)
        summed = torch.zeros(groups, numel, dtype=values.dtype, device=device).scatter_add_(1, pair_i, pair_v)
        # Score the 2k candidates by |sum|; an index both partners hold counts once (its first copy).
        first = torch.zeros(groups, numel, dtype=torch.bool, device=device).scatter_(1, pair_i[:, :k], True)
        duplicate = torch.cat([torch.zeros(groups, k, dtype=torch.bool, device=device),
                               first.gather(1, pair_i[:, k:])], dim=1)
        candidate_v = summed.gather(1, pair_i)
        score = torch.where(duplicate, torch.full_like(candidate_v, -1.0), candidate_v.abs())
        # The union of two k-sets has at least k entries, so no duplicate (score -1) is ever kept.
        pick = torch.topk(score, k, dim=1, sorted=False).indices
        keep = pair_i.gather(1, pick)
        kept = torch.zeros(groups, numel, dtype=torch.bool, device=device).scatter_(1, keep, True)
        contributed &= kept.reshape(-1)[group_of.unsqueeze(1) * numel + indices]
        current_i, current_v = keep, candidate_v.gather(1, pick)
    return current_i[0], current_v[0], contributed
