"""``selection="threshold"`` with torch operations and in C: the sampled threshold, the candidates
reaching it, and the C selection's plan and buffers (the numbers: :mod:`hvd_scalecom.selection_rule`).

Used by :func:`hvd_scalecom.torch.clt_k.select_top_k` and ``select_and_take``.
"""

import ctypes
import functools
import threading

import torch

from hvd_scalecom import native, selection_rule
from hvd_scalecom.selection_rule import expected_candidates as _expected_candidates
from hvd_scalecom.selection_rule import sample_plan as _sample_plan


def _sampled_selection(p, k):
    """Steps 1-3 of ``"threshold"`` with torch operations (``p`` flat): the k indices, or None where
    fewer than k entries reach the sampled threshold (or it is 0)."""
    threshold = _sampled_threshold(p, k)
    if threshold > 0:
        candidates, magnitudes = (_at_least_masked if p.is_cuda else _at_least)(p, threshold)
        if candidates.numel() >= k:
            return candidates.index_select(0, torch.topk(magnitudes, k, sorted=False).indices)
    return None


_GRID_ROWS = 8  # rows of the column pre-filter: a column reaches t with probability ~8x an entry's


class _SelectOutputs:
    """The C selection's scalar outputs: whether the checked tensor is finite, and the cut."""

    def __init__(self):
        self.finite, self.kth, self.ties = ctypes.c_int(1), ctypes.c_float(0.0), ctypes.c_int64(0)
        self.pointers = (ctypes.byref(self.finite), ctypes.byref(self.kth), ctypes.byref(self.ties))


class _SelectBuffers:
    """The C selection's candidate buffers, kept from call to call (grown, never shrunk)."""

    def __init__(self):
        self.cap = 0
        self.out = _SelectOutputs()

    def ensure(self, cap, sample_size):
        """Grows the buffers if needed; returns ``(candidate indices, p, capacity, scratch)`` as
        the C kernel takes them (pointers and the capacity)."""
        if cap > self.cap or sample_size > self.scratch.numel():
            self.cap = max(cap, self.cap)
            self.indices = torch.empty(self.cap + 16, dtype=torch.int32)  # + one vector of slack
            self.p = torch.empty(self.cap + 16, dtype=torch.float32)  # (the kernels write fp32,
            self.scratch = torch.empty(max(self.cap, sample_size), dtype=torch.float32)  # whatever the default)
            self.arguments = (self.indices.data_ptr(), self.p.data_ptr(), self.cap, self.scratch.data_ptr())
        return self.arguments


# Scratch the C kernels fill, one set per thread: they run without the GIL, and two threads sharing
# a bitmap or candidate buffers would read each other's (or freed) memory.
_per_thread = threading.local()


def _select_buffers():
    """This thread's :class:`_SelectBuffers`."""
    buffers = getattr(_per_thread, "select", None)
    if buffers is None:
        buffers = _per_thread.select = _SelectBuffers()
    return buffers


@functools.lru_cache(maxsize=256)
def _native_plan(numel, k):
    """``(sample size, rank, sample positions, their pointer, room)`` of the C selection (see
    :func:`_sample_plan`; room: candidates the buffers first hold, twice the expected number), or
    None where the rank would exceed the sample."""
    size, rank = _sample_plan(numel, k, native=True)
    if rank >= size:
        return None
    positions = _sample_positions(numel, size, torch.device("cpu"))
    room = max(2 * k + 4096, int(2 * _expected_candidates(numel, size, rank)))  # candidate buffers
    return size, rank, positions, positions.data_ptr(), room


def _native_select(a, b, k, index_dtype=torch.int64):
    """``(I, a[I] + b[I], finite, (kth, ties))`` by the C kernel (``I`` the exact top-k of ``|a + b|``,
    ascending, in ``index_dtype``, int64 or int32; ``|a|`` when b is None; ``finite``: every entry of b, else a,
    is; ``(kth, ties)``:
    I as a :class:`Cut`), or None where the sampled threshold lets fewer than k entries
    through (the caller then runs a full top-k)."""
    numel = a.numel()
    plan = _native_plan(numel, k)
    if plan is None:
        return None
    size, rank, _, positions, cap = plan
    lib = native.library()
    indices = torch.empty(k, dtype=index_dtype)
    p_at = torch.empty(k, dtype=torch.float32)
    buffers = _select_buffers()
    out = buffers.out
    while True:
        candidates = buffers.ensure(cap, size)
        got = lib.hsc_select(a.data_ptr(), None if b is None else b.data_ptr(), numel, k, positions, size, rank,
                             *candidates, indices.data_ptr(), int(index_dtype is torch.int64), p_at.data_ptr(),
                             *out.pointers)
        if got != -2:
            break
        cap = 2 * buffers.cap
    return (indices, p_at, bool(out.finite.value), (out.kth.value, out.ties.value)) if got == k else None


@functools.lru_cache(maxsize=256)
def _sample_positions(numel, size, device):
    """:func:`hvd_scalecom.selection_rule.sample_positions` on ``device``."""
    return torch.from_numpy(selection_rule.sample_positions(numel, size)).to(device)


@functools.lru_cache(maxsize=64)
def _row_offsets(rows, cols, device):
    return (torch.arange(rows, dtype=torch.int64) * cols).view(rows, 1).to(device)


def _sampled_threshold(p, k):
    """A magnitude that at least k entries of ``p`` reach, with high probability, and not many more
    (see :func:`_sample_plan`)."""
    numel = p.numel()
    size, rank = _sample_plan(numel, k)
    magnitudes = p.index_select(0, _sample_positions(numel, size, p.device)).abs_()
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
    hot = torch.nonzero(~(column_max < threshold)).view(-1)  # (a NaN makes its column's max NaN: hot)
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


def _at_least_masked(p, threshold):
    """:func:`_at_least` from a mask of the whole tensor, for CUDA: there one ``nonzero`` of ``|p| >= t``
    costs less than the column pre-filter's launches and gathers."""
    magnitudes = p.abs()
    indices = torch.nonzero(magnitudes >= threshold).view(-1)  # (NaN reaches no threshold)
    return indices, magnitudes.index_select(0, indices)
