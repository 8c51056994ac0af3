"""Qsparse-local-SGD's synchronisation of one tensor (Basu et al., NeurIPS 2019, Alg. 1) on torch tensors,
and the wire format of its compressed deltas.

Terms: ``x_i`` worker i's local model, ``x_last`` the shared model of the last synchronisation,
``m_i`` worker i's error memory on the model delta. Rows are workers (one row on a Horovod rank).

1. ``delta_i = m_i + (x_i - x_last)``
2. ``c_i = Q(Top_k(delta_i))``, Q from :mod:`hvd_scalecom.torch.quantize`   (:func:`compress_delta`)
3. ``m_i <- delta_i - c_i``                                                 (same function)
4. ``x_new = x_last + mean_i c_i``: the caller gathers every worker's ``(I_i, c_i)`` (:func:`encode`,
   :func:`decode`) and sums them (:func:`mean_of_sparse`)

Non-finite steps, as ScaleCom's: a worker whose ``delta_i`` is not finite (anywhere) sends NaN (every
``c_i`` entry), so ``mean_i c_i`` is not finite on every worker; then ``x_new`` carries it, as
model averaging without compression would, and every worker keeps its memory (step 3 is skipped:
the caller adopts the new memories only where the mean is finite, :func:`memory_kept`).

What travels per worker and tensor (:func:`encode`): the k indices (sorted, int32 or int64), then

* ``top_k``: the k values (in the memory's dtype: float32, float64 for float64 parameters; so is the
  scale of the other two);
* ``sign_top_k``: one scale ``||Top_k||_1 / k`` and k signs as int8 (-1, 0, +1; 0 where a
  kept entry is exactly zero, which a single bit could not say);
* ``qsgd_top_k``: one norm ``||Top_k||_2`` and k signed levels ``sign * xi`` (int8 for s <= 127,
  int16 for s <= 32767, else int32).

:func:`decode` rebuilds exactly (bit for bit) what :func:`hvd_scalecom.torch.quantize.sign_top_k` and
:func:`~hvd_scalecom.torch.quantize.qsgd_top_k` return, so the sender's memory subtracts what every
receiver adds. No Horovod import, so these serve the simulator too.
"""

import torch

from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.quantize import qsgd_levels, qsgd_scale, sign_top_k
from hvd_scalecom.torch.topk import flat_indices, select_top_k_rows

_INT_DTYPES = {"int8": torch.int8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64}


def compress_delta(memory, drift, k, operator, levels=256, noise=None, level_dtype="int16"):
    """Steps 1-3 for one tensor of ``rows`` workers; ``memory`` is left as it is.

    memory: ``(rows, numel)`` error memories (fp32 at least); drift: ``(rows, numel)`` ``x_i - x_last``;
    noise: ``(rows, k)`` uniforms in [0, 1) for QSGD's rounding (ignored by the other operators).
    Returns ``(indices, scale, codes, c, new_memory)``: ``indices`` ``(rows, k)`` int64 in increasing
    order, the wire form ``scale`` ``(rows, 1)`` float32 or None and ``codes`` ``(rows, k)``,
    ``c = decode(...)``, and the memories of step 3, a new ``(rows, numel)`` tensor for the caller to
    adopt (a Horovod rank does once every rank's payload has been checked) unless :func:`memory_kept`.
    A row whose ``delta_i`` is not finite sends NaN: its ``c_i``, its values or scale in the wire form.
    """
    rows, numel = drift.shape
    delta = clt_k.error_compensated(memory.view(-1), drift)                   # delta_i, flat
    indices = select_top_k_rows(delta.view(rows, numel), k).sort(dim=1).values  # Top_k, by position
    flat = flat_indices(indices, rows, numel)
    kept = delta.index_select(0, flat).view(rows, k)
    scale, codes = encode(kept, operator, levels, noise, level_dtype)
    if not clt_k.all_finite(delta):  # (one read; the rows only then)
        finite = torch.isfinite(delta.view(rows, numel)).all(dim=1, keepdim=True)
        if scale is None:
            codes = codes.masked_fill(~finite, float("nan"))
        else:
            scale = scale.masked_fill(~finite, float("nan"))
    c = decode(scale, codes, operator, levels)
    delta.index_copy_(0, flat, (kept - c).reshape(-1))                         # m_i = delta_i - c_i
    return indices, scale, codes, c, delta.view(rows, numel)


