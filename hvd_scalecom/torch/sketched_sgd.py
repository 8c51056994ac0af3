"""Sketched SGD (Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, NeurIPS 2019, Alg. 1) as a
``horovod.torch`` Compressor for the stock ``hvd.DistributedOptimizer``.

The sketched tensors (matrices and higher-order tensors of ``numel >= min_numel``, in
``named_parameters`` order) form one vector, sketched as one ``r x c`` count sketch, as in the paper
and the simulator (:class:`hvd_scalecom.sim.SketchedSGD`). Per step, on every rank:

1. ``compress`` of a sketched tensor returns a one-entry probe (``1``), reduced with the optimizer's op;
   the step's last one takes in every sketched gradient, ``u <- rho u + g``, ``v <- v + u``, and posts
   round 1, ``S = sum_i S(v_i)`` (:mod:`hvd_scalecom.torch.sketched_rounds`).
2. Vectors and small tensors: ``u <- rho u + g``, averaged by Horovod.
3. The step's first ``decompress`` of a sketched tensor takes the ``P k`` candidates of largest
   estimated ``|sum_i v_i|``, fetches their exact sums (round 2), keeps the top k, ``I``, and zeroes
   ``u[I]``, ``v[I]``; each sketched tensor gets its slice of ``scatter(I, sum) / n`` times its probe.

In warm-up, round 1 carries the whole ``u`` instead (dense momentum SGD). The equations are those of
:mod:`hvd_scalecom.torch.sketched_steps`; the guide (docs/other-schemes.md) says what happens with
non-finite gradients, ranks at different steps and collectives called by hand.
"""

import time
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch.compression import Compressor

from hvd_scalecom.agreement import dtype_names, shapes_digest
from hvd_scalecom.sketched_qsparse_config import SketchedSGDConfig
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.collectives import check_agreement, check_process_set, stall_times
from hvd_scalecom.torch.dtypes import dense_on_the_wire, wire_dtype
from hvd_scalecom.torch.loss_scale import check_loss_scaler, follow_loss_scale
from hvd_scalecom.torch.parameters import GradientLookup, handed_back, named_parameter_list, refuse_second_reduction
from hvd_scalecom.torch.sketch import CountSketch
from hvd_scalecom.torch.sketched_rounds import (
    AGREEMENT_HINTS,
    StepRound,
    incomplete_step_message,
    lockstep_message,
    mismatch_message,
    post_round_one,
    round_two,
    wait_round_one,
)
from hvd_scalecom.torch.sketched_state import restored_state, saved_params
from hvd_scalecom.torch.sketched_steps import momentum_, reset_nonfinite_, vector_dtype, warmup_wire_dtype
from hvd_scalecom.traffic import TrafficMeter, allreduce_bytes_sent

NAME = "sketched_sgd"  # the default prefix of the two rounds' collectives: <name>.sketch, <name>.candidates


class _Dense:
    """The context of a tensor reduced densely: its parameter, the gradient handed to ``compress``
    (a weak reference) and the dtype ``decompress`` casts back to (None: the one it travelled in)."""

    __slots__ = ("i", "original", "cast")

    def __init__(self, i, original, cast):
        self.i, self.original, self.cast = i, original, cast


