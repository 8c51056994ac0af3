"""ScaleCom (CLT-k) as a ``horovod.torch`` Compressor for the stock ``hvd.DistributedOptimizer``.

Chen et al., NeurIPS 2020, Algorithm 1; the equations are in :mod:`hvd_scalecom.torch.clt_k`. Per
parameter and step ``t``, with leader ``L = config.leader_rank(t, n, index)``:

1. ``compress(g)`` (core): on ``L``, ``p = m + g`` and its top-k indices ``I`` (steps 1-2);
2. (Horovod) ``I`` reaches every rank through :class:`~hvd_scalecom.torch.index_exchange.IndexExchange`;
3. (core) every rank returns ``p[I]``, k values (step 3);
4. (Horovod) the optimizer allreduces those values with its own op, pre/postscale and process set;
5. ``decompress`` (core): the low-pass memory update (step 4) and the reduced values written, over
   zeros, into the gradient's storage (step 5).
"""

import time
import weakref
from typing import NamedTuple, Optional

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor

from hvd_scalecom.agreement import DTYPES_HINT, STEPS_HINT, dtype_names, shapes_digest
from hvd_scalecom.config import HOROVOD_VALUE_DTYPES, INDEX_DTYPES, ScaleComConfig, check_dtype_name, is_real
from hvd_scalecom.health import HealthCheck
from hvd_scalecom.state_checks import check_loss_scale, check_next_indices, checked_params
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.collectives import check_agreement, check_process_set, stall_times
from hvd_scalecom.torch.dtypes import TORCH_DTYPES, as_dtype, dense_on_the_wire, wire_dtype
from hvd_scalecom.torch.health_steps import HealthStep, HealthSteps, check_options
from hvd_scalecom.torch.index_exchange import MODES as INDEX_EXCHANGES
from hvd_scalecom.torch.index_exchange import IndexExchange
from hvd_scalecom.torch.loss_scale import check_loss_scaler, follow_loss_scale, restored_loss_scale
from hvd_scalecom.torch.parameters import GradientLookup, handed_back, named_parameter_list, refuse_second_reduction
from hvd_scalecom.torch.saved_state import as_memory_of, check_state_entry
from hvd_scalecom.traffic import TrafficMeter


class _Slot:
    """What ScaleCom keeps for one parameter (its index exchanges: :class:`IndexExchange`)."""

    __slots__ = ("index", "name", "param", "memory", "step", "scale", "marks", "handed_back")

    def __init__(self, index, name, param):
        self.index = index
        self.name = name
        self.param = param
        self.memory = None  # residue memory m_i, flat, allocated at the first compressed step
        self.step = 0  # optimizer steps this parameter has been reduced in (t)
        self.scale = None  # the loss scale the memory is expressed in (with a loss_scaler)
        self.marks = None  # I as a bitmap from compress to decompress, where the buffers are traded
        self.handed_back = None  # what decompress left the gradient as (parameters.handed_back)


class _Round(NamedTuple):
    """One parameter's compressed step as ``compress`` found it."""

    t: int  # the parameter's step
    rank: int  # this rank and the number of ranks, in the process set
    size: int
    leader: int  # the step's leader (relative rank)
    k: int  # entries selected
    started: float  # time.perf_counter() when compress began
    may_advance: bool  # the gradient requires no grad: its buffer may become the memory


