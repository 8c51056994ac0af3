"""ScaleCom as a ``horovod.torch`` Compressor for the stock ``hvd.DistributedOptimizer``.

Per parameter and step (see :mod:`hvd_scalecom.torch.clt_k` for the equations):

1. ``compress(g)`` finds the parameter whose gradient ``g`` is, forms ``p = m + g`` on the leader,
   selects the top-k indices there and shares them (``allgather.scalecom.<name>``, to which only the
   leader contributes: a broadcast's bytes, but Horovod fuses the allgathers that are ready
   together, where it runs every broadcast on its own; ``broadcast.scalecom.<name>`` with
   ``index_exchange="broadcast"``); every rank returns ``p[I]`` (k values).
2. Horovod allreduces those k values with the optimizer's own op (``Average``), pre/postscale and
   process set.
3. ``decompress`` updates the residue memory (from ``m`` and ``g``, unchanged since ``compress``, and
   the ``p[I]`` taken there) and then writes the reduced values, over zeros, into the gradient's own
   storage (for a contiguous gradient nothing of the tensor's size is allocated on the way; the
   leader's ``p`` lives in one reused scratch buffer; a non-contiguous one is copied).

On contiguous fp32 CPU tensors (where the C kernels of :mod:`hvd_scalecom.native` can be built) each
side is one pass: ``compress`` reads ``m`` and ``g`` once (the leader selects as it reads; every rank
takes ``p[I]`` and checks finiteness), and ``decompress`` updates ``m`` and writes the
reduced values over zeros into ``g`` in one pass over both (on gradients of 2**22 entries or more,
in builds with AVX-512, the leader finds I again there from its selection's threshold instead of
reading the indices). On
gradients of 2**19 entries or more that own their storage, a rank that did not select writes the new memory over ``g`` in its
``compress`` pass instead (``m`` is only read), and ``decompress``, if the reduction is finite,
hands the old memory's buffer back as the gradient (zeros and the reduced values, not read first) and
keeps ``g``'s buffer as the memory: a gradient's storage changes at every step, as it does with
Horovod's fp16 compression. ``HVD_SCALECOM_NATIVE=0`` uses torch operations instead (the same
values, bit for bit, but for which of several entries tied at the k-th largest magnitude a leader
takes: each path takes an exact top-k).

Deadlock freedom: Horovod calls ``compress`` from each parameter's gradient hook, in an order that
can differ between ranks (dynamic graphs, parameters without a gradient that Horovod reduces later in
``synchronize()``). A rank that is not the leader of a tensor therefore posts its (empty) part of
the index allgather for *every* tensor of the step at its first ``compress`` of that step, and only
waits inside the hook of the tensor itself. The leader never waits inside ``compress``: it starts its
part and completes it in ``decompress``, after every rank has reduced the tensor. With the cyclic leader no
hook order, and no rank that reduces a tensor only in ``synchronize()`` (a gradient it did not
compute, a parameter it froze with ``requires_grad_(False)``), can deadlock. (With
``leader="staggered"`` every rank leads some tensors; hook orders must then agree across ranks, or
``timeout`` turns a wait into an error.)
"""

import time
import weakref

import torch
import horovod.torch as hvd
from horovod.torch.compression import Compressor

from hvd_scalecom.agreement import DTYPES_HINT, STEPS_HINT, dtype_names, shapes_digest
from hvd_scalecom.config import HOROVOD_VALUE_DTYPES, INDEX_DTYPES, ScaleComConfig, check_dtype_name, is_real
from hvd_scalecom.state import check_loss_scale, check_next_indices, checked_params
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.common import (GradientLookup, as_memory_of, check_agreement, check_loss_scaler,
                                      check_process_set, check_state_entry, dense_on_the_wire,
                                      follow_loss_scale, handed_back, named_parameter_list,
                                      refuse_second_reduction, restored_loss_scale, stall_times, wait, wire_dtype)
from hvd_scalecom.traffic import TrafficMeter

INDEX_EXCHANGES = ("allgather", "broadcast")
_TORCH_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
}


