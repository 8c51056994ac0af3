"""ScaleCom's equations on torch tensors: the one implementation used by the Horovod compressor and
by the simulator (``hvd_scalecom.sim``).

Notation of Chen et al. (NeurIPS 2020), Algorithm 1, for one tensor on rank i at step t:

1. ``p_i = m_i + g_i``                                   (error-compensated gradient)
2. ``I = top_k(|p_j|)`` on the leader j                   (CLT-k, :func:`select_top_k`; ``top_k(|m_j|)``
   where ``g_j`` is not finite, :func:`selection_of_nonfinite`)
3. ``v_i = p_i[I]``, averaged over ranks                  (:func:`take`)
4. ``m_i <- (1 - beta) m_i + beta (p_i - scatter(I, v_i))`` (low-pass filter, :func:`filter_memory_`)
5. the update applies ``scatter(I, mean_i v_i)``          (:func:`scatter_dense`)

The Horovod compressor calls :func:`select_and_take` (leader) or :func:`take_checking` (steps 1-3)
in ``compress``, which give a :class:`Taken`, and :func:`filter_and_scatter_` (steps 4-5) in
``decompress``; on large gradients
that it may overwrite, a rank that did not select calls :func:`take_advancing_` (steps 3-4, the new
memory written over the gradient) and :func:`filter_and_scatter_advanced` (the buffers traded).
All functions work on flat (1-D) views, on any device, without Python loops over entries. On
contiguous fp32 CPU tensors the dense steps run as single passes in C (:mod:`hvd_scalecom.native`),
which compute the same floats as the torch operations (``tests/test_native.py``).
"""

import math
from typing import NamedTuple, Optional

import torch

from hvd_scalecom import config, native
from hvd_scalecom.selection_rule import CUDA_THRESHOLD_MIN_NUMEL as _CUDA_THRESHOLD_MIN_NUMEL  # noqa: F401
from hvd_scalecom.selection_rule import sample_plan as _sample_plan  # noqa: F401
from hvd_scalecom.selection_rule import thresholded as _thresholded
from hvd_scalecom.torch.kernel_calls import (  # noqa: F401
    Marks,
    _check_advancing,
    _check_pairs,
    _flat,
    _keep_rounding_error_,
    _mark,
    _marked_dtype,
    _native_applies,
    _native_filter_and_scatter_,
    _native_filter_and_scatter_cut_,
    _native_pair,
    _out_of_range,
    kernels_for,
)
from hvd_scalecom.torch.threshold_select import (  # noqa: F401
    _at_least,
    _at_least_masked,
    _native_select,
    _sample_positions,
    _sampled_selection,
    _sampled_threshold,
)


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
    magnitude aside) by the rule of :mod:`hvd_scalecom.selection_rule`: a sampled threshold a little
    below the k-th largest magnitude, the entries reaching it as candidates (found through an
    ``(8, numel / 8)`` column pre-filter, :mod:`hvd_scalecom.torch.threshold_select`; in C on
    contiguous fp32 CPU tensors), and ``torch.topk`` among them; an exact top-k where fewer than k
    reach it. Small tensors and ratios above 1/16 take ``"exact"`` directly.
    """
    numel = p.numel()
    if selection not in ("exact", "threshold"):
        raise ValueError(f"selection must be 'exact' or 'threshold', got {selection!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k >= numel:
        return torch.arange(numel, device=p.device)
    p = p.reshape(-1)
    native_applies = numel <= config.INT32_INDEX_MAX_NUMEL and _native_applies(p)  # (int32 candidates)
    if selection == "exact" or not _thresholded(numel, k, native_applies, p.is_cuda):
        return torch.topk(p.abs(), k, sorted=False).indices
    if native_applies:
        selected = _native_select(p, None, k)
        selected = None if selected is None else selected[0]
    else:
        selected = _sampled_selection(p, k)
    return selected if selected is not None else torch.topk(p.abs(), k, sorted=False).indices


def select_top_k_of_sum(memory, grad, k, selection="exact", scratch=None):
    """Steps 1-2 on the leader: ``select_top_k(m + g, k, selection)``, with ``p`` formed in
    ``scratch`` (see :func:`error_compensated_into`) or a new tensor, except where the C kernels
    apply (see :func:`select_and_take`). Where ``g`` is not finite, ``select_top_k(m, k, selection)``
    (see :func:`selection_of_nonfinite`)."""
    selected = _native_select_of_sum(memory, grad, k, selection)
    if selected is not None:
        return selected[0] if selected[2] else selection_of_nonfinite(memory, k, selection)
    if not all_finite(grad):
        return selection_of_nonfinite(memory, k, selection)
    return _select_of_sum(memory, grad, k, selection, scratch)


def selection_of_nonfinite(memory, k, selection="exact"):
    """Step 2 on a leader whose gradient holds a NaN or Inf: ``I = top_k(|m_j|)``, as if ``g_j`` were 0.

    Such a leader sends NaN (:func:`take_checking`), so every rank's reduction is non-finite and
    keeps its memory (:func:`filter_and_scatter_`): the step leaves ``m_j`` as the memory, and its
    top-k is what I is chosen from. ``top_k(|m + g|)`` would not be defined: ``torch.topk`` ranks
    NaN first, the threshold pass never takes one, and both take an Inf; a pipelined step (the
    leader of step t + 1 selects at step t) would then spend step t + 1 on the positions of step
    t's NaN, or on k arbitrary ones after an all-NaN gradient (an fp16 overflow)."""
    return select_top_k(memory, k, selection)