class SketchedSGD(Compressor):
    """Sketched SGD with momentum and error accumulation, for ``hvd.DistributedOptimizer``.

    Args:
        named_parameters: ``model.named_parameters()`` (the parameters the optimizer reduces). Those
            frozen (``requires_grad`` False) when SketchedSGD is built are left out of the sketch, as
            ``hvd.DistributedOptimizer`` built after it never reduces them.
        ratio: ``k = sum over sketched tensors of max(1, ceil(ratio * numel))`` coordinates per step.
        rows, columns: count sketch size ``r x c`` (default ``c = 10 k``).
        candidates: ``P``, round 2 fetches the exact sums of ``P k`` candidates.
        momentum: ``rho`` of ``u <- rho u + g`` (the optimizer itself must have none).
        warmup_steps: steps of dense momentum SGD first.
        min_numel: smaller tensors, and all vectors, are reduced densely (with momentum).
        seed: seed of the sketch's hashes.
        process_set: the Horovod process set the optimizer reduces over (default: all ranks).
        loss_scaler: a ``torch.amp.GradScaler`` (anything with ``get_scale()``) when gradients are
            loss-scaled: the momentum and error accumulation are rescaled whenever the scale changes.
        name: the prefix of the two rounds' allreduces, ``<name>.sketch`` and ``<name>.candidates``
            (the same on every rank). Horovod refuses two collectives of one name in flight at once:
            give each SketchedSGD whose steps overlap (two optimizers stepped after one backward) its own.

    Example::

        compression = SketchedSGD(model.named_parameters(), ratio=0.01, rows=5, momentum=0.9)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)           # no momentum here
        compression.check_optimizer(optimizer)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
    """

    def __init__(self, named_parameters, ratio=0.01, rows=5, columns=None, candidates=2, momentum=0.9,
                 warmup_steps=0, min_numel=1024, *, seed=0, process_set=None, loss_scaler=None, name=NAME):
        if not isinstance(name, str):
            raise TypeError(f"name must be a str (the prefix of SketchedSGD's allreduces), got {type(name).__name__}")
        if not name:
            raise ValueError("name must not be empty (the prefix of SketchedSGD's allreduces)")
        self.name = name
        self.config = SketchedSGDConfig(ratio=ratio, rows=rows, columns=columns, candidates=candidates,
                                        momentum=momentum, warmup_steps=warmup_steps,
                                        min_numel=min_numel, seed=seed)
        pairs = named_parameter_list(named_parameters, "SketchedSGD")
        self._names = [n for n, _ in pairs]
        self._params = [p for _, p in pairs]
        self._lookup = GradientLookup(self._params, self._names, "SketchedSGD")
        self._process_set = check_process_set(process_set)
        self._loss_scaler = check_loss_scaler(loss_scaler)
        self._scale = None  # the loss scale u, v and the dense momenta are expressed in (loss_scaler)
        self._sketched = [i for i, p in enumerate(self._params)
                          if p.requires_grad and self.config.is_sketched(p.shape)]
        self._offset = {}
        numel = 0
        for i in self._sketched:
            self._offset[i] = numel
            numel += self._params[i].numel()
        self.numel = numel  # entries of the sketched vector
        self.k = self.config.num_selected([self._params[i].numel() for i in self._sketched]) if numel else 0
        self.columns = self.config.num_columns(self.k)
        self.num_candidates = self.config.num_candidates(self.k, numel)
        self._sketch = None  # the count sketch (per-row hash seeds only), made at first use
        self._u = None  # momentum of the sketched vector (fp32 at least), allocated at the first step
        self._v = None  # error accumulation of the sketched vector
        self._dense_u = {}  # momentum of every other tensor, by parameter index
        self._steps = [0] * len(self._params)  # optimizer steps each parameter was reduced in
        self._round = None
        self._agreed = False
        self._handed_back = {}  # parameter index -> (its gradient object, data_ptr, version) after decompress
        self.traffic = TrafficMeter()
        self.last_indices = None  # the coordinates of the sketched vector applied at the last step
        self.nonfinite_skips = 0  # steps whose reduced sketch was not finite (round 2 skipped)

    # -- Horovod's Compressor interface -------------------------------------------------------------

    def compress(self, tensor):
        start = time.perf_counter()
        i = self._lookup.index_of(tensor, not_yet=self._not_yet_compressed)  # fails before any collective
        if not self._agreed:
            self._check_agreement()
        refuse_second_reduction(self._handed_back.get(i), tensor, "SketchedSGD", self._names[i],
                                " (its momentum and error accumulation taking in the applied update as a new gradient)")
        original = weakref.ref(tensor)  # (Horovod sets p.grad, this object, to what decompress returns)
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"SketchedSGD compresses floating-point gradients; the gradient of "
                            f"{self._names[i]!r} is {tensor.dtype}")
        t = self._steps[i]
        sketched = i in self._offset  # (in warm-up too: the step's last sketched tensor reduces u whole)
        r = self._round_for(i, t) if sketched else None  # (a tensor out of lockstep: refused, nothing changed)
        # (the scale changes between steps: the step's first compress rescales every tensor's state)
        self._scale = follow_loss_scale([self._u, self._v, *self._dense_u.values()], self._scale,
                                        self._loss_scaler)
        if self._sketch is None and i in self._offset:  # (before any state changes)
            self._sketch = CountSketch(self.numel, self.config.rows, self.columns, seed=self.config.seed,
                                       device=tensor.device)
        self._steps[i] = t + 1
        dense_bytes = tensor.numel() * wire_dtype(tensor.dtype).itemsize  # (what Horovod can reduce: bf16 as fp32)
        if not sketched:
            u = self._dense_momentum(i, tensor)
            momentum_(u, tensor, self.config.momentum)                    # u <- rho u + g
            sent, ctx = dense_on_the_wire(u, tensor.dtype, copy=True)  # fresh: reduced in place
            reset_nonfinite_(u)  # (once sent: a non-finite gradient reaches the optimizer, not u)
            self.traffic.record(t, dense_bytes=dense_bytes, uncompressed_bytes=dense_bytes,
                                compress_seconds=time.perf_counter() - start)
            return sent.view(tensor.shape), _Dense(i, original, ctx)  # (bf16: cast back in decompress)

        self._buffers(tensor)
        r.compressed.add(i)
        r.pending.append((i, tensor))  # (Horovod reduces the probe: the gradient stays as it is until decompress)
        probe = torch.ones(1, dtype=wire_dtype(tensor.dtype), device=tensor.device)
        value_bytes = probe.element_size()
        warm_bytes = tensor.numel() * self._warmup_dtype().itemsize if r.warmup else 0  # (its part of u)
        if len(r.compressed) == len(self._sketched):  # the step's last sketched tensor: round 1
            value_bytes += post_round_one(r, self._u, self._v, self._offset, self._sketch, self.config.momentum,
                                          self._warmup_dtype(), self.name, self._process_set)
        self.traffic.record(t, value_bytes=value_bytes, dense_bytes=warm_bytes, uncompressed_bytes=dense_bytes,
                            compress_seconds=time.perf_counter() - start)
        return probe, (i, t, tensor.shape, tensor.dtype, original)

    def decompress(self, tensor, ctx):
        if isinstance(ctx, _Dense):  # (bf16: reduced as float32)
            out = tensor if ctx.cast is None else tensor.to(ctx.cast)
            self._handed_back[ctx.i] = handed_back(ctx.original, out)
            return out
        start = time.perf_counter()
        i, t, shape, dtype, original = ctx
        r = self._round
        if r is None or r.t != t or i not in r.compressed:
            raise RuntimeError(f"SketchedSGD: decompress of {self._names[i]!r} (step {t}) without its "
                               f"compress in the current step")
        waited = self._second_round(r, i) if r.update is None else 0.0
        begin = self._offset[i]
        part = r.update[begin:begin + shape.numel()]
        scale = float(tensor.reshape(-1)[0])  # the reduced probe: 1 for Average, n for Sum
        # the gradient is this tensor's slice of the step's update (no copy; a new update every step)
        out = (part * scale if scale != 1.0 else part).to(dtype).view(shape)
        self._handed_back[i] = handed_back(original, out)
        r.decompressed += 1
        if r.decompressed == len(r.compressed):
            self._round = None
        self.traffic.add(t, compress_seconds=time.perf_counter() - start - waited, index_wait_seconds=waited)
        return out

    # -- helpers for users ---------------------------------------------------------------------------

    def check_optimizer(self, optimizer):
        """Raise ValueError unless ``optimizer`` is ``torch.optim.SGD`` without momentum: the compressor
        applies momentum itself, a second one would compound it. Warns when Horovod runs one process:
        ``hvd.DistributedOptimizer`` then never calls ``compress``, so training would be plain SGD
        without the compressor's momentum."""
        if not isinstance(optimizer, torch.optim.SGD):
            raise ValueError(f"SketchedSGD applies momentum itself and expects plain torch.optim.SGD as "
                             f"the optimizer, got {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("momentum", 0) != 0 or group.get("nesterov", False):
                raise ValueError(f"SketchedSGD applies momentum itself (momentum="
                                 f"{group.get('momentum')!r} in the optimizer): build the optimizer "
                                 f"with momentum=0")
        if hvd.is_initialized() and self._size() == 1:
            warnings.warn("SketchedSGD with one Horovod process: hvd.DistributedOptimizer never calls "
                          "the compressor, so training is plain SGD without momentum", stacklevel=2)

    # -- state and statistics -----------------------------------------------------------------------

    def stats(self, step=None):
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step; the
        last five are kept), with ScaleCom's keys. ``index_bytes`` is 0 (no index travels);
        ``value_bytes`` counts the sketch ``r c``, the ``P k`` candidates and a probe per sketched tensor;
        ``nonfinite_skips`` the steps whose reduced sketch was not finite; ``total`` all steps.
        """
        explicit = step is not None  # (a default step is never refused)
        if step is None:
            reduced = [s for s in self._steps if s > 0]
            step = min(reduced) - 1 if reduced else 0
        out = self.traffic.step(step, strict=explicit).as_dict()
        n = self._size()
        out["wire_bytes"] = allreduce_bytes_sent(out["sent_bytes"], n)
        out["step"] = step
        out["nonfinite_skips"] = self.nonfinite_skips
        out["total"] = self.traffic.total.as_dict()
        out["total"]["wire_bytes"] = allreduce_bytes_sent(out["total"]["sent_bytes"], n)
        return out

    def state_dict(self):
        """Momentum ``u`` (every tensor), error accumulation ``v`` (sketched tensors) and step counters
        by parameter name, the configuration, and the loss scale they are expressed in (``scale``: None
        without a ``loss_scaler``). Call it between steps."""
        if self._round is not None:
            raise RuntimeError("SketchedSGD.state_dict() in the middle of a step (between the "
                               "gradient hooks and optimizer.step())")
        params = saved_params(self._names, self._params, self._offset, self._steps, self._u, self._v,
                              self._dense_u)
        return {"config": self.config.as_dict(), "params": params, "scale": self._scale}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned; checks everything before changing anything. A
        state saved with a ``loss_scaler`` loads into a SketchedSGD without one divided by its scale,
        one saved without into one with a ``loss_scaler`` as of scale 1 (rescaled at the next step)."""
        self._steps, self._dense_u, self._u, self._v, self._scale = restored_state(
            state, self.config, self._names, self._params, self._sketched, self._sketched_dtype(),
            self._loss_scaler)
        self._round = None
        self._lookup.reset()

    # -- internals ---------------------------------------------------------------------------------

    def _check_agreement(self):
        shapes = [(n, p.shape) for n, p in zip(self._names, self._params)]
        summary = {"scheme": "SketchedSGD", **self.config.as_dict(), "parameters": len(self._names),
                   "parameter_digest": shapes_digest(shapes), "steps": sorted(set(self._steps)),
                   "sketched_digest": shapes_digest([shapes[i] for i in self._sketched]),
                   "parameter_dtypes": dtype_names(p.dtype for p in self._params),
                   "loss_scaler": self._loss_scaler is not None, "name": self.name}
        check_agreement("SketchedSGD", summary, self._process_set, AGREEMENT_HINTS, stall=stall_times())
        self._agreed = True

    def _size(self):
        if self._process_set is not None:
            return self._process_set.size()
        return hvd.size() if hvd.is_initialized() else 1

    def _not_yet_compressed(self, i):
        r = self._round
        return r is None or i not in r.compressed

    def _dense_momentum(self, i, tensor):
        """The flat momentum of parameter ``i``, one that is not sketched."""
        if i not in self._dense_u:
            self._dense_u[i] = torch.zeros(tensor.numel(), dtype=clt_k.memory_dtype(tensor.dtype),
                                           device=tensor.device)
        return self._dense_u[i]

    def _sketched_dtype(self):
        return vector_dtype([self._params[i].dtype for i in self._sketched])

    def _warmup_dtype(self):
        return warmup_wire_dtype([self._params[i].dtype for i in self._sketched])

    def _buffers(self, tensor):
        if self._u is None:
            self._u = torch.zeros(self.numel, dtype=self._sketched_dtype(), device=tensor.device)
            self._v = torch.zeros_like(self._u)

    def _round_for(self, i, t):
        r = self._round
        if r is not None and r.t != t:
            steps = {self._names[j]: self._steps[j] for j in self._sketched}
            raise RuntimeError(lockstep_message(self._names[i], t, r, steps))
        if r is None:
            r = self._round = StepRound(t, t < self.config.warmup_steps)
        return r

    def _second_round(self, r, i):
        """Round 1's result, round 2 and the step's update (:mod:`hvd_scalecom.torch.sketched_rounds`);
        returns the seconds spent waiting for the two allreduces. ``i``: the tensor decompressed."""
        if r.handle is None:  # u and v have not taken in this step's gradients: the step never happened
            missing = [self._names[j] for j in self._sketched if j not in r.compressed]
            for j in r.compressed:
                self._steps[j] = r.t
            self._round = None
            raise RuntimeError(incomplete_step_message(self._names[i], missing))
        try:
            waited = wait_round_one(r)
        except HorovodInternalError as err:
            self._round = None
            if "Mismatched" not in str(err):
                raise
            raise RuntimeError(mismatch_message(r, self._names[i], self.config.warmup_steps, self.name,
                                                err)) from err
        two = round_two(r, self._sketch, self._u, self._v, self.k, self.num_candidates, self._size(), self.name,
                        self._process_set)
        if two.candidate_bytes:
            self.traffic.add(r.t, value_bytes=two.candidate_bytes)
        self.nonfinite_skips += two.nonfinite
        self.last_indices = two.indices
        return waited + two.waited