def _as_dtype(tensor, dtype):
    """``tensor.to(dtype)`` without the call where it already has that dtype (a microsecond or two
    per tensor and step)."""
    return tensor if tensor.dtype is dtype else tensor.to(dtype)


class _Slot:
    """Everything ScaleCom keeps for one parameter."""

    __slots__ = ("index", "name", "param", "memory", "step", "posted", "expected", "excluded", "scale",
                 "marks", "ahead_for", "handed_back")

    def __init__(self, index, name, param):
        self.index = index
        self.name = name
        self.param = param
        self.memory = None  # residue memory m_i, flat, allocated at the first compressed step
        self.step = 0  # optimizer steps this parameter has been reduced in (t)
        self.posted = None  # (step, handle, indices or None) of an index exchange posted ahead of the hook
        self.expected = None  # the step whose index exchange was posted ahead (on every rank)
        self.excluded = False  # seen not to be reduced through compress(): never posted ahead
        self.scale = None  # the loss scale the memory is expressed in (with a loss_scaler)
        self.marks = None  # I as a bitmap from compress to decompress, where the buffers are traded
        self.ahead_for = None  # pipelined: the step whose indices were selected (or restored) ahead
        self.handed_back = None  # (the gradient object, data_ptr, version) decompress left it with


class ScaleCom(Compressor):
    """CLT-k with a low-pass-filtered residue memory (Chen et al., NeurIPS 2020, Algorithm 1).

    Args:
        named_parameters: ``model.named_parameters()`` (the same ones given to the optimizer).
        ratio: fraction of entries sent per tensor, ``k = max(1, ceil(ratio * numel))``.
        beta: low-pass filter of the residue memory, in (0, 1]; 1 is classic error feedback.
        warmup_steps: optimizer steps (counted from 0) reduced densely first.
        min_numel: parameters with fewer entries are always reduced densely.
        leader: ``"cyclic"`` (``t mod size``) or ``"staggered"`` (``(t + parameter index) mod size``).
        selection: ``"threshold"`` (default) or ``"exact"`` top-k: the same indices (see
            ``clt_k.select_top_k``); "threshold" finds them several times faster on large tensors.
        value_dtype: dtype the selected values travel in, ``torch.float16`` or ``torch.float32``
            (default: the gradient's dtype, but float32 for bfloat16 gradients: Horovod's
            collectives take no bfloat16, so dense bfloat16 gradients travel as float32 too).
        index_dtype: ``torch.int32`` (default; int64 for tensors of 2**31 entries or more) or
            ``torch.int64`` for the indices the leader sends.
        pipelined: use indices selected one step earlier, so that their exchange never stalls the
            backward pass (see ``ScaleComConfig``); off by default: exact ScaleCom.
        index_exchange: how the leader's indices reach the other ranks: ``"allgather"`` (default), to
            which the leader gives its k and the others nothing, or ``"broadcast"`` from the leader.
            The same bytes; Horovod fuses the allgathers that are ready together, as it fuses
            allreduces, but runs each broadcast as an operation of its own (``python -m
            benchmarks.per_tensor`` times both).
        loss_scaler: a ``torch.amp.GradScaler`` (anything with ``get_scale()``) when gradients are
            loss-scaled: the residue memory is rescaled whenever the scale changes.
        process_set: the Horovod process set the optimizer reduces over (default: all ranks).
        timeout: seconds to wait for a leader's indices before raising a RuntimeError (default:
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` if set, else wait). A late exchange prints a
            warning every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60 s), as Horovod does for its own.
    """

    def __init__(self, named_parameters, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024, *,
                 leader="cyclic", selection="threshold", value_dtype=None, index_dtype=torch.int32,
                 pipelined=False, index_exchange="allgather", loss_scaler=None, process_set=None, timeout=None):
        self.config = ScaleComConfig(
            ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=min_numel, leader=leader,
            selection=selection, value_dtype=check_dtype_name(value_dtype, "value_dtype", HOROVOD_VALUE_DTYPES),
            index_dtype=check_dtype_name(index_dtype, "index_dtype", INDEX_DTYPES), pipelined=pipelined)
        if index_exchange not in INDEX_EXCHANGES:
            raise ValueError(f"index_exchange must be one of {INDEX_EXCHANGES}, got {index_exchange!r}")
        self.index_exchange = index_exchange
        if timeout is not None and not (is_real(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout = None if timeout is None else float(timeout)
        self._stall = stall_times(timeout)  # Horovod's stall settings, read at start-up as Horovod does
        self._loss_scaler = check_loss_scaler(loss_scaler)
        self.nonfinite_skips = 0  # tensor-steps whose memory update a non-finite reduction skipped
        pairs = named_parameter_list(named_parameters, "ScaleCom")
        self._slots = [_Slot(i, name, param) for i, (name, param) in enumerate(pairs)]
        self._lookup = GradientLookup([s.param for s in self._slots], [s.name for s in self._slots],
                                      "ScaleCom")
        self._by_name = {s.name: s for s in self._slots}
        self._process_set = check_process_set(process_set)
        self._value_dtype = _TORCH_DTYPES.get(self.config.value_dtype)
        self._posted_through = -1  # last step whose index exchanges were posted ahead
        self._kept_open = []  # (slot, this rank's posted part or None): left open at a load_state_dict
        self._agreed = False  # configurations compared across ranks (at the first compress)
        self._scratch_buffers = {}  # (dtype, device) -> the leader's reused buffer for p = m + g
        self.traffic = TrafficMeter()

    # -- Horovod's Compressor interface -------------------------------------------------------------

    def compress(self, tensor):
        start = time.perf_counter()
        try:
            slot = self._slots[self._lookup.index_of(tensor, self._not_yet_reduced)]
        finally:  # a rank whose parameters differ learns it with all the others, not alone
            if not self._agreed:
                self._check_agreement()
                start = time.perf_counter()  # (its wait for every rank is no compression time)
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"ScaleCom compresses floating-point gradients; the gradient of "
                            f"{slot.name!r} is {tensor.dtype}")
        refuse_second_reduction(slot.handed_back, tensor, "ScaleCom", slot.name)
        original = weakref.ref(tensor)  # (Horovod sets p.grad, this object, to what decompress returns)
        numel = tensor.numel()
        if slot.memory is not None and slot.memory.numel() != numel:
            raise ValueError(f"the gradient of {slot.name!r} has {numel} entries, its residue memory "
                             f"{slot.memory.numel()}: the parameter changed size after training began "
                             f"(build a new ScaleCom for the new model)")
        # No autograd through the compressor (a gradient of backward(create_graph=True) requires grad):
        # the memory must not chain every step's graph. Writes still land in the gradient's storage.
        may_advance = not tensor.requires_grad
        tensor = tensor.detach()
        t = slot.step
        dense_bytes = numel * wire_dtype(tensor.dtype).itemsize  # (what Horovod can reduce: bf16 as fp32)
        if not self.config.is_compressed(numel, t):
            slot.step += 1
            self.traffic.record(t, dense_bytes=dense_bytes, uncompressed_bytes=dense_bytes,
                                compress_seconds=time.perf_counter() - start)
            return dense_on_the_wire(tensor, tensor.dtype)  # (decompress casts a bf16 one back)

        size, rank = self._size_rank()
        leader = self.config.leader_rank(t, size, slot.index)
        k = self.config.num_selected(numel)
        if slot.memory is None:
            slot.memory = torch.zeros(numel, dtype=clt_k.memory_dtype(tensor.dtype), device=tensor.device)
        slot.scale = follow_loss_scale([slot.memory], slot.scale, self._loss_scaler)
        self._post_receives(t, rank, size)
        slot.step += 1
        try:
            values, ctx = self._compress_step(slot, tensor, t, numel, k, size, rank, leader, may_advance, start,
                                              dense_bytes)
            return values, (*ctx, original, values)  # (values: reduced in place by the optimizer, see decompress)
        except BaseException:
            slot.step = t  # the step did not happen: a retry (or a restored state) starts it again
            raise

    def _compress_step(self, slot, tensor, t, numel, k, size, rank, leader, may_advance, start, dense_bytes):
        """Steps 2-3 of ``compress`` for a compressed step ``t``: the indices, then ``p[I]``."""
        wait_from = time.perf_counter()
        sending = None  # the leader's own part of the exchange, completed in decompress (never waited on here)
        taken = None  # a clt_k.Taken (p_i[I], finite, ...) once taken
        if slot.posted is not None and slot.posted[0] == t:
            indices = self._wait(slot, t, rank, size)  # posted ahead, or selected a step ago
        elif rank == leader:
            select_from = time.perf_counter()
            indices, taken = clt_k.select_and_take(slot.memory, tensor, k, self.config.selection,
                                                   scratch=self._scratch(slot.memory),
                                                   index_dtype=self._index_dtype(numel))
            wait_from += time.perf_counter() - select_from
            sending = self._share_async(slot, leader, indices)  # (in the dtype they travel in)
        else:
            indices = self._wait(slot, t, rank, size)
        waited = time.perf_counter() - wait_from
        exchanges = 0 if self.config.pipelined and slot.ahead_for == t else 1  # this step's indices
        if self.config.pipelined and self.config.is_compressed(numel, t + 1):
            self._select_ahead(slot, tensor, t + 1, rank, size)
            exchanges += 1  # and the next step's
        advanced = False  # the gradient's buffer now holds the memory to adopt if the step is finite
        if taken is None and may_advance and clt_k.may_advance(slot.memory, tensor):
            if slot.marks is None:
                slot.marks = clt_k.Marks(numel)  # one bit per entry: 1/32 of the memory's size
            # the indices as received (int32 by default): the bitmap is made from them directly
            taken = clt_k.take_advancing_(slot.memory, tensor, indices, self.config.beta, slot.marks)
            advanced = taken is not None  # None where an index repeats
        if taken is None:
            indices = _as_dtype(indices, torch.int64)  # once, for take_checking and decompress
            taken = clt_k.take_checking(slot.memory, tensor, indices)
        values = _as_dtype(taken.values, self._value_dtype or wire_dtype(tensor.dtype))
        if not taken.finite:
            # A non-finite gradient anywhere on this rank makes the values it sends NaN, so that every
            # rank sees a non-finite reduction and skips this tensor's memory update (see decompress).
            values = torch.full_like(values, float("nan"))
        self.traffic.record(
            t, index_bytes=exchanges * k * self.config.index_itemsize(numel), value_bytes=k * values.element_size(),
            uncompressed_bytes=dense_bytes, index_wait_seconds=waited,
            compress_seconds=time.perf_counter() - start - waited)
        # The version counter tells a change in place before decompress where the gradient owns its
        # storage (a view shares its base's counter with every other view: no evidence of a change to it).
        owned = clt_k.owns_storage(tensor) and not tensor.is_inference()  # (inference: no counter)
        version = tensor._version if owned else None
        return values, (slot, t, indices, tensor, taken, sending, advanced, version)

    def decompress(self, tensor, ctx):
        """The low-pass memory update (deferred to here, where the reduced values tell every rank
        alike whether the step is finite), then the reduced values scattered into the gradient."""
        if ctx is None:
            return tensor
        if isinstance(ctx, torch.dtype):  # a dense bfloat16 gradient, reduced as float32
            return tensor.to(ctx)
        start = time.perf_counter()
        slot, t, indices, grad, taken, sending, advanced, version, original, handed = ctx
        self._check_received(self._synchronize(sending, slot), slot)  # long done: every rank has it
        if version is not None and grad._version != version:
            # Between its hook and synchronize() a gradient is in flight, as Horovod's own in-place
            # allreduce has it; ScaleCom may have written the new memory over it (large CPU tensors).
            raise RuntimeError(
                f"the gradient of {slot.name!r} was changed in place between backward() and the "
                f"optimizer's synchronize(): change gradients (clipping, unscaling) only after "
                f"optimizer.synchronize(), then step inside optimizer.skip_synchronize(). This step "
                f"cannot be completed (the memory is kept; the gradient's buffer is not)")
        sent = _as_dtype(taken.values, self._value_dtype or wire_dtype(grad.dtype))  # as this rank sent them
        if advanced:  # the buffers trade places: the gradient's becomes the memory, and vice versa
            out, slot.memory, updated = clt_k.filter_and_scatter_advanced(
                slot.memory, grad, indices, tensor, taken, sent, self.config.beta, slot.marks)
            if updated and tensor is not handed:
                # Reduced out of place: hvd.allreduce(p.grad, compression=...), not the optimizer (which
                # reduces the values in place and sets p.grad to what this returns). The caller keeps
                # the gradient it handed over, whose buffer now holds the memory: trade the contents back,
                # so that it holds the result (as a contiguous gradient does) and the memory its own.
                result = out.clone()
                out.copy_(slot.memory)
                slot.memory.copy_(result)
                slot.memory, out = out, slot.memory
            out = out.view(grad.shape)
        elif grad.is_contiguous():  # the gradient's storage, now read, receives the result
            out = grad
            updated = clt_k.filter_and_scatter_(slot.memory, grad, indices, tensor, taken, sent, self.config.beta)
        else:
            indices = _as_dtype(indices, torch.int64)  # (the leader's may be int32 it sends)
            updated = clt_k.all_finite(tensor)
            if updated:
                clt_k.filter_memory_(slot.memory, grad, indices, clt_k.memory_at(slot.memory, indices, taken),
                                     taken.values, sent, self.config.beta)
            out = clt_k.scatter_dense(tensor, indices, grad.numel(), grad.dtype).view(grad.shape)
        if not updated:
            self.nonfinite_skips += 1
        slot.handed_back = handed_back(original, out)  # (a second reduction of this step: see compress)
        self.traffic.add_time(t, time.perf_counter() - start)
        return out

    # -- state and statistics -----------------------------------------------------------------------

    def stats(self, step=None):
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step).
        The last five steps are kept; an earlier one asked for is a ValueError (``total`` counts every
        step; the default step never is one).

        Returns a dict with ``step``, ``index_bytes``, ``value_bytes``, ``dense_bytes``, ``sent_bytes``,
        ``uncompressed_bytes``, ``ratio`` (uncompressed / sent), ``compress_seconds``,
        ``index_wait_seconds``, ``tensors`` and ``nonfinite_skips`` (tensor-steps whose memory update a
        non-finite reduction skipped, over all steps), and ``total``: the same over all steps so far.
        """
        explicit = step is not None  # (a default step is never refused)
        if step is None:
            reduced = [s.step for s in self._slots if s.step > 0]
            step = min(reduced) - 1 if reduced else 0
        out = self.traffic.step(step, strict=explicit).as_dict()
        out["step"] = step
        out["nonfinite_skips"] = self.nonfinite_skips
        out["total"] = self.traffic.total.as_dict()
        return out

    def state_dict(self):
        """Residue memories, step counters and (pipelined) the indices already chosen for the next
        step, by parameter name, and the configuration. Call it between steps.

        It waits only for those indices (every rank gave its part of their exchange a step ago), not
        for a receive left open by a tensor that Horovod reduced without ``compress``: only that
        tensor's leader completes it, at its next step."""
        params = {}
        for s in self._slots:
            entry = {"step": s.step, "shape": list(s.param.shape),
                     "memory": None if s.memory is None else s.memory.detach().clone(), "scale": s.scale}
            if self._selected_ahead(s):
                t, handle, indices = s.posted
                received = self._check_received(self._synchronize(handle, s), s)
                indices = indices if received is None else received
                s.posted = (t, None, indices)
                entry["next_indices"] = (t, indices.clone())
            params[s.name] = entry
        return {"config": self.config.as_dict(), "params": params}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned; checks everything before changing anything. A
        memory saved with a ``loss_scaler`` loads into a ScaleCom without one divided by its scale, one
        saved without into one with a ``loss_scaler`` as of scale 1 (rescaled at the next step).

        An index exchange still open in Horovod for a tensor that it reduced without ``compress`` (a
        sparse gradient, say) is kept, whatever step the state restores: the next step completes it, as
        it would have without the load (posting that exchange again before would be an error)."""
        params = checked_params(state, "ScaleCom", self.config.as_dict(), self._by_name)
        restored = {}  # name -> (memory, loss scale, next step's (t, indices) or None), all checked
        for name, entry in params.items():
            param = self._by_name[name].param
            numel = param.numel()
            check_state_entry(name, entry, param.shape, ("memory",), step=False,
                              dtype=clt_k.memory_dtype(param.dtype))
            scale = check_loss_scale(entry.get("scale"), f"state scale of {name!r}")
            memory = entry.get("memory")
            if memory is not None:  # (in this ScaleCom's units)
                memory = as_memory_of(memory, param)
                scale = restored_loss_scale([memory], scale, self._loss_scaler)
            ahead = None
            if "next_indices" in entry:
                t, indices = check_next_indices(
                    name, entry["next_indices"], self.config.num_selected(numel), numel,
                    self.config.pipelined and self.config.compresses(numel), entry_step=int(entry["step"]))
                ahead = (t, torch.as_tensor(indices).to(device=param.device, dtype=self._index_dtype(numel),
                                                        copy=True))
            restored[name] = (memory, scale, ahead)
        left_open = [(slot, slot.posted) for slot in self._slots if self._left_open(slot)]
        for name, entry in params.items():
            slot = self._by_name[name]
            slot.memory, slot.scale, ahead = restored[name]
            slot.step = int(entry["step"])
            slot.posted = None if ahead is None else (ahead[0], None, ahead[1])
            slot.expected = slot.ahead_for = None if ahead is None else ahead[0]
        for slot, _ in left_open:
            slot.excluded = True  # as the next step would find (and nothing posted for it again)
        self._kept_open += left_open
        self._lookup.reset()
        self._posted_through = -1

    def resync(self):
        """After a membership change (elastic Horovod): adopt rank 0's step counters, keep this
        rank's residue memory (a new rank starts with zeros; a departed rank's memory is lost, like a
        dropped gradient), forget index exchanges of the old world (pipelined indices are selected fresh),
        and compare configurations again at the next ``compress``. Every rank must call it."""
        steps = torch.tensor([slot.step for slot in self._slots], dtype=torch.int64)
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        root = 0 if self._process_set is None else self._process_set.ranks[0]
        steps = hvd.broadcast(steps, root_rank=root, name="scalecom.resync", **kwargs)
        for slot, step in zip(self._slots, steps.tolist()):
            slot.step = step
            slot.posted = slot.expected = slot.ahead_for = None
            slot.excluded = False
        self._kept_open = []  # (Horovod was re-initialised: nothing of the old world is open)
        self._lookup.reset()
        self._posted_through = -1
        self._agreed = False

    # -- internals ---------------------------------------------------------------------------------

    def _check_agreement(self):
        """Every rank compares its configuration and parameter list with all others' at its first
        ``compress``: a mismatch would otherwise hang (different k or names) or diverge silently."""
        if not hvd.is_initialized():
            return  # compress() called outside a Horovod job (nothing to agree with)
        named_shapes = [(slot.name, tuple(slot.param.shape)) for slot in self._slots]
        summary = {**self.config.as_dict(), "index_exchange": self.index_exchange, "parameters": len(named_shapes),
                   "parameter_digest": shapes_digest(named_shapes),
                   "parameter_dtypes": dtype_names(slot.param.dtype for slot in self._slots),
                   "loss_scaler": self._loss_scaler is not None,
                   "steps": sorted({slot.step for slot in self._slots})}
        self._agreed = True
        check_agreement("ScaleCom", summary, self._process_set,
                        {"parameter_digest": "(parameter_digest covers the names and shapes of "
                                             "named_parameters.)",
                         "parameter_dtypes": DTYPES_HINT,
                         "loss_scaler": "(a loss_scaler given on some ranks only: the others' residue "
                                        "memories would not follow the loss scale.)",
                         "steps": STEPS_HINT}, stall=stall_times())  # (timeout= is for indices)

    def _index_dtype(self, numel):
        return _TORCH_DTYPES[self.config.index_dtype_for(numel)]

    def _size_rank(self):
        ps = self._process_set
        if ps is None:
            return hvd.size(), hvd.rank()
        return ps.size(), ps.rank()

    def _share_async(self, slot, leader, indices=None, ahead=False):
        """Start sharing the k ``indices`` of ``leader`` (relative rank; None on the other ranks), so
        that every rank receives them: an allgather to which the leader gives its k and every other
        rank nothing, or (``index_exchange="broadcast"``) a broadcast from the leader into a buffer of
        k on the others. Under the parameter's name, with ``.ahead`` for the indices a pipelined step
        shares for the next one: a step that exchanges its own indices too has both in flight (names
        must differ)."""
        name = f"scalecom.{slot.name}.ahead" if ahead else f"scalecom.{slot.name}"
        ps = self._process_set
        kwargs = {} if ps is None else {"process_set": ps}
        if self.index_exchange == "broadcast":  # (Horovod wants the root as a global rank)
            buffer = self._dummy_indices(slot) if indices is None else indices
            return hvd.broadcast_async_(buffer, root_rank=leader if ps is None else ps.ranks[leader], name=name,
                                        **kwargs)
        if indices is None:
            numel = slot.param.numel()
            indices = torch.empty(0, dtype=self._index_dtype(numel), device=slot.param.device)
        return hvd.allgather_async(indices, name=name, **kwargs)

    def _dummy_indices(self, slot):
        numel = slot.param.numel()
        return torch.zeros(self.config.num_selected(numel), dtype=self._index_dtype(numel),
                           device=slot.param.device)

    def _post_receives(self, t, rank, size):
        """Once per step: post this rank's (empty) part of the index exchange of every tensor it does
        not lead.

        A tensor expected in the previous step but not reduced then (say, a sparse gradient that
        Horovod reduces without compressing it) left a receive pending on the non-leaders: its leader
        completes it with a dummy and the tensor is no longer posted ahead. So are those that
        :meth:`load_state_dict` kept open.
        """
        if self._posted_through == t:
            return
        self._posted_through = t
        stale = [self._complete_unused(slot, posted, rank) for slot, posted in self._kept_open]
        self._kept_open = []
        for slot in self._slots:
            if slot.expected is not None and slot.expected < t and slot.step <= slot.expected:
                stale.append(self._drop_stale(slot, rank, size))
            if slot.excluded or slot.step != t or not slot.param.requires_grad:
                continue
            if self.config.is_compressed(slot.param.numel(), t):
                slot.expected = t
                self._post(slot, t, rank, size)
        for handle in stale:
            hvd.synchronize(handle)

    def _drop_stale(self, slot, rank, size):
        slot.excluded = True
        slot.expected = slot.ahead_for = None
        posted, slot.posted = slot.posted, None
        return self._complete_unused(slot, posted, rank)

    def _complete_unused(self, slot, posted, rank):
        """The handle to synchronize for an exchange that no step will use: that of this rank's
        ``posted`` part (a receive, or a pipelined leader's own part), or where it posted none (only
        the leader does not), of the dummy part it posts now."""
        if posted is not None:
            return posted[1]
        return self._share_async(slot, rank, self._dummy_indices(slot))

    def _post(self, slot, t, rank, size):
        numel = slot.param.numel()
        leader = self.config.leader_rank(t, size, slot.index)
        if leader == rank or not self.config.is_compressed(numel, t):
            return
        if slot.posted is not None and slot.posted[0] == t:
            return  # selected a step ago (pipelined)
        slot.posted = (t, self._share_async(slot, leader), None)

    def _scratch(self, memory):
        """A flat buffer of ``memory``'s dtype and device for the leader's ``p = m + g``, reused from
        tensor to tensor and step to step (grown to the largest memory it served)."""
        key = (memory.dtype, memory.device)
        buffer = self._scratch_buffers.get(key)
        if buffer is None or buffer.numel() < memory.numel():
            buffer = torch.empty(memory.numel(), dtype=memory.dtype, device=memory.device)
            self._scratch_buffers[key] = buffer
        return buffer

    def _select_ahead(self, slot, grad, t, rank, size):
        """Pipelined mode: the leader of step ``t`` selects now, from this step's ``p = m + g``, and
        every rank starts that exchange without waiting for it."""
        leader = self.config.leader_rank(t, size, slot.index)
        if leader == rank:
            numel = slot.memory.numel()
            buffer = clt_k.select_top_k_of_sum(slot.memory, grad, self.config.num_selected(numel),
                                               self.config.selection, scratch=self._scratch(slot.memory))
            buffer = buffer.to(self._index_dtype(numel))
        else:
            buffer = None
        slot.posted = (t, self._share_async(slot, leader, buffer, ahead=True), buffer)
        slot.expected = slot.ahead_for = t

    @staticmethod
    def _left_open(slot):
        """Whether the exchange posted ahead for step ``slot.expected`` is still open although that step
        is over (between steps: Horovod reduced the tensor without ``compress``) and needs its leader's
        part, which that leader posts at its next step (not one :meth:`_select_ahead` started)."""
        return (slot.expected is not None and slot.step <= slot.expected
                and slot.ahead_for != slot.expected)

    @staticmethod
    def _selected_ahead(slot):
        """Whether ``slot.posted`` holds the indices :meth:`_select_ahead` started sharing (or a state
        restored): every rank has posted its part of their exchange."""
        return slot.posted is not None and slot.posted[0] == slot.ahead_for

    def _wait(self, slot, t, rank, size):
        if slot.posted is None or slot.posted[0] != t:
            self._post(slot, t, rank, size)  # not reduced when the step's posts went out
        _, handle, indices = slot.posted
        slot.posted = None
        received = self._check_received(self._synchronize(handle, slot), slot)
        return indices if received is None else received

    def _check_received(self, received, slot):
        """``received`` (None, or the indices an exchange delivered), unless it does not hold k
        indices: then the ranks disagree on the step's leader (an allgather gives 0 where no rank
        led, 2k where two did), and every rank, seeing the same count, raises the same ValueError."""
        k = self.config.num_selected(slot.param.numel())
        if received is not None and received.numel() != k:
            raise ValueError(
                f"ScaleCom: the index exchange of {slot.name!r} delivered {received.numel()} indices, not "
                f"k = {k}: the ranks disagree on this step's leader, so their step counters differ (restore "
                f"every rank from a state_dict() of the same step)")
        return received

    def _synchronize(self, handle, slot):
        """The leader's indices once their exchange completes (:func:`hvd_scalecom.torch.common.wait`):
        a warning every ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60) while it is late, a RuntimeError after
        ``timeout`` (or ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``); None for no ``handle``."""
        if handle is None:
            return None  # restored from a checkpoint: nothing in flight
        return wait(handle, self._stall, "ScaleCom",
             f"the leader's indices for {slot.name!r}. A rank reduces this parameter later than the others "
             f"(e.g. it is frozen or unused on some ranks only, or ranks reduce parameters in different "
             f"orders while leader='staggered'), a rank stopped training, or a rank is still in warm-up "
             f"(its step counters differ: restore every rank from a state_dict() of the same step)"
             + (", or the ranks restored states of which only some held this parameter's next_indices "
                "(pipelined: the others use the indices chosen ahead and exchange none; restore every rank "
                "from states saved after the same step)" if self.config.pipelined else ""),
             "Set ScaleCom(timeout=...) to raise instead.")

    def _not_yet_reduced(self, index):
        """Whether parameter ``index``, one of several whose sparse gradients have its shape (the
        lookup's candidates), is not yet reduced in this step: its step counter is the lowest among
        theirs. (Not among all parameters': one never reduced, frozen from the start, stays at 0.)"""
        slot = self._slots[index]
        steps = [s.step for s in self._slots if s.param.grad is not None and s.param.grad.is_sparse
                 and s.param.shape == slot.param.shape]
        return slot.step == min(steps, default=slot.step)


# Elastic Horovod: hvd.elastic.TorchState(..., compression=scalecom) takes ScaleCom's own state handler
# whether or not hvd_scalecom.torch.elastic was imported (Horovod would otherwise pickle the compressor
# into every sync, and keep neither its memories nor its step counters).
import hvd_scalecom.torch.elastic  # noqa: E402,F401  (registers the handler; needs ScaleCom above)
