"""ScaleCom's equations on torch tensors: the one implementation used by the Horovod compressor and
by the simulator (``hvd_scalecom.sim``).

Notation of Chen et al. (NeurIPS 2020), Algorithm 1, for one tensor on rank i at step t:

1. ``p_i = m_i + g_i``                                   (error-compensated gradient)
2. ``I = top_k(|p_j|)`` on the leader j                   (CLT-k, :func:`select_top_k`)
3. ``v_i = p_i[I]``, averaged over ranks                  (:func:`take`)
4. ``m_i <- (1 - beta) m_i + beta (p_i - scatter(I, v_i))`` (low-pass filter, :func:`filter_memory_`;
   :func:`take_and_filter_memory_` does 3 and 4 together)
5. the update applies ``scatter(I, mean_i v_i)``          (:func:`scatter_dense`)

All functions work on flat (1-D) views, on any device, without Python loops over entries.
"""

import functools
import math

import torch


def memory_dtype(grad_dtype):
    """Residue memory is kept in at least fp32, whatever the gradient's dtype (fp16/bf16 gradients)."""
    return torch.promote_types(grad_dtype, torch.float32)


def error_compensated(memory, grad):
    """Step 1: ``p = m + g`` as a new flat tensor in the memory's dtype."""
    return torch.add(memory, grad.reshape(-1))


def error_compensated_into(out, memory, grad):
    """Step 1 into ``out`` (flat, the memory's dtype, at least ``memory.numel()`` entries): returns
    ``out[:numel]`` holding ``p = m + g``. A scratch buffer reused from tensor to tensor saves
    allocating (and, for large tensors, page-faulting) a fresh one at every leader step."""
    return torch.add(memory, grad.reshape(-1), out=out[:memory.numel()])


def select_top_k(p, k, selection="exact"):
    """Step 2: flat indices of the ``k`` largest ``|p|`` (int64, in no particular order).

    ``"exact"`` is ``torch.topk`` of ``|p|``. ``"threshold"`` returns the same set (ties at the k-th
    magnitude aside) without a full top-k and without materialising ``|p|``:

    1. a threshold ``t`` a little below the k-th largest magnitude, from a fixed low-discrepancy
       sample of ``p`` (a few thousand gathered entries), set so that fewer than k entries reach it
       with probability about 3e-5 when the sampled values are independent (values clustered at
       the sample's positions make the fallback below more frequent, never the result inexact);
    2. ``p`` seen as an ``(8, numel / 8)`` grid: the largest ``|p|`` of each column from one
       column-wise ``amax`` and one ``amin`` (read-only passes), and the columns reaching ``t``;
    3. the entries of those columns with ``|p| >= t`` are the candidates, a superset of the top k
       whenever there are at least k of them; ``torch.topk`` among the candidates picks the k.

    If fewer than k entries reach ``t`` (or ``t`` is 0, e.g. mostly zeros), it falls back to
    ``"exact"``, so the result is always an exact top-k. Small tensors and ratios above 1/16 use
    ``"exact"`` directly. NaN entries are never selected by ``"threshold"`` (``torch.topk`` ranks
    them first).
    """
    numel = p.numel()
    if selection not in ("exact", "threshold"):
        raise ValueError(f"selection must be 'exact' or 'threshold', got {selection!r}")
    if k >= numel:
        return torch.arange(numel, device=p.device)
    if selection == "exact" or numel < _THRESHOLD_MIN_NUMEL or k * 16 > numel:
        return torch.topk(p.abs(), k, sorted=False).indices
    p = p.reshape(-1)
    threshold = _sampled_threshold(p, k)
    if threshold > 0:
        candidates, magnitudes = _at_least(p, threshold)
        if candidates.numel() >= k:
            return candidates.index_select(0, torch.topk(magnitudes, k, sorted=False).indices)
    return torch.topk(p.abs(), k, sorted=False).indices


_THRESHOLD_MIN_NUMEL = 1 << 16  # below this, torch.topk is about as fast
_GRID_ROWS = 8  # rows of the column pre-filter: a column reaches t with probability ~8x an entry's


@functools.lru_cache(maxsize=256)
def _sample_positions(numel, size, device):
    """``size`` sorted positions in ``[0, numel)`` spread by the golden ratio (no periodic bias)."""
    i = torch.arange(size, dtype=torch.float64)
    positions = (torch.frac(i * 0.6180339887498949 + 0.5) * numel).to(torch.int64)
    return positions.clamp_(0, numel - 1).sort().values.to(device)


@functools.lru_cache(maxsize=64)
def _row_offsets(rows, cols, device):
    return (torch.arange(rows, dtype=torch.int64) * cols).view(rows, 1).to(device)