class Cut(NamedTuple):
    """I as the leader's C selection found it: the entries with ``|p| > kth`` and the first ``ties``
    (in index order) with ``|p| == kth`` (``ties`` -1: all of them, I being ``|p| >= kth``, the usual
    case); ``grad_version``, the gradient's version counter then (an in-place change to it since
    makes the cut stale)."""
    kth: float
    ties: int
    grad_version: int


class Taken(NamedTuple):
    """What step 3 takes in ``compress`` for steps 4-5 in ``decompress``: ``values``, ``p[I]`` in the
    memory's dtype; ``finite``, whether every entry of g is; ``memory_at``, ``m[I]`` where it came
    with ``p[I]`` (else None: :func:`memory_at` reads it from the memory, unchanged until then); and
    ``cut``, a :class:`Cut` where the leader's C selection found I, which the C pass of
    :func:`filter_and_scatter_` then finds again from m and g instead of reading I (with AVX-512,
    from ``_CUT_MIN_NUMEL`` entries on; else None)."""
    values: torch.Tensor
    finite: bool
    memory_at: Optional[torch.Tensor] = None
    cut: Optional[Cut] = None


def memory_at(memory, indices, taken):
    """``m[I]``: ``taken.memory_at``, else gathered from ``memory`` (unchanged since ``taken``)."""
    if taken.memory_at is not None:
        return _flat(taken.memory_at, memory.dtype)
    return memory.index_select(0, _flat(indices, torch.int64))


