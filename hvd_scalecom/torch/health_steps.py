"""The health check's steps in the Horovod PyTorch :class:`~hvd_scalecom.torch.ScaleCom`
(``check_every``, ``fallback="dense"``): :mod:`hvd_scalecom.health` holds the schedule and the
decisions, :func:`hvd_scalecom.torch.health.measure` the measures.

In the notation of Chen et al. (NeurIPS 2020), Algorithm 1, per tensor and compressed step t:

- a *check step* exchanges the leader's ``I`` as a compressed step does and reduces ``p = m + g``
  densely (in the values' dtype) instead of ``p[I]``. While the tensor is compressed its output is
  ``scatter(I, P[I])`` and its memory update the usual one (step 4): the training is plain ScaleCom's,
  only the bytes differ. While it falls back its output is ``P`` and ``m <- 0``. Either
  way the measures of ``(P, I)`` are recorded then, and decide from the tensor's next step on.
- a *fallback step* (the tensor is sent densely, no check): no index exchange; ``p`` is reduced
  densely, the output is ``P`` and ``m <- 0`` (everything owed was sent).

A rank whose gradient is not finite sends NaN on a check step (as on a compressed step: every rank
then skips the memory update), ``p`` as it is on a fallback step (as on a dense step); a non-finite
reduction leaves the memory as it was and decides nothing.
"""

import time
import weakref
from typing import NamedTuple, Optional

import torch

from hvd_scalecom.health import HealthMonitor
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.dtypes import as_dtype, wire_dtype
from hvd_scalecom.torch.health import measure
from hvd_scalecom.torch.parameters import handed_back

CHECK = "check"  # a check step of a compressed tensor
DENSE = "dense"  # a fallback step: sent densely, no check
CHECK_DENSE = "check, dense"  # a check step of a tensor that falls back


def check_options(health, pipelined):
    """ValueError where ``fallback`` is set with ``pipelined=True``: a decision is taken at a step's
    end, after a pipelined step has already shared the next step's indices."""
    if health.fallback is not None and pipelined:
        raise ValueError(f"fallback={health.fallback!r} needs pipelined=False: the checks decide at a "
                         f"step's end, after a pipelined step has shared the next step's indices")


class HealthStep(NamedTuple):
    """What ``compress`` hands ``decompress`` for a check or fallback step (Horovod's ctx)."""

    slot: object  # the parameter's slot (ScaleCom's _Slot)
    step: int  # its step t
    indices: Optional[torch.Tensor]  # the leader's I (None on a fallback step: no exchange)
    kind: str  # CHECK, DENSE or CHECK_DENSE
    compressed: Optional[tuple]  # a check step's CompressedStep (its exchange, p[I] and memory update)
    grad: torch.Tensor  # the gradient g, detached
    original: weakref.ref  # the gradient object Horovod handed over


class HealthSteps:
    """The check and fallback steps of one ScaleCom, and its :class:`HealthMonitor` (``monitor``)."""

    def __init__(self, health, names, warmup_steps):
        self.health = health
        self._names = list(names)
        self._warmup_steps = warmup_steps
        self._warn = True  # until the first step tells this rank's place (warn_on)
        self.monitor = HealthMonitor(health, self._names, warn=True)

    def kind(self, name, t):
        """How tensor ``name``'s compressed step ``t`` runs: CHECK, DENSE, CHECK_DENSE, or None (plain)."""
        check = self.health.is_check_step(t, self._warmup_steps)
        if self.monitor.sends_dense(name):
            return CHECK_DENSE if check else DENSE
        return CHECK if check else None

    def exchanges_no_indices(self, slot, t):
        """Whether ``slot``'s compressed step ``t`` is a fallback step, which exchanges no indices."""
        return self.kind(slot.name, t) == DENSE

    # -- Horovod's compress and decompress, for the steps kind() names ---------------------------------

    def compress(self, compressor, slot, tensor, step, original, kind):
        """``(p, HealthStep)``: ``p = m + g`` densely in the values' dtype (``step``: the compressor's
        ``_Round``); a check step first exchanges ``I`` and takes ``p[I]`` as a compressed step does."""
        t, numel = step.t, tensor.numel()
        values = as_dtype(clt_k.error_compensated(slot.memory, tensor), compressor._value_dtype or
                          wire_dtype(tensor.dtype))
        uncompressed = numel * wire_dtype(tensor.dtype).itemsize
        if kind == DENSE:
            compressor.traffic.record(t, dense_bytes=numel * values.element_size(), uncompressed_bytes=uncompressed,
                                      compress_seconds=time.perf_counter() - step.started)
            return values, HealthStep(slot, t, None, kind, None, tensor, original)
        # (the gradient's buffer must keep g: no buffer traded with the memory)
        _, compressed = compressor._compress_step(slot, tensor, step._replace(may_advance=False), original)
        if not compressed.taken.finite:  # as a compressed step sends: NaN, so that every rank skips the update
            values.fill_(float("nan"))
        compressor.traffic.add(t, value_bytes=(numel - step.k) * values.element_size())  # dense p, not p[I]
        return values, HealthStep(slot, t, compressed.indices, kind, compressed, tensor, original)

    def decompress(self, compressor, reduced, ctx):
        """The step's output from ``reduced`` (``P``), its memory update, then (check steps) the
        measures, recorded for the tensor's next steps."""
        slot, t, indices, kind, compressed, grad, original = ctx
        start = time.perf_counter()
        reduced = reduced.reshape(-1)
        if kind == CHECK:  # the compressed step's own output and memory update, from P[I]
            out = compressor.decompress(reduced.index_select(0, as_dtype(indices, torch.int64)), compressed)
        else:
            if compressed is not None:
                compressor._exchange.finish(compressed.leader_part, slot)
            if clt_k.all_finite(reduced):
                slot.memory.zero_()  # everything owed, p = m + g, was sent
            else:
                compressor.nonfinite_skips += 1
            out = as_dtype(reduced, grad.dtype).view(grad.shape)
            slot.handed_back = handed_back(original, out)
            self.monitor.count_dense_step(slot.name)
        if kind != DENSE:
            self.monitor.record(slot.name, t, measure(reduced, indices, indices.numel()))
        if kind != CHECK:  # (the compressed step's decompress counted its own)
            compressor.traffic.add_time(t, time.perf_counter() - start)
        return out

    # -- the monitor's life --------------------------------------------------------------------------

    def warn_on(self, warn):
        """Whether this rank warns (rank 0 of the process set), told at the first step: the monitor's
        state is kept."""
        if warn != self._warn:
            self._warn = warn
            state = self.monitor.state_dict()
            self.monitor = HealthMonitor(self.health, self._names, warn=warn)
            self.monitor.load_state_dict(state)

    def loaded(self, state):
        """A monitor holding ``state`` (a ``state_dict()["health"]``; None: a fresh one), checked:
        ValueError, with nothing changed, for a bad one. :meth:`adopt` makes it this one's."""
        monitor = HealthMonitor(self.health, self._names, warn=self._warn)
        if state is not None:
            monitor.load_state_dict(state)
        return monitor

    def adopt(self, monitor):
        self.monitor = monitor

    def reset(self):
        """A fresh monitor (elastic resync: every rank forgets its checks, so that all agree again)."""
        self.monitor = self.loaded(None)
