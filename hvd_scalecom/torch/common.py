"""What the Horovod (PyTorch) schemes share: checking ``named_parameters``, finding the parameter whose
gradient Horovod hands to ``compress``, and comparing configurations across ranks.

Used by the ScaleCom compressor, :mod:`hvd_scalecom.torch.sketched_sgd` and
:mod:`hvd_scalecom.torch.qsparse_local_sgd`.
"""

import hashlib
import math
import os
import re
import sys
import time

import torch

from hvd_scalecom import agreement
from hvd_scalecom.config import check_int
from hvd_scalecom.state import check_saved_shape
from hvd_scalecom.torch.clt_k import memory_dtype

_USAGE = "named_parameters must be an iterable of (name, parameter) pairs, such as model.named_parameters()"


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


def named_parameter_list(named_parameters, scheme):
    """``[(name, parameter)]`` from ``named_parameters``; TypeError/ValueError naming the problem."""
    if named_parameters is None or isinstance(named_parameters, (str, bytes, torch.Tensor)):
        raise TypeError(_USAGE)
    try:
        pairs = list(named_parameters)
    except TypeError:
        raise TypeError(_USAGE) from None
    if not pairs:
        raise ValueError("named_parameters is empty")
    names, ids = set(), set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_parameters must hold (str, torch.Tensor) pairs, got {pair!r:.80}")
        name, param = pair
        if name in names:
            raise ValueError(f"named_parameters has the name {name!r} twice")
        if id(param) in ids:
            raise ValueError(f"named_parameters has the parameter {name!r} under two names")
        if not param.dtype.is_floating_point:
            raise TypeError(f"named_parameters: {name!r} is {param.dtype}, {scheme} needs "
                            f"floating-point parameters")
        names.add(name)
        ids.add(id(param))
    return pairs


def handed_back(original, out):
    """What :func:`refuse_second_reduction` compares: the gradient handed to ``compress`` (``original``,
    a weak reference) as Horovod's ``p.grad.set_(out)`` leaves it, ``out``'s address and its version
    counter one ahead; None where that gradient is gone."""
    grad = original()
    return None if grad is None else (original, out.data_ptr(), grad._version + 1)


def refuse_second_reduction(handed_back, tensor, scheme, name, detail=""):
    """RuntimeError where ``tensor`` is the gradient of parameter ``name`` that ``scheme``'s last
    ``decompress`` gave back, unchanged (``handed_back``: what :func:`handed_back` recorded, or None). Horovod
    is then reducing it a second time, which would count as another step (``detail``: what it would do)."""
    if handed_back is None or handed_back[0]() is not tensor:
        return
    if (tensor.data_ptr(), tensor._version) == tuple(handed_back[1:]):
        raise RuntimeError(
            f"{scheme}: the gradient of {name!r} is the one {scheme}'s last decompress gave back, unchanged: "
            f"Horovod is reducing it a second time, which {scheme} would count as another step{detail}. "
            f"Either optimizer.step() came after optimizer.synchronize() outside optimizer.skip_synchronize() "
            f"(step inside `with optimizer.skip_synchronize():`), or the parameter has no gradient this step "
            f"and its old one was not cleared (call optimizer.zero_grad() every step). Nothing was changed")


def check_process_set(process_set):
    """``process_set`` unchanged if it is None or a ``horovod.torch.ProcessSet``, else TypeError."""
    from horovod.torch import ProcessSet
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a horovod.torch.ProcessSet or None, "
                        f"got {type(process_set).__name__}")
    return process_set


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


def check_loss_scaler(loss_scaler):
    """``loss_scaler`` if None or has ``get_scale()`` (``torch.amp.GradScaler``); TypeError naming it else."""
    if loss_scaler is not None and (isinstance(loss_scaler, type)
                                    or not callable(getattr(loss_scaler, "get_scale", None))):
        raise TypeError(f"loss_scaler must be an object with a get_scale() method (a torch.amp.GradScaler), "
                        f"got {loss_scaler.__name__ if isinstance(loss_scaler, type) else type(loss_scaler).__name__}"
                        f"{' (a class: pass an instance)' if isinstance(loss_scaler, type) else ''}")
    return loss_scaler