def _sampled_threshold(p, k):
    """A magnitude that at least k entries of ``p`` reach, with high probability, and not many more.

    Of a sample of ``s`` entries, about ``k s / numel`` (binomially distributed) reach the k-th
    largest magnitude; the threshold is the sample's ``r``-th largest magnitude, ``r`` four standard
    deviations above that, so about ``k (1 + 4 / sqrt(k s / numel))`` entries reach it.
    """
    numel = p.numel()
    size = min(numel, max(4096, min(65536, numel // 256)))
    magnitudes = p.index_select(0, _sample_positions(numel, size, p.device)).abs_()
    expected = k * size / numel
    rank = int(math.ceil(expected + 4.0 * math.sqrt(expected) + 4.0))
    if rank >= size:
        return 0.0
    return float(torch.kthvalue(magnitudes, size - rank + 1).values)


def _at_least(p, threshold):
    """Flat indices (ascending) and magnitudes of the entries with ``|p| >= threshold``."""
    numel = p.numel()
    cols = numel // _GRID_ROWS
    grid = p[:cols * _GRID_ROWS].view(_GRID_ROWS, cols)  # grid[r, c] is p[r * cols + c]
    column_max = torch.amax(grid, 0)
    torch.maximum(column_max, torch.amin(grid, 0).neg_(), out=column_max)  # max |p| per column
    hot = torch.nonzero(column_max >= threshold).view(-1)
    block = grid.index_select(1, hot).abs_()  # the hot columns, (rows, len(hot))
    at = torch.nonzero(block.view(-1) >= threshold).view(-1)
    indices = (_row_offsets(_GRID_ROWS, cols, p.device) + hot).view(-1).index_select(0, at)
    magnitudes = block.view(-1).index_select(0, at)
    if cols * _GRID_ROWS < numel:  # the last numel % 8 entries
        tail = p[cols * _GRID_ROWS:].abs()
        at = torch.nonzero(tail >= threshold).view(-1)
        indices = torch.cat([indices, at + cols * _GRID_ROWS])
        magnitudes = torch.cat([magnitudes, tail.index_select(0, at)])
    return indices, magnitudes


def take_and_filter_memory_(memory, grad, indices, beta, sent_dtype=None):
    """Steps 3-4 on rank i, in place on ``memory``; returns ``v_i = p_i[I]`` in ``sent_dtype``:
    :func:`take` followed by :func:`filter_memory_`.

    ``(1 - beta) m + beta (p - scatter(I, v))`` with ``p = m + g`` equals ``m + beta g`` off I and
    ``(1 - beta) m + beta (p - v)`` on I, so the memory takes one pass (``m += beta g``) plus k-sized
    gathers and scatters; ``p`` is never materialised here. ``p - v`` is zero unless the values travel
    in a narrower dtype (``sent_dtype``, e.g. fp16), whose rounding error is then kept in the memory.
    """
    shape = indices.shape
    indices = indices.reshape(-1).to(torch.int64)
    memory_at_indices, values = take(memory, grad, indices)
    sent = values if sent_dtype is None else values.to(sent_dtype)
    filter_memory_(memory, grad, indices, memory_at_indices, values, sent, beta)
    return sent.view(shape)


def take(memory, grad, indices):
    """Step 3 without a dense pass: ``(m[I], p[I])`` from k-sized gathers (``indices`` int64, flat),
    in the memory's dtype."""
    memory_at_indices = memory.index_select(0, indices)
    return memory_at_indices, memory_at_indices + grad.reshape(-1).index_select(0, indices)


def filter_memory_(memory, grad, indices, memory_at_indices, values, sent, beta):
    """Step 4 in place: ``m += beta g`` off I, ``(1 - beta) m[I] + beta (p[I] - sent)`` on I, with
    ``(m[I], p[I])`` from :func:`take` taken before any change to ``memory`` and ``sent`` the values
    as they travel (``p[I]`` rounded to the value dtype). ``memory_at_indices`` is overwritten."""
    memory.add_(grad.reshape(-1), alpha=beta)
    memory_at_indices.mul_(1.0 - beta)
    if sent.dtype != values.dtype:
        memory_at_indices.add_(values - sent.to(values.dtype), alpha=beta)
    memory.index_copy_(0, indices, memory_at_indices)


def scatter_dense(values, indices, numel, dtype):
    """Step 5: a dense flat tensor of zeros holding ``values`` at ``indices``."""
    out = torch.zeros(numel, dtype=dtype, device=values.device)
    return out.index_copy_(0, indices.reshape(-1).to(torch.int64), values.to(dtype))


def scatter_dense_(out, values, indices):
    """Step 5 into an existing tensor: ``out`` (any shape, contiguous) zeroed, then ``values`` at the
    flat ``indices``; returns ``out``. Writing into the gradient's own storage saves allocating (and,
    for large tensors, page-faulting) a fresh dense tensor every step."""
    flat = out.view(-1)
    flat.zero_()
    flat.index_copy_(0, indices.reshape(-1).to(torch.int64), values.to(out.dtype))
    return out
