"""How the C kernels of :mod:`hvd_scalecom.native` are called from :mod:`hvd_scalecom.torch.clt_k`:
which tensors they take, I as a bitmap (:class:`Marks`), and the passes that update the memory and
write the reduced values."""

import threading

import torch

from hvd_scalecom import native


def kernels_for(*tensors):
    """The C kernels (:func:`hvd_scalecom.native.library`) if they can take ``tensors`` (contiguous
    fp32 CPU tensors), else None."""
    lib = native.library()
    if lib is None:
        return None
    for t in tensors:
        if not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()):
            return None
    return lib


def _native_applies(*tensors):
    return kernels_for(*tensors) is not None


def _native_pair(memory, grad, *others):
    """Whether the C passes take this memory and gradient (and ``others``): :func:`kernels_for` them,
    and one entry of memory per entry of gradient (the passes index both up to the gradient's size)."""
    return memory.numel() == grad.numel() and _native_applies(memory, grad, *others)


def _flat(tensor, dtype=None):
    """``tensor`` as a 1-D tensor of ``dtype`` (default: its own), without a call where it is one
    already: these run per tensor and step, where each torch call costs about a microsecond."""
    if tensor.ndim != 1:
        tensor = tensor.reshape(-1)
    return tensor if dtype is None or tensor.dtype is dtype else tensor.to(dtype)


def _check_pairs(indices, reduced, numel=None):
    """ValueError unless there is one reduced value per index; IndexError if an index (on the CPU;
    where ``numel`` is given) is outside ``[0, numel)``: raised before anything is written."""
    if indices.numel() != reduced.numel():
        raise ValueError(f"{reduced.numel()} reduced values for {indices.numel()} indices")
    if (numel is not None and indices.is_cpu and indices.numel()
            and (int(indices.min()) < 0 or int(indices.max()) >= numel)):
        raise IndexError(_out_of_range(indices, numel))


def _native_filter_and_scatter_cut_(memory, flat, reduced, cut, beta):
    """The C pass of :func:`filter_and_scatter_` that finds I again from ``cut``: whether the memory
    was updated."""
    status = native.library().hsc_filter_scatter_cut(memory.data_ptr(), flat.data_ptr(), flat.numel(), beta,
                                                     1.0 - beta, cut.kth, cut.ties, reduced.numel(),
                                                     reduced.data_ptr())
    if status == -3:
        raise RuntimeError("the gradient changed between compress and decompress without a change of its "
                           "version counter: the leader's selection no longer gives its k entries")
    return bool(status)


def _native_filter_and_scatter_(memory, flat, indices, reduced, beta):
    """The C pass of :func:`filter_and_scatter_` with I marked from ``indices`` (as
    :func:`_marked_dtype` gives them): whether the memory was updated, or None, having written
    nothing, where an index repeats."""
    marks = _scratch_marks(flat.numel())
    order = None
    while True:
        status = native.library().hsc_filter_scatter(
            memory.data_ptr(), flat.data_ptr(), flat.numel(), beta, 1.0 - beta, indices.data_ptr(),
            int(indices.dtype is torch.int64), indices.numel(), reduced.data_ptr(), marks.bits.data_ptr())
        if status != -2 or order is not None:
            break
        order = indices.argsort()  # not ascending: the same pass over the sorted pairs
        indices, reduced = indices[order], reduced[order]
    if status == -1:
        raise IndexError(_out_of_range(indices, flat.numel()))
    return None if status == -2 else bool(status)


def _check_advancing(memory, grad):
    """ValueError unless the C passes that trade buffers can take ``memory`` and ``grad``: loaded
    kernels (:func:`hvd_scalecom.native.loaded`: the second call must finish what the first began)
    and two contiguous fp32 CPU tensors of the same size (checked before any pointer reaches C)."""
    if native.loaded() is None:
        raise ValueError("take_advancing_ and filter_and_scatter_advanced need the C kernels (see may_advance)")
    for name, t in (("memory", memory), ("grad", grad)):
        if not (t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous fp32 CPU tensor here (see may_advance), got "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}")
    if memory.numel() != grad.numel():
        raise ValueError(f"memory has {memory.numel()} entries, grad {grad.numel()}: they must match")


def _marked_dtype(indices):
    """Flat contiguous indices as :func:`_mark` takes them: int32 (as broadcast) or int64 kept as they
    are, other integer dtypes as int64; ValueError unless on the CPU (the C passes read them)."""
    if not indices.is_cpu:
        raise ValueError(f"indices must be a CPU tensor here (the C passes read them), got one on {indices.device}")
    indices = _flat(indices)
    if indices.dtype is not torch.int32:
        indices = _flat(indices, torch.int64)
    return indices.contiguous()


class Marks:
    """A set of indices I of a tensor of ``numel`` entries as the C kernels' bitmap (``bits``, one bit
    per entry), with ``order``, the argsort that made the indices ascending (None if they were), and
    ``count``, how many indices are marked (None until marked)."""

    def __init__(self, numel):
        self.numel = numel
        self.bits = torch.empty((numel + 15) // 16, dtype=torch.int16)
        self.order = None
        self.count = None


# One bitmap per thread: the C kernels run without the GIL.
_per_thread = threading.local()


def _scratch_marks(numel):
    """This thread's :class:`Marks` for the calls that fill and use a bitmap at once (grown as needed)."""
    marks = getattr(_per_thread, "marks", None)
    if marks is None or marks.numel < numel:
        marks = _per_thread.marks = Marks(numel)
    return marks


def _mark(indices, numel, marks=None):
    """``marks`` (default: this thread's buffer, grown as needed) holding ``indices`` (flat, contiguous,
    int32 or int64, CPU), or None where an index repeats; IndexError where one is out of range."""
    if marks is None:
        marks = _scratch_marks(numel)
    elif marks.numel != numel:
        raise ValueError(f"marks are for {marks.numel} entries, the tensor has {numel}")
    lib = native.loaded()  # (only reached where the C kernels took the step's first pass)
    marks.order = marks.count = None
    wide = int(indices.dtype is torch.int64)
    status = lib.hsc_mark(indices.data_ptr(), wide, indices.numel(), numel, marks.bits.data_ptr())
    if status == -2:
        marks.order = indices.argsort()
        ascending = indices[marks.order]
        status = lib.hsc_mark(ascending.data_ptr(), wide, indices.numel(), numel, marks.bits.data_ptr())
    if status == -1:
        raise IndexError(_out_of_range(indices, numel))
    if status == -2:
        return None
    marks.count = indices.numel()
    return marks


def _keep_rounding_error_(memory, indices, values, sent, beta):
    """``memory[I] += beta (p[I] - sent)``: the values' rounding to a narrower dtype (e.g. fp16) stays
    in the memory (step 4 on I, after ``memory[I] = (1 - beta) m[I]``)."""
    indices = _flat(indices, torch.int64)
    at = memory.index_select(0, indices)
    at.add_(values - sent.to(values.dtype), alpha=beta)
    memory.index_copy_(0, indices, at)


def _out_of_range(indices, numel):
    return (f"indices must lie in [0, {numel}) for a tensor of {numel} entries, got "
            f"{int(indices.min())}..{int(indices.max())}")