def select_and_take(memory, grad, k, selection="exact", scratch=None, index_dtype=torch.int64):
    """Steps 1-3 on the leader: ``(I, taken)``, a :class:`Taken`, I in ``index_dtype`` (int64 or
    int32, e.g. the dtype the indices are broadcast in). With ``"threshold"`` on contiguous fp32
    CPU tensors this is one read-only pass in C that compares ``|m + g|`` as it reads m and g
    (``p`` never exists) and keeps ``p`` of the candidates; ``I`` comes ascending, with its cut,
    written in ``index_dtype`` by the kernel. Otherwise :func:`select_top_k_of_sum`, then
    :func:`take_checking`. Where ``g`` is not finite, I is ``top_k(|m|)`` instead
    (:func:`selection_of_nonfinite`), found after the selection of ``m + g`` showed it."""
    if index_dtype is not torch.int64 and index_dtype is not torch.int32:
        raise ValueError(f"index_dtype must be torch.int64 or torch.int32, got {index_dtype}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if index_dtype is torch.int32 and memory.numel() > config.INT32_INDEX_MAX_NUMEL:
        raise ValueError(f"index_dtype torch.int32 cannot index a tensor of {memory.numel()} entries "
                         f"(at most {config.INT32_INDEX_MAX_NUMEL}): use torch.int64")
    selected = _native_select_of_sum(memory, grad, k, selection, index_dtype)
    if selected is not None and selected[2]:
        indices, values, finite, (kth, ties) = selected
        with_cut = (native.library().has_cut_pass and memory.numel() >= _CUT_MIN_NUMEL
                    and not grad.is_inference())  # (inference tensors have no version counter)
        return indices, Taken(values, finite, cut=Cut(kth, ties, grad._version) if with_cut else None)
    taken = None
    if selected is None:
        indices = _ascending(_select_of_sum(memory, grad, k, selection, scratch))
        taken = take_checking(memory, grad, indices)
    if taken is None or not taken.finite:  # g not finite: I from m alone (selection_of_nonfinite)
        indices = _ascending(selection_of_nonfinite(memory, k, selection))
        taken = take_checking(memory, grad, indices)
    return _flat(indices, index_dtype), taken


def _ascending(indices):
    """CPU indices ascending, the order the C passes (and the CPU's caches) go fastest in."""
    return indices.sort().values if indices.is_cpu else indices


def _select_of_sum(memory, grad, k, selection, scratch):
    grad = grad.reshape(-1)
    p = error_compensated(memory, grad) if scratch is None else error_compensated_into(scratch, memory, grad)
    return select_top_k(p, k, selection)


def _native_select_of_sum(memory, grad, k, selection, index_dtype=torch.int64):
    """:func:`_native_select` of ``(m, g)`` where it applies, else None."""
    grad = _flat(grad)
    numel = memory.numel()
    if (selection == "threshold" and k < numel <= config.INT32_INDEX_MAX_NUMEL  # (int32 candidates)
            and _thresholded(numel, k, True) and _native_pair(memory, grad)):
        return _native_select(memory, grad, k, index_dtype)
    return None


# The leader's decompress finds I from the selection's cut (instead of marking the indices) from this
# many entries on (16 MB of fp32: beyond the caches), where it was measured faster (25M entries); on
# tensors that sit in the caches (1M entries) marking the indices was faster.
_CUT_MIN_NUMEL = 1 << 22


def take(memory, grad, indices):
    """Step 3 without a dense pass: ``(m[I], p[I])`` from k-sized gathers (``indices`` int64, flat),
    in the memory's dtype."""
    memory_at_indices = memory.index_select(0, indices)
    return memory_at_indices, memory_at_indices + grad.reshape(-1).index_select(0, indices)


def filter_memory_(memory, grad, indices, memory_at_indices, values, sent, beta):
    """Step 4 in place: ``m += beta g`` off I, ``(1 - beta) m[I] + beta (p[I] - sent)`` on I, with
    ``(m[I], p[I])`` from :func:`take` taken before any change to ``memory`` and ``sent`` the values
    as they travel (``p[I]`` rounded to the value dtype). ``memory_at_indices`` is overwritten.

    ``(1 - beta) m + beta (p - scatter(I, v))`` with ``p = m + g`` is that, so the memory takes one
    pass plus k-sized gathers and scatters and ``p`` is never materialised; ``p - sent`` is zero
    unless the values travel in a narrower dtype (e.g. fp16), whose rounding error the memory keeps."""
    memory.add_(grad.reshape(-1), alpha=beta)
    fix_memory_at_indices_(memory, indices, memory_at_indices, values, sent, beta)


def take_checking(memory, grad, indices, check=True):
    """Step 3 on every rank: a :class:`Taken` (``m[I]``, ``p[I]`` as :func:`take` gives them),
    ``finite`` telling whether every entry of ``g`` is (with ``check``; else True): a rank with a
    non-finite gradient sends NaN, so that all skip the memory update (see
    :func:`filter_and_scatter_`). One read-only pass in C on contiguous fp32 CPU tensors."""
    flat = _flat(grad)
    indices = _flat(indices, torch.int64)
    if _native_pair(memory, flat) and indices.is_cpu and indices.is_contiguous():
        k = indices.numel()
        memory_at_indices, values = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.float32)
        status = native.library().hsc_take(memory.data_ptr(), flat.data_ptr(), flat.numel(), indices.data_ptr(),
                                           k, memory_at_indices.data_ptr(), values.data_ptr(), int(check))
        if status < 0:
            raise IndexError(_out_of_range(indices, flat.numel()))
        return Taken(values, bool(status), memory_at_indices)
    memory_at_indices, values = take(memory, flat, indices)
    return Taken(values, all_finite(flat) if check else True, memory_at_indices)