def check_generator_state(state, what):
    """A saved QSGD noise generator's state (``torch.Generator().get_state()``), tried on a generator
    of its own, so that a refused one changes nothing; TypeError or ValueError naming ``what``."""
    if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8):
        raise TypeError(f"{what} must be a torch.ByteTensor (Generator.get_state()), "
                        f"got {getattr(state, 'dtype', type(state).__name__)}")
    try:
        torch.Generator().set_state(state)
    except RuntimeError as err:
        raise ValueError(f"{what} is not a CPU generator's state: {err}") from None
    return state


def encode(kept, operator, levels=256, noise=None, level_dtype="int16"):
    """The wire form ``(scale, codes)`` of ``Q(kept)`` (``kept``: ``(rows, k)`` values of Top_k)."""
    if operator == "top_k":
        return None, kept
    if operator == "sign_top_k":
        c = sign_top_k(kept)  # (||kept||_1 / k) * sign(kept): every non-zero |c| is the scale, exactly
        return c.abs().amax(dim=-1, keepdim=True), torch.sign(c).to(torch.int8)
    if operator == "qsgd_top_k":
        if noise is None:
            raise ValueError("qsgd_top_k needs noise: uniform draws of the kept values' shape")
        xi, norm = qsgd_levels(kept, levels, noise)
        return norm, (torch.sign(kept) * xi).to(_INT_DTYPES[level_dtype])
    raise ValueError(f"operator must be 'top_k', 'sign_top_k' or 'qsgd_top_k', got {operator!r}")


def decode(scale, codes, operator, levels=256, dtype=torch.float32):
    """``c = Q(Top_k)`` from its wire form; equal, bit for bit, to the quantize.py operator's output."""
    if operator == "top_k":
        return codes
    signs = codes.to(dtype)
    if operator == "sign_top_k":
        return scale * signs
    # qsgd: ||v||_2 * sign(v) * xi / s, then the contraction 1 / (1 + beta_{k,s}), in qsgd()'s order
    return scale * torch.sign(signs) * signs.abs() / levels * qsgd_scale(codes.shape[-1], levels)


def memory_kept(mean):
    """Whether step 3 is skipped on every worker: ``mean_i c_i`` is not finite (a worker sent NaN, or
    the sum overflowed), so no memory takes the new one in."""
    return not clt_k.all_finite(mean)


def mean_of_sparse(indices, c, numel, n):
    """Step 4's ``mean_i c_i`` as a flat dense tensor: every worker's ``(I_i, c_i)`` summed, over ``n``.

    indices, c: ``(workers, k)``, row i worker i's, summed in worker order.
    """
    summed = torch.zeros(numel, dtype=c.dtype, device=c.device)
    summed.index_add_(0, indices.reshape(-1).to(torch.int64), c.reshape(-1))
    return summed / n


def payload_dtypes(operator, index_dtype, level_dtype, value_dtype=torch.float32):
    """``(index, scale or None, codes)`` torch dtypes of one tensor's wire form; values and scales
    travel in ``value_dtype``, the memory's (float32, or float64 for float64 parameters)."""
    codes = {"top_k": value_dtype, "sign_top_k": torch.int8,
             "qsgd_top_k": _INT_DTYPES[level_dtype]}[operator]
    scale = None if operator == "top_k" else value_dtype
    return _INT_DTYPES[index_dtype], scale, codes