def follow_loss_scale(buffers, scale, loss_scaler):
    """The loss scale ``buffers`` (state kept in the units of the scaled gradients, None entries
    skipped) are in once rescaled from ``scale`` to ``loss_scaler``'s current one (None without one)."""
    if loss_scaler is None:
        return None
    current = float(loss_scaler.get_scale())
    if scale is not None and current != scale:
        for buffer in buffers:
            if buffer is not None:
                buffer.mul_(current / scale)
    return current


def restored_loss_scale(buffers, saved, loss_scaler):
    """The loss scale restored ``buffers`` (saved in loss scale ``saved``, None: unscaled) are in: without
    a ``loss_scaler`` they are divided by ``saved`` (None); with one, unscaled ones count as scale 1 and
    are rescaled at the next step by :func:`follow_loss_scale`."""
    buffers = [b for b in buffers if b is not None]
    if loss_scaler is None and saved is not None:
        for buffer in buffers:
            buffer.div_(saved)
        return None
    if loss_scaler is not None and saved is None and buffers:
        return 1.0
    return saved


def as_memory_of(saved, param):
    """A saved state tensor of ``param`` as memories are kept: a flat copy in ``memory_dtype`` (fp32 at
    least) on the parameter's device."""
    return saved.detach().reshape(-1).to(device=param.device, dtype=memory_dtype(param.dtype), copy=True)


class GradientLookup:
    """Which parameter a gradient handed to ``compress`` belongs to.

    Horovod calls ``compress(p.grad)`` without the name. ``p.grad is tensor`` identifies it; the order
    in which hooks fire is learned, so the usual lookup is one comparison. With
    ``sparse_as_dense=True`` Horovod hands over ``p.grad.to_dense()``: matched by shape among the
    parameters with sparse gradients (and by value if several share the shape).
    """

    def __init__(self, params, names, scheme):
        self.params, self.names, self.scheme = list(params), list(names), scheme
        self._after = {}
        self._last = None

    def index_of(self, tensor, not_yet=None):
        """The parameter index; ``not_yet(i)`` tells, among ambiguous sparse matches, which one has
        not been reduced in the current step."""
        guess = self._after.get(self._last)
        if guess is not None and self.params[guess].grad is tensor:
            index = guess
        else:
            index = next((i for i, p in enumerate(self.params) if p.grad is tensor), None)
            if index is None and any(p is tensor for p in self.params):
                raise ValueError(
                    f"{self.scheme} was handed a parameter, not its gradient: hvd.DistributedOptimizer "
                    f"was built with op=hvd.Adasum, which compresses parameter deltas. {self.scheme} "
                    f"compresses gradients; use op=hvd.Average or op=hvd.Sum.")
            if index is None:
                index = self._sparse_index_of(tensor, not_yet)
        if self._last is not None:
            self._after[self._last] = index
        self._last = index
        return index

    def _sparse_index_of(self, tensor, not_yet):
        candidates = [i for i, p in enumerate(self.params) if p.grad is not None and p.grad.is_sparse
                      and p.shape == tensor.shape]
        if len(candidates) > 1 and not_yet is not None:
            candidates = [i for i in candidates if not_yet(i)] or candidates
        if len(candidates) > 1:
            candidates = [i for i in candidates if torch.equal(self.params[i].grad.to_dense(), tensor)]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise ValueError(f"{self.scheme} cannot tell which of {[self.names[i] for i in candidates]} "
                             f"this densified sparse gradient belongs to")
        raise ValueError(
            f"{self.scheme} was asked to compress a tensor of shape {tuple(tensor.shape)} that is not "
            f"the gradient of any parameter in named_parameters. Pass the model's named_parameters to "
            f"{self.scheme}.")

    def reset(self):
        self._after.clear()
        self._last = None