def all_finite(tensor):
    """Whether every entry is finite, from one read-only pass (in C on contiguous fp32 CPU tensors;
    else a reduction, NaN propagating through min and max, and one read of both to the host:
    ``torch.isfinite(t).all()`` would first write a mask of the tensor's size, and ``torch.isfinite``
    of the two is eight kernel launches on CUDA)."""
    if tensor.numel() == 0:
        return True
    if _native_applies(tensor):
        return bool(native.library().hsc_all_finite(tensor.data_ptr(), tensor.numel()))
    low, high = torch.aminmax(tensor)
    return all(map(math.isfinite, torch.stack((low, high)).tolist()))  # (one read to the host)


def filter_and_scatter_(memory, grad, indices, reduced, taken, sent, beta):
    """Steps 4-5 once the reduced values are known, in place: if every reduced value is finite, the
    memory update of :func:`filter_memory_`; in every case ``grad`` (contiguous) becomes zeros with
    ``reduced`` at ``indices``. Returns whether the memory was updated. ``taken`` is what
    :func:`select_and_take` or :func:`take_checking` gave (``memory`` and ``grad`` unchanged since),
    ``sent`` the values as this rank sent them. On contiguous fp32 CPU tensors one pass in C reads
    and writes m and g once (``m[I]`` is read there from ``memory`` itself), with I as a bitmap (see
    :class:`Marks`), or on the leader as ``taken.cut`` while ``grad`` is unchanged (its version
    counter): then no index is read. RuntimeError if the cut no longer gives k entries (``grad``
    changed in a way its version counter missed, e.g. through ``.data``): the pass has then written
    the memory and ``grad`` over the entries it found, and the step cannot be taken again."""
    flat = grad if grad.ndim == 1 else grad.view(-1)  # written to: a view, never a copy
    reduced = _flat(reduced, flat.dtype)
    if _native_pair(memory, flat, reduced) and indices.is_cpu and indices.numel() == reduced.numel():
        if taken.cut is not None and grad._version == taken.cut.grad_version:
            updated = _native_filter_and_scatter_cut_(memory, flat, reduced, taken.cut, beta)
        else:
            updated = _native_filter_and_scatter_(memory, flat, _marked_dtype(indices), reduced, beta)
        if updated is not None:
            if updated and sent.dtype != taken.values.dtype:  # memory[I] is (1 - beta) m[I] so far
                _keep_rounding_error_(memory, indices, taken.values, sent, beta)
            return updated
    indices = _flat(indices, torch.int64)
    _check_pairs(indices, reduced, flat.numel())
    finite = all_finite(reduced)
    if finite:
        filter_memory_(memory, flat, indices, memory_at(memory, indices, taken), taken.values, sent, beta)
    scatter_dense_(grad, reduced, indices)
    return finite


# Below this many entries (2 MB of fp32: a gradient and its memory in the second-level caches) the
# in-place passes (take_checking, filter_and_scatter_) are as fast as writing the memory over the
# gradient and cost fewer calls; from 1M entries on, trading buffers was measured faster.
_ADVANCE_MIN_NUMEL = 1 << 19


def may_advance(memory, grad):
    """Whether :func:`take_advancing_` applies to this memory and gradient: both contiguous fp32 CPU
    tensors of the same size, at least ``_ADVANCE_MIN_NUMEL`` entries, ``grad`` the whole of its
    storage (it will become the memory's) and not requiring grad, and the C kernels available."""
    return (grad.numel() >= _ADVANCE_MIN_NUMEL and owns_storage(grad)
            and not grad.requires_grad and _native_pair(memory, grad))


