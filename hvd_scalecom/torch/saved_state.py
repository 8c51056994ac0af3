"""Checks of one parameter's entry of a saved PyTorch state, and restoring a saved memory."""

import math

import torch

from hvd_scalecom.config import check_int
from hvd_scalecom.state_checks import check_saved_shape
from hvd_scalecom.torch.clt_k import memory_dtype


def check_state_entry(name, entry, shape, tensors, step=True, dtype=None):
    """One parameter's entry of a saved state: a dict whose ``step`` (if ``step``) is an int >= 0, saved
    for a parameter of ``shape`` (where it says), and whose ``tensors`` are None or floating-point
    tensors of as many entries, finite (in ``dtype`` too, the one they are kept in: an fp64 1e39 would
    load into fp32 as Inf); else TypeError or ValueError naming the parameter."""
    if not isinstance(entry, dict):
        raise TypeError(f"state entry of {name!r} must be a dict, got {type(entry).__name__}")
    check_saved_shape(name, entry, shape)
    numel = math.prod(shape)
    if step:
        check_int(entry.get("step"), f"state step of {name!r}", 0)
    for key in tensors:
        value = entry.get(key)
        if value is None:
            continue
        if not (isinstance(value, torch.Tensor) and value.dtype.is_floating_point):
            raise TypeError(f"state {key} of {name!r} must be a floating-point tensor or None, "
                            f"got {type(value).__name__} {getattr(value, 'dtype', '')}".rstrip())
        if value.numel() != numel:
            raise ValueError(f"state {key} of {name!r} has {value.numel()} entries, the parameter {numel}")
        if not bool(torch.isfinite(value).all()):  # (a memory never absorbs one: none could heal)
            raise ValueError(f"state {key} of {name!r} holds non-finite entries")
        if dtype is not None and not bool(torch.isfinite(value.to(dtype)).all()):
            raise ValueError(f"state {key} of {name!r} holds entries beyond the range of {dtype}, "
                             f"the dtype it is kept in")

def as_memory_of(saved, param):
    """A saved state tensor of ``param`` as memories are kept: a flat copy in ``memory_dtype`` (fp32 at
    least) on the parameter's device."""
    return saved.detach().reshape(-1).to(device=param.device, dtype=memory_dtype(param.dtype), copy=True)
