"""The dtypes PyTorch gradients travel in through Horovod 0.28.1, whose collectives take no bfloat16."""

import torch

TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def as_dtype(tensor, dtype):
    """``tensor.to(dtype)`` without the call where it already has that dtype (a microsecond or two
    per tensor and step)."""
    return tensor if tensor.dtype is dtype else tensor.to(dtype)


def wire_dtype(dtype):
    """The dtype a gradient of ``dtype`` travels in where a scheme is not told otherwise: its own,
    but bfloat16 as float32 (Horovod 0.28.1's collectives take no bfloat16)."""
    return torch.float32 if dtype is torch.bfloat16 else dtype


def dense_on_the_wire(values, grad_dtype, copy=False):
    """``(sent, ctx)`` for a gradient of ``grad_dtype`` that a compressor hands Horovod dense:
    ``values`` in :func:`wire_dtype` (a new tensor if ``copy``, or if ``values`` is not contiguous:
    Horovod refuses such a tensor, e.g. a channels_last conv weight's gradient), and the dtype
    ``decompress`` casts the reduction back to, None where that is the dtype it travelled in (a
    bfloat16 gradient travels as float32)."""
    dtype = wire_dtype(grad_dtype)
    if copy or values.dtype is not dtype or not values.is_contiguous():
        sent = values.to(dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        sent = values
    return sent, (None if dtype is grad_dtype else grad_dtype)