def owns_storage(tensor):
    """Whether ``tensor`` is the whole of its storage (no view of a larger buffer, none sharing its
    version counter with other views)."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def take_advancing_(memory, grad, indices, beta, marks=None):
    """Steps 3-4 on a rank whose gradient buffer is free to reuse (see :func:`may_advance`): returns
    a :class:`Taken` as :func:`take_checking` does, without ``m[I]`` (not needed: the memory on I is
    written here) and writes over ``grad`` the memory that step 4 gives if the reduction is finite
    (``m + beta g`` off I, ``(1 - beta) m[I]`` on I), leaving ``memory`` as it was. One pass in C that reads m
    and g and writes g in place, where
    ``take_checking`` + :func:`filter_and_scatter_` read g three times and write both. Returns None,
    having written nothing, where an index repeats. Finish with :func:`filter_and_scatter_advanced`,
    given the same ``marks`` (a :class:`Marks` of the tensor's size, to keep I's bitmap in between;
    by default this thread's own, rebuilt there)."""
    _check_advancing(memory, grad)
    flat = grad if grad.ndim == 1 else grad.view(-1)
    indices = _marked_dtype(indices)
    marks = _mark(indices, flat.numel(), marks)
    if marks is None:
        return None
    values = torch.empty(indices.numel(), dtype=torch.float32)
    finite = native.library().hsc_take_advancing(memory.data_ptr(), flat.data_ptr(), flat.numel(),
                                                 beta, 1.0 - beta,
                                                 marks.bits.data_ptr(), values.data_ptr())
    if marks.order is not None:  # taken in ascending index order: back to the order of indices
        values = torch.empty_like(values).index_copy_(0, marks.order, values)
    return Taken(values, bool(finite))


def filter_and_scatter_advanced(memory, grad, indices, reduced, taken, sent, beta, marks=None):
    """Steps 4-5 after :func:`take_advancing_`: returns ``(gradient, memory, updated)``. If every
    reduced value is finite, ``grad``'s buffer (holding the new memory) becomes the memory and the
    old memory's buffer the gradient; otherwise the memory is kept and ``grad`` is the gradient. The
    gradient (flat) receives zeros with ``reduced`` at ``indices`` without being read (by streaming
    stores on large tensors). ``taken`` (from ``take_advancing_``), ``sent`` as for
    :func:`filter_and_scatter_`; ``marks`` as given to ``take_advancing_`` (None: I's bitmap is rebuilt)."""
    _check_advancing(memory, grad)
    flat = grad if grad.ndim == 1 else grad.view(-1)
    indices = _marked_dtype(indices)
    if not reduced.is_cpu:
        raise ValueError(f"reduced must be a CPU tensor here (the C pass reads it), got one on {reduced.device}")
    reduced = _flat(reduced, flat.dtype).contiguous()
    _check_pairs(indices, reduced)  # (the C pass reads one value per index; _mark checks the range)
    if marks is None:
        marks = _mark(indices, flat.numel())
        if marks is None:
            raise ValueError("indices repeat: take_advancing_ refused them (use take_checking)")
    elif marks.numel != flat.numel() or marks.count != reduced.numel():  # (the C pass trusts them)
        raise ValueError(f"marks hold {marks.count} indices of a tensor of {marks.numel} entries, for "
                         f"{reduced.numel()} reduced values of one of {flat.numel()}: give the marks "
                         f"take_advancing_ filled for these indices")
    if marks.order is not None:
        reduced = reduced[marks.order]
    updated = bool(native.loaded().hsc_scatter_if_finite(  # (take_advancing_ used the C kernels)
        memory.data_ptr(), flat.data_ptr(), flat.numel(), marks.bits.data_ptr(), reduced.data_ptr(), reduced.numel()))
    if not updated:
        return flat, memory, False
    new_memory = flat.detach()  # a tensor of its own on grad's storage, whatever becomes of grad
    if sent.dtype != taken.values.dtype:
        _keep_rounding_error_(new_memory, indices, taken.values, sent, beta)
    return memory, new_memory, True


def fix_memory_at_indices_(memory, indices, memory_at_indices, values, sent, beta):
    """Step 4 on I: ``memory[I] = (1 - beta) m[I] + beta (p[I] - sent)`` (k-sized), with the
    ``(m[I], p[I])`` of :func:`take` (``memory_at_indices`` is overwritten)."""
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