class CompressedStep(NamedTuple):
    """What ``compress`` hands ``decompress`` for one compressed parameter-step (Horovod's ctx)."""

    slot: _Slot  # the parameter
    step: int  # its step t
    indices: torch.Tensor  # I, as received (or selected)
    grad: torch.Tensor  # the gradient g, detached (its storage receives the result)
    taken: "clt_k.Taken"  # p[I] and what else step 3 took for steps 4-5
    leader_part: object  # the leader's own part of the index exchange (a Horovod handle), else None
    traded: bool  # g's buffer holds the new memory: decompress trades the buffers
    grad_version: Optional[int]  # g's version counter at compress (None: not trackable)
    original: weakref.ref  # the gradient object Horovod handed over
    sent: torch.Tensor  # the values compress returned (Horovod reduces them in place)


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
        check_every: the health check (``hvd_scalecom.health``): one compressed step in ``check_every`` of
            each tensor (its first compressed step, then every ``check_every``-th) reduces ``p = m + g``
            densely instead of ``p[I]`` (the same training; one dense step's bytes) and measures how much
            of the averaged ``p``'s top-k energy the leader's indices carried; ``stats()["health"]``
            reports it. ``None`` (default): no checks.
        fallback: ``"dense"``: a tensor whose checks stay low (``captured < min_captured`` for
            ``patience`` checks in a row) is sent densely until as many checks in a row recover;
            ``None`` (default): the checks only report (and warn once, on rank 0). Needs
            ``check_every`` and ``pipelined=False``.
        min_captured: the captured energy share, in [0, 1], below which a check counts as low (0.5).
        patience: low (or, falling back, good) checks in a row before a tensor changes how it is sent (2).
    """

    def __init__(self, named_parameters, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024, *,
                 leader="cyclic", selection="threshold", value_dtype=None, index_dtype=torch.int32,
                 pipelined=False, index_exchange="allgather", loss_scaler=None, process_set=None, timeout=None,
                 check_every=None, fallback=None, min_captured=0.5, patience=2):
        self.config = ScaleComConfig(
            ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=min_numel, leader=leader,
            selection=selection, value_dtype=check_dtype_name(value_dtype, "value_dtype", HOROVOD_VALUE_DTYPES),
            index_dtype=check_dtype_name(index_dtype, "index_dtype", INDEX_DTYPES), pipelined=pipelined)
        self.health = HealthCheck(check_every=check_every, fallback=fallback, min_captured=min_captured,
                                  patience=patience)
        check_options(self.health, self.config.pipelined)
        if index_exchange not in INDEX_EXCHANGES:
            raise ValueError(f"index_exchange must be one of {INDEX_EXCHANGES}, got {index_exchange!r}")
        self.index_exchange = index_exchange
        if timeout is not None and not (is_real(timeout) and timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        self.timeout = None if timeout is None else float(timeout)
        stall = stall_times(timeout)  # Horovod's stall settings, read at start-up as Horovod does
        self._loss_scaler = check_loss_scaler(loss_scaler)
        self.nonfinite_skips = 0  # tensor-steps whose memory update a non-finite reduction skipped
        pairs = named_parameter_list(named_parameters, "ScaleCom")
        self._slots = [_Slot(i, name, param) for i, (name, param) in enumerate(pairs)]
        self._lookup = GradientLookup([s.param for s in self._slots], [s.name for s in self._slots],
                                      "ScaleCom")
        self._by_name = {s.name: s for s in self._slots}
        self._process_set = check_process_set(process_set)
        self._value_dtype = TORCH_DTYPES.get(self.config.value_dtype)
        self._exchange = IndexExchange(self._slots, self.config, index_exchange, self._process_set, stall)
        self._health_steps = None  # the health check's steps (check_every), else None
        if self.health.enabled:
            self._health_steps = HealthSteps(self.health, [s.name for s in self._slots], self.config.warmup_steps)
            self._exchange.skips = self._health_steps.exchanges_no_indices
        self._agreed = False  # configurations compared across ranks (at the first compress)
        self._scratch_buffers = {}  # (dtype, device) -> the leader's reused buffer for p = m + g
        self.traffic = TrafficMeter()

    # -- Horovod's Compressor interface -------------------------------------------------------------

    def compress(self, tensor):
        """Steps 1-3 for ``tensor``, a parameter's gradient: ``(p[I], CompressedStep)``, or the
        gradient itself where it is reduced densely (warm-up, fewer than ``min_numel`` entries)."""
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
        if not self.config.is_compressed(numel, t):
            slot.step += 1
            dense_bytes = numel * wire_dtype(tensor.dtype).itemsize  # (what Horovod can reduce: bf16 as fp32)
            self.traffic.record(t, dense_bytes=dense_bytes, uncompressed_bytes=dense_bytes,
                                compress_seconds=time.perf_counter() - start)
            return dense_on_the_wire(tensor, tensor.dtype)  # (decompress casts a bf16 one back)

        size, rank = self._size_rank()
        step = _Round(t, rank, size, self.config.leader_rank(t, size, slot.index),
                      self.config.num_selected(numel), start, may_advance)
        if slot.memory is None:
            slot.memory = torch.zeros(numel, dtype=clt_k.memory_dtype(tensor.dtype), device=tensor.device)
        slot.scale = follow_loss_scale([slot.memory], slot.scale, self._loss_scaler)
        self._post_receives(t, rank, size)
        slot.step += 1
        try:
            if self._health_steps is not None:  # a check or fallback step (check_every)
                kind = self._health_steps.kind(slot.name, t)
                if kind is not None:
                    return self._health_steps.compress(self, slot, tensor, step, original, kind)
            return self._compress_step(slot, tensor, step, original)
        except BaseException:
            slot.step = t  # the step did not happen: a retry (or a restored state) starts it again
            raise

    def _compress_step(self, slot, tensor, step, original):
        """Steps 2-3 of a compressed step: the indices (selected, or received), then ``p[I]``."""
        t, numel = step.t, tensor.numel()
        wait_from = time.perf_counter()
        leader_part = None  # the leader's own part of the exchange, completed in decompress
        taken = None  # a clt_k.Taken (p_i[I], finite, ...) once taken
        if step.rank == step.leader and not self._exchange.posted_for(slot, t):
            select_from = time.perf_counter()
            indices, taken = clt_k.select_and_take(slot.memory, tensor, step.k, self.config.selection,
                                                   scratch=self._scratch(slot.memory),
                                                   index_dtype=self._exchange.index_dtype(numel))
            wait_from += time.perf_counter() - select_from
            leader_part = self._exchange.send(slot, step.leader, indices)  # (in the dtype they travel in)
        else:  # posted ahead, selected a step ago, or this rank is not the leader
            indices = self._wait(slot, t, step.rank, step.size)
        waited = time.perf_counter() - wait_from
        exchanges = 0 if self.config.pipelined and self._exchange.selected_ahead_for(slot, t) else 1
        if self.config.pipelined and self.config.is_compressed(numel, t + 1):
            self._select_ahead(slot, tensor, t + 1, step.rank, step.size)
            exchanges += 1  # and the next step's
        traded = False  # the gradient's buffer now holds the memory to adopt if the step is finite
        if taken is None and step.may_advance and clt_k.may_advance(slot.memory, tensor):
            if slot.marks is None:
                slot.marks = clt_k.Marks(numel)  # one bit per entry: 1/32 of the memory's size
            # the indices as received (int32 by default): the bitmap is made from them directly
            taken = clt_k.take_advancing_(slot.memory, tensor, indices, self.config.beta, slot.marks)
            traded = taken is not None  # None where an index repeats
        if taken is None:
            indices = as_dtype(indices, torch.int64)  # once, for take_checking and decompress
            taken = clt_k.take_checking(slot.memory, tensor, indices)
        values = as_dtype(taken.values, self._value_dtype or wire_dtype(tensor.dtype))
        if not taken.finite:
            # A non-finite gradient anywhere on this rank makes the values it sends NaN, so that every
            # rank sees a non-finite reduction and skips this tensor's memory update (see decompress).
            values = torch.full_like(values, float("nan"))
        self.traffic.record(
            t, index_bytes=exchanges * step.k * self._exchange.index_dtype(numel).itemsize,
            value_bytes=step.k * values.element_size(),
            uncompressed_bytes=numel * wire_dtype(tensor.dtype).itemsize, index_wait_seconds=waited,
            compress_seconds=time.perf_counter() - step.started - waited)
        # The version counter tells a change in place before decompress where the gradient owns its
        # storage (a view shares its base's counter with every other view: no evidence of a change to it).
        owned = clt_k.owns_storage(tensor) and not tensor.is_inference()  # (inference: no counter)
        version = tensor._version if owned else None
        return values, CompressedStep(slot, t, indices, tensor, taken, leader_part, traded, version, original,
                                      values)

    def decompress(self, tensor, ctx):
        """Steps 4-5 once Horovod has reduced the values: the low-pass memory update (here, where the
        reduced values tell every rank alike whether the step is finite), then the reduced values
        scattered into the gradient."""
        if ctx is None:
            return tensor
        if isinstance(ctx, torch.dtype):  # a dense bfloat16 gradient, reduced as float32
            return tensor.to(ctx)
        if isinstance(ctx, HealthStep):  # a check or fallback step (check_every)
            return self._health_steps.decompress(self, tensor, ctx)
        start = time.perf_counter()
        slot, t, indices, grad, taken, leader_part, traded, version, original, sent_tensor = ctx
        self._exchange.finish(leader_part, slot)
        if version is not None and grad._version != version:
            # Between its hook and synchronize() a gradient is in flight, as Horovod's own in-place
            # allreduce has it; ScaleCom may have written the new memory over it (large CPU tensors).
            raise RuntimeError(
                f"the gradient of {slot.name!r} was changed in place between backward() and the "
                f"optimizer's synchronize(): change gradients (clipping, unscaling) only after "
                f"optimizer.synchronize(), then step inside optimizer.skip_synchronize(). This step "
                f"cannot be completed (the memory is kept; the gradient's buffer is not)")
        sent = as_dtype(taken.values, self._value_dtype or wire_dtype(grad.dtype))  # as this rank sent them
        if traded:  # the buffers trade places: the gradient's becomes the memory, and vice versa
            out, slot.memory, updated = clt_k.filter_and_scatter_advanced(
                slot.memory, grad, indices, tensor, taken, sent, self.config.beta, slot.marks)
            if updated and tensor is not sent_tensor:
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
            indices = as_dtype(indices, torch.int64)  # (the leader's may be int32 it sends)
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

    # -- the index exchange (Horovod), as seen from compress -----------------------------------------

    def _size_rank(self):
        ps = self._process_set
        if ps is None:
            return hvd.size(), hvd.rank()
        return ps.size(), ps.rank()

    def _post_receives(self, t, rank, size):
        """Once per step, at its first compress: :meth:`IndexExchange.begin_step`."""
        self._exchange.begin_step(t, rank, size)

    def _wait(self, slot, t, rank, size):
        """The indices of step ``t`` on a rank that does not select them now: :meth:`IndexExchange.receive`."""
        return self._exchange.receive(slot, t, rank, size)

    def _select_ahead(self, slot, grad, t, rank, size):
        """Pipelined: the leader of step ``t`` selects now, from this step's ``p = m + g``, and every
        rank posts its part of that exchange without waiting for it."""
        leader = self.config.leader_rank(t, size, slot.index)
        indices = None
        if leader == rank:
            numel = slot.memory.numel()
            indices = clt_k.select_top_k_of_sum(slot.memory, grad, self.config.num_selected(numel),
                                                self.config.selection, scratch=self._scratch(slot.memory))
            indices = indices.to(self._exchange.index_dtype(numel))
        self._exchange.share_ahead(slot, t, leader, indices)

    def _scratch(self, memory):
        """A flat buffer of ``memory``'s dtype and device for the leader's ``p = m + g``, reused from
        tensor to tensor and step to step (grown to the largest memory it served)."""
        key = (memory.dtype, memory.device)
        buffer = self._scratch_buffers.get(key)
        if buffer is None or buffer.numel() < memory.numel():
            buffer = torch.empty(memory.numel(), dtype=memory.dtype, device=memory.device)
            self._scratch_buffers[key] = buffer
        return buffer

    # -- state and statistics -----------------------------------------------------------------------

    def stats(self, step=None):
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step).
        The last five steps are kept; an earlier one asked for is a ValueError (``total`` counts every
        step; the default step never is one).

        Returns a dict with ``step``, ``index_bytes``, ``value_bytes``, ``dense_bytes``, ``sent_bytes``,
        ``uncompressed_bytes``, ``ratio`` (uncompressed / sent), ``compress_seconds``,
        ``index_wait_seconds``, ``tensors`` and ``nonfinite_skips`` (tensor-steps whose memory update a
        non-finite reduction skipped, over all steps), and ``total``: the same over all steps so far.
        With ``check_every``, ``health``: ``HealthMonitor.summary()`` (``overlap``, ``captured``,
        ``selected_share``, ``topk_share`` over each tensor's latest check, ``checks``, ``dense_steps``,
        ``dense_tensors`` and ``by_tensor``); a check step's dense ``p`` counts as ``value_bytes``, a
        fallback step's as ``dense_bytes``.
        """
        explicit = step is not None  # (a default step is never refused)
        if step is None:
            reduced = [s.step for s in self._slots if s.step > 0]
            step = min(reduced) - 1 if reduced else 0
        out = self.traffic.step(step, strict=explicit).as_dict()
        out["step"] = step
        out["nonfinite_skips"] = self.nonfinite_skips
        out["total"] = self.traffic.total.as_dict()
        if self._health_steps is not None:
            out["health"] = self._health_steps.monitor.summary()
        return out

    def state_dict(self):
        """Residue memories, step counters and (pipelined) the indices already chosen for the next
        step, by parameter name, and the configuration; with ``check_every``, ``health``: the checks'
        results and the fallback's decisions per tensor. Call it between steps.

        It waits only for those indices (every rank gave its part of their exchange a step ago), not
        for a receive left open by a tensor that Horovod reduced without ``compress``: only that
        tensor's leader completes it, at its next step."""
        params = {}
        for s in self._slots:
            entry = {"step": s.step, "shape": list(s.param.shape),
                     "memory": None if s.memory is None else s.memory.detach().clone(), "scale": s.scale}
            ahead = self._exchange.next_indices(s)
            if ahead is not None:
                entry["next_indices"] = (ahead[0], ahead[1].clone())
            params[s.name] = entry
        state = {"config": self.config.as_dict(), "params": params}
        if self._health_steps is not None:  # (the checks' results and the fallback's decisions)
            state["health"] = self._health_steps.monitor.state_dict()
        return state

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
                ahead = (t, torch.as_tensor(indices).to(device=param.device, dtype=self._exchange.index_dtype(numel),
                                                        copy=True))
            restored[name] = (memory, scale, ahead)
        # (a state without "health", or one loaded where check_every is None: fresh checks, none kept)
        health = None if self._health_steps is None else self._health_steps.loaded(state.get("health"))
        # (before the step counters change: an exchange left open is one for a step now over)
        self._exchange.restore({self._by_name[name]: restored[name][2] for name in params})
        for name, entry in params.items():
            slot = self._by_name[name]
            slot.memory, slot.scale, _ = restored[name]
            slot.step = int(entry["step"])
        if health is not None:
            self._health_steps.adopt(health)
        self._lookup.reset()

    def resync(self):
        """After a membership change (elastic Horovod): adopt rank 0's step counters, keep this
        rank's residue memory (a new rank starts with zeros; a departed rank's memory is lost, like a
        dropped gradient), forget index exchanges of the old world (pipelined indices are selected fresh)
        and the health checks' results (every tensor compressed again), and compare configurations again
        at the next ``compress``. Every rank must call it."""
        steps = torch.tensor([slot.step for slot in self._slots], dtype=torch.int64)
        kwargs = {} if self._process_set is None else {"process_set": self._process_set}
        root = 0 if self._process_set is None else self._process_set.ranks[0]
        steps = hvd.broadcast(steps, root_rank=root, name="scalecom.resync", **kwargs)
        for slot, step in zip(self._slots, steps.tolist()):
            slot.step = step
        self._exchange.forget()  # (Horovod was re-initialised: nothing of the old world is open)
        if self._health_steps is not None:
            self._health_steps.reset()  # (every rank forgets its checks: ranks agree again)
        self._lookup.reset()
        self._agreed = False

    # -- internals ---------------------------------------------------------------------------------

    def _check_agreement(self):
        """Every rank compares its configuration and parameter list with all others' at its first
        ``compress``: a mismatch would otherwise hang (different k or names) or diverge silently."""
        if not hvd.is_initialized():
            return  # compress() called outside a Horovod job (nothing to agree with)
        if self._health_steps is not None:
            self._health_steps.warn_on(self._size_rank()[1] == 0)  # (one rank warns)
        named_shapes = [(slot.name, tuple(slot.param.shape)) for slot in self._slots]
        summary = {**self.config.as_dict(), **self.health.as_dict(), "index_exchange": self.index_exchange,
                   "parameters": len(named_shapes),
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