def tensors_digest(tensors):
    """A short digest of the tensors' values (bit for bit)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_agreement(scheme, summary, process_set=None, hints=None, stall=(None, None)):
    """Every rank hands in its ``summary`` (a JSON-able dict); all ranks raise the same ValueError,
    naming the keys that differ and each rank's values, when the summaries differ
    (:mod:`hvd_scalecom.agreement`).

    Blocking: call it at a point every rank reaches without waiting on anything else (the first
    ``compress`` of a step, the first ``step()``). ``hints``: ``{key: sentence}`` added to the message
    when that key differs. ``stall``: as :func:`wait`, for a rank that never comes.
    """
    import horovod.torch as hvd

    local = torch.frombuffer(bytearray(agreement.encode(summary)), dtype=torch.uint8)
    kwargs = {} if process_set is None else {"process_set": process_set}
    prefix = f"{scheme.lower()}.agreement"
    what = (f"every rank's {scheme} configuration (compared at the first step). A rank that never "
            f"reduces through {scheme} keeps the others here: e.g. one outside the optimizer's "
            f"process_set when {scheme} was given a different one or none (pass it the optimizer's process_set)")
    sizes = wait(hvd.allgather_async(torch.tensor([local.numel()]), name=f"{prefix}.sizes", **kwargs),
                 stall, scheme, what)
    gathered = wait(hvd.allgather_async(local, name=prefix, **kwargs), stall, scheme, what)
    agreement.check_gathered(scheme, [c.numpy().tobytes() for c in torch.split(gathered, sizes.tolist())],
                             hints)


def stall_times(timeout=None):
    """(warning interval, time limit) in seconds, None for never: Horovod's own stall settings
    (``HOROVOD_STALL_CHECK_TIME_SECONDS``, 60, and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, integers;
    ``HOROVOD_STALL_CHECK_DISABLE`` above 0 turns both off), read as Horovod reads them, ``timeout``
    taking precedence over the latter. ValueError naming the variable where one is not an integer."""
    disabled = _leading_int(os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "")) > 0  # (strtol: "false" is 0)
    check = _stall_setting("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)
    shutdown = _stall_setting("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0)
    warn_every = None if disabled or check <= 0 else float(check)
    limit = timeout if timeout is not None else (float(shutdown) if shutdown > 0 and not disabled else None)
    return warn_every, limit


def _leading_int(text):
    """The integer ``text`` starts with, 0 if none (C's strtol, as Horovod reads a flag)."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


def _stall_setting(variable, default):
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable} must be an integer number of seconds (as Horovod reads it), "
                         f"got {text!r}") from None


# wait() polls without sleeping for this long first, yielding the CPU between polls as Horovod's own
# synchronize() does: a sleep of 1e-4 s lasts about 0.25 ms here, and most exchanges complete within
# a few of Horovod's cycles (python -m benchmarks.per_tensor, docs/performance.md).
_SPIN_SECONDS = 0.005


def wait(handle, stall, scheme, what, advice=""):
    """The result of Horovod's async ``handle``, printing ``"<scheme> warning: still waiting after N s
    for <what>. <advice>"`` every ``stall[0]`` seconds while it is late and raising RuntimeError after
    ``stall[1]`` (:func:`stall_times`; None: never), as Horovod's stall check does for its own."""
    import horovod.torch as hvd

    warn_every, limit = stall
    start = warned = time.monotonic()
    while not hvd.poll(handle):
        now = time.monotonic()
        if limit is not None and now - start > limit:
            raise RuntimeError(f"{scheme}: still waiting after {limit:g} s for {what}.")
        if warn_every is not None and now - warned > warn_every:
            warned = now
            print(f"{scheme} warning: still waiting after {now - start:.0f} s for {what}. {advice}".rstrip(),
                  file=sys.stderr, flush=True)
        if now - start > _SPIN_SECONDS:
            time.sleep(1e-4)
        else:
            os.sched_yield()
    return hvd.synchronize(handle)
