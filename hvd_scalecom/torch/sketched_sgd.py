"""Sketched SGD (Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, NeurIPS 2019, Alg. 1) as a
``horovod.torch`` Compressor for the stock ``hvd.DistributedOptimizer``.

Like the paper and the simulator (:class:`hvd_scalecom.sim.SketchedSGD`), the sketched tensors (all
matrices and higher-order tensors with ``numel >= min_numel``, in ``named_parameters`` order) form one
vector, sketched as one ``r x c`` count sketch; the equations are those of
:mod:`hvd_scalecom.torch.sketched_steps`. Per step, on every rank:

1. ``compress(g)`` of a sketched tensor returns a one-entry *scale probe* (``1``) that Horovod reduces
   with the optimizer's own op, pre- and postscale factors. The compress that completes the step's
   set of sketched tensors takes in every one's gradient, ``u <- rho u + g``, ``v <- v + u`` on its
   slice (not before: a step whose set never completes, e.g. ``hvd.allreduce`` called on one gradient
   at a time, leaves u and v as they were), sketches ``v`` and posts round 1 itself:
   ``allreduce.sketched_sgd.sketch``, a Sum of the ``r x c`` tables.
2. Vectors and small tensors: ``u <- rho u + g``; ``compress`` returns ``u``, averaged by Horovod.
3. ``decompress`` of the step's first sketched tensor waits for round 1, takes the ``P k`` candidates
   of largest estimated ``|sum v|`` (identical on every rank, so no index travels), posts and waits for
   round 2, ``allreduce.sketched_sgd.candidates`` (the exact ``sum_i v_i`` there), keeps the top k,
   ``I``, and zeroes ``u[I]`` and ``v[I]``. Every sketched tensor's ``decompress`` returns its slice of
   ``scatter(I, sum) / n`` times its reduced probe (1 under ``op=hvd.Average``, n under ``hvd.Sum``,
   so the sketched tensors follow the optimizer's op like the dense ones). A non-finite reduced
   sketch (a NaN or Inf in some rank's gradient) skips round 2 on every rank: the step's update is
   NaN, and the non-finite entries of u and v are reset to 0 (``stats()["nonfinite_skips"]``); so
   are those of a dense tensor's u once it is sent.

In a warm-up step the sketched tensors are reduced densely, ``mean_i u_i`` with ``u <- rho u + g``,
in the same frame: their ``compress`` returns the probe, and the step's last one posts the whole of
``u`` as ``allreduce.sketched_sgd.sketch`` (a Sum; ``decompress`` divides by n and applies the
probe). So the optimizer's own allreduces carry the same shapes on both sides of the end of warm-up,
and ranks whose step counters lie on either side of it (a ``load_state_dict()`` of another step on
one rank) meet in that one collective with different shapes (a flat vector against the ``r x c``
table): Horovod fails it on every rank, and every rank's ``decompress`` raises an error that names
the cause, where the optimizer's allreduce of a probe against a dense gradient failed with Horovod's
bare "Mismatched ALLREDUCE tensor shapes". No collective is added, in warm-up or after.

Why no hook order can deadlock: nothing in ``compress`` waits (round 1 is posted, not waited for; the
configuration check at the very first ``compress`` is the one exception, and every rank reaches its
first ``compress`` without waiting on anything). Horovod calls every ``compress`` of a step, from hooks
or from ``synchronize()`` for parameters without a gradient, before the first ``decompress``; so when
any rank waits for round 1 or round 2, every rank has posted or will post both without waiting on
anything else first. Each round is one collective with a fixed name per step (``<name>.sketch`` and
``<name>.candidates``, ``name="sketched_sgd"`` by default), so ranks cannot pair them differently,
whatever order Horovod decompresses tensors in.

A gradient that ``decompress`` gave back, reduced again unchanged (``optimizer.step()`` after
``optimizer.synchronize()`` outside ``optimizer.skip_synchronize()``), is refused in ``compress``
before anything changes: Alg. 1 takes in each step's gradient once.

Momentum lives here, so the user's optimizer must be plain SGD (no momentum): the learning rate
scales the applied update (the paper's ``v <- v + lr u`` with a constant learning rate).
:meth:`SketchedSGD.check_optimizer` raises if it is not.
"""

import time
import warnings
import weakref

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HorovodInternalError
from horovod.torch.compression import Compressor

from hvd_scalecom.agreement import DTYPES_HINT, dtype_names, shapes_digest
from hvd_scalecom.sketched_qsparse_config import SketchedSGDConfig
from hvd_scalecom.state_checks import check_loss_scale, checked_params
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.collectives import check_agreement, check_process_set, stall_times
from hvd_scalecom.torch.dtypes import dense_on_the_wire, wire_dtype
from hvd_scalecom.torch.loss_scale import check_loss_scaler, follow_loss_scale, restored_loss_scale
from hvd_scalecom.torch.parameters import GradientLookup, handed_back, named_parameter_list, refuse_second_reduction
from hvd_scalecom.torch.saved_state import as_memory_of, check_state_entry
from hvd_scalecom.torch.sketch import CountSketch
from hvd_scalecom.torch.sketched_steps import (
    accumulate_,
    applied_update,
    heavy_candidates,
    momentum_,
    reset_nonfinite_,
    select_applied,
    skip_nonfinite_,
    vector_dtype,
    warmup_wire_dtype,
    zero_applied_,
)
from hvd_scalecom.traffic import TrafficMeter, allreduce_bytes_sent

NAME = "sketched_sgd"  # the default prefix of the two rounds' collectives: <name>.sketch, <name>.candidates


class _Round:
    """The sketched part of one step on this rank: which tensors were compressed (and, until the
    step's last one is, their gradients: u and v take them in all at once, so that a step that never
    completes leaves them as they were), the round-1 table in flight, and (after round 2) the update."""

    __slots__ = ("t", "warmup", "compressed", "pending", "decompressed", "table", "handle", "update")

    def __init__(self, t, warmup):
        self.t = t
        self.warmup = warmup  # a warm-up step: the table is the whole momentum u, reduced densely
        self.compressed = set()
        self.pending = []
        self.decompressed = 0
        self.table = None
        self.handle = None
        self.update = None


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
        if len(r.compressed) == len(self._sketched) and r.warmup:  # the step's last: u reduced whole
            for j, grad in r.pending:
                part = self._u[self._offset[j]:self._offset[j] + grad.numel()]
                momentum_(part, grad, self.config.momentum)                  # u <- rho u + g
            r.pending = None
            r.table = self._u.to(self._warmup_dtype(), copy=True)  # (fresh: reduced in place)
            reset_nonfinite_(self._u)  # (once sent: a non-finite gradient reaches the optimizer, not u)
            r.handle = self._post_round_one(r.table)
        elif len(r.compressed) == len(self._sketched):  # the step's last sketched tensor: round 1
            for j, grad in r.pending:  # u, v on each slice
                part = slice(self._offset[j], self._offset[j] + grad.numel())
                accumulate_(self._u[part], self._v[part], grad, self.config.momentum)
            r.pending = None
            r.table = self._sketch.sketch(self._v)
            r.handle = self._post_round_one(r.table)
            value_bytes += r.table.numel() * self._v.element_size()  # (round 2's candidates: once sent)
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
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step).
        The last five steps are kept; an earlier one asked for is a ValueError (``total`` counts every
        step; the default step never is one).

        Keys as ScaleCom's: ``step``, ``index_bytes`` (always 0: candidates are found from the reduced
        sketch on every rank, no index travels), ``value_bytes`` (sketch ``r c`` + candidates
        ``P k`` entries of the sketched vector's dtype, fp32 or wider, + a probe per sketched tensor, in
        the probe's dtype; in warm-up the probes alone), ``dense_bytes`` (the momentum of
        the other tensors, and of all during warm-up), ``sent_bytes``, ``uncompressed_bytes``,
        ``ratio``, ``compress_seconds``, ``index_wait_seconds`` (the waits for round 1's and round 2's
        allreduces, which ``compress_seconds`` leaves out), ``tensors``; ``wire_bytes``, what
        this rank sends in the ring allreduces (``2 (n - 1) / n * sent_bytes``); ``nonfinite_skips``,
        the steps whose reduced sketch was not finite (all steps; they send no candidates); ``total``:
        all steps.
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
        params = {}
        for i, name in enumerate(self._names):
            entry = {"step": self._steps[i], "shape": list(self._params[i].shape), "momentum": None}
            if i in self._offset:
                entry["error"] = None
                if self._u is not None:
                    part = slice(self._offset[i], self._offset[i] + self._params[i].numel())
                    entry["momentum"] = self._u[part].clone()
                    entry["error"] = self._v[part].clone()
            elif i in self._dense_u:
                entry["momentum"] = self._dense_u[i].clone()
            params[name] = entry
        return {"config": self.config.as_dict(), "params": params, "scale": self._scale}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned; checks everything before changing anything. A
        state saved with a ``loss_scaler`` loads into a SketchedSGD without one divided by its scale,
        one saved without into one with a ``loss_scaler`` as of scale 1 (rescaled at the next step)."""
        params = checked_params(state, "SketchedSGD", self.config.as_dict(), self._names)
        scale = check_loss_scale(state.get("scale"), "state scale")
        for i, name in enumerate(self._names):
            check_state_entry(name, params[name], self._params[i].shape,
                              ("momentum", "error") if i in self._offset else ("momentum",), step=False,
                              dtype=self._sketched_dtype() if i in self._offset else clt_k.memory_dtype(
                                  self._params[i].dtype))
        sketched_state = [params[self._names[i]].get("momentum") is not None for i in self._sketched]
        if any(sketched_state) and not all(sketched_state):
            raise ValueError("state holds the momentum of some sketched tensors but not of others")
        for i, name in enumerate(self._names):
            entry = params[name]
            if i in self._offset and (entry.get("momentum") is None) != (entry.get("error") is None):
                raise ValueError(f"state of {name!r} has momentum or error but not both")
        sketched_steps = {self._names[i]: int(params[self._names[i]]["step"]) for i in self._sketched}
        if len(set(sketched_steps.values())) > 1:  # (they move in lockstep: one sketch a step)
            raise ValueError(f"state steps of the sketched tensors differ, {sketched_steps}: they are reduced "
                             f"together every step, so a state saves one step for all of them (were "
                             f"entries taken from states of different steps?)")
        self._steps = [int(params[name]["step"]) for name in self._names]
        # every tensor as the first step makes it: fp32 at least, on the parameter's device
        self._dense_u = {i: as_memory_of(params[n]["momentum"], self._params[i]) for i, n in enumerate(self._names)
                         if i not in self._offset and params[n].get("momentum") is not None}
        if self._sketched and all(sketched_state):
            device = self._params[self._sketched[0]].device
            sketched = [params[self._names[i]] for i in self._sketched]
            dtype = self._sketched_dtype()
            self._u = torch.cat([e["momentum"].reshape(-1).to(dtype) for e in sketched]).to(device)
            self._v = torch.cat([e["error"].reshape(-1).to(dtype) for e in sketched]).to(device)
        else:
            self._u = self._v = None
        self._scale = restored_loss_scale([self._u, self._v, *self._dense_u.values()], scale, self._loss_scaler)
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
        check_agreement("SketchedSGD", summary, self._process_set,
                        {"parameter_digest": "(parameter_digest covers the names and shapes of "
                                             "named_parameters.)",
                         "parameter_dtypes": DTYPES_HINT,
                         "loss_scaler": "(a loss_scaler given on some ranks only: the others' momentum and "
                                        "error accumulation would not follow the loss scale.)",
                         "name": "(name prefixes SketchedSGD's allreduces: give it the same value on every rank.)",
                         "sketched_digest": "(sketched_digest covers which parameters are sketched: "
                                            "freeze the same parameters on every rank before building "
                                            "SketchedSGD.)",
                         "steps": "(steps lists the parameters' distinct step counters, which decide "
                                  "warm-up and which tensors a step sketches: restore every rank from a "
                                  "state of the same step.)"}, stall=stall_times())
        self._agreed = True

    def _post_round_one(self, table):
        """Posts round 1 (in warm-up, u whole) as ``<name>.sketch``, a Sum; a collective of that name
        still in flight (another SketchedSGD of the same ``name`` in the same step) is a ValueError
        naming ``name``."""
        try:
            return hvd.allreduce_async_(table, name=f"{self.name}.sketch", op=hvd.Sum, **self._ps_kwargs())
        except ValueError as err:
            if "same name" not in str(err):
                raise
            raise ValueError(f"SketchedSGD(name={self.name!r}): Horovod has another '{self.name}.sketch' "
                             f"allreduce in flight, from another SketchedSGD of the same name whose step "
                             f"overlaps this one (two optimizers stepped after one backward): give each "
                             f"SketchedSGD its own name=. Horovod: {err}") from err

    def _ps_kwargs(self):
        return {} if self._process_set is None else {"process_set": self._process_set}

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
            raise RuntimeError(
                f"SketchedSGD: the sketched tensors are not reduced in lockstep ({self._names[i]!r} is at "
                f"step {t}, the step in progress is {r.t}; steps reduced so far: {steps}). Every "
                f"parameter that SketchedSGD sketches must be reduced by the optimizer every step (not "
                f"frozen after SketchedSGD was built but before the optimizer, no sparse gradients "
                f"without sparse_as_dense=True).")
        if r is None:
            r = self._round = _Round(t, t < self.config.warmup_steps)
        return r

    def _mismatch_message(self, r, i, err):
        """The error of a step whose ``sketched_sgd.sketch`` allreduce Horovod failed for mismatched
        shapes or dtypes: the ranks' step counters lie on either side of the end of warm-up."""
        warmup = self.config.warmup_steps
        mine, theirs = (("in warm-up: it sent the whole momentum u, reduced densely", "past warm-up: its "
                         "r x c sketch") if r.warmup else
                        ("past warm-up: it sent its r x c sketch", "in warm-up: the whole momentum u"))
        return (f"SketchedSGD: the ranks' step counters differ on either side of the end of warm-up "
                f"(warmup_steps={warmup}), so they reduced {self._names[i]!r} and the other sketched tensors "
                f"in different ways: this rank is at step {r.t}, {mine}, as '{self.name}.sketch', and another "
                f"rank is {theirs}. A load_state_dict() of another step on some ranks does this: restore every "
                f"rank from a state_dict() of the same step (this step's gradients are in this rank's momentum "
                f"and error accumulation, and its step counters have moved on). Horovod: {err}")

    def _second_round(self, r, i):
        """Round 1's result, the candidates, round 2, and the step's update; zeroes u and v at I (a
        non-finite reduced sketch skips round 2 on every rank: :func:`sketched_steps.skip_nonfinite_`).
        In warm-up, ``sum_i u_i / n`` alone. A round 1 that Horovod failed for mismatched shapes or
        dtypes (ranks on either side of the end of warm-up) raises :meth:`_mismatch_message`'s error.
        Returns the seconds spent waiting for the two allreduces. ``i``: the tensor decompressed."""
        if r.handle is None:  # u and v have not taken in this step's gradients: the step never happened
            missing = [self._names[j] for j in self._sketched if j not in r.compressed]
            for j in r.compressed:
                self._steps[j] = r.t
            self._round = None
            raise RuntimeError(
                f"SketchedSGD: {self._names[i]!r} was decompressed before the sketched tensors {missing} "
                f"were compressed in this step, so the step's sketch is incomplete (the sketched tensors' "
                f"momentum, error accumulation and step counters are left as they were before it). Every "
                f"sketched tensor's update needs all of them: hvd.allreduce(p.grad, compression=SketchedSGD) "
                f"of one gradient at a time cannot work (reduce them all in one hvd.grouped_allreduce, or "
                f"through hvd.DistributedOptimizer). Under hvd.DistributedOptimizer, pass only the "
                f"parameters the optimizer reduces every step (parameters frozen after SketchedSGD was "
                f"built but before the optimizer, or sparse gradients without sparse_as_dense=True, are "
                f"not: freeze parameters before building both).")
        wait_from = time.perf_counter()
        try:
            hvd.synchronize(r.handle)                                  # S = sum_i S(v_i) (warm-up: sum_i u_i)
        except HorovodInternalError as err:
            self._round = None
            if "Mismatched" not in str(err):
                raise
            raise RuntimeError(self._mismatch_message(r, i, err)) from err
        waited = time.perf_counter() - wait_from
        if r.warmup:  # dense momentum SGD: mean_i u_i
            r.update = r.table.to(self._v.dtype) / self._size()
            r.table = r.handle = None
            self.last_indices = None
            return waited
        if not clt_k.all_finite(r.table):  # the same table on every rank: all skip round 2
            r.update = skip_nonfinite_(self._u, self._v, self.numel, dtype=self._v.dtype)
            r.table = r.handle = None
            self.nonfinite_skips += 1
            self.last_indices = torch.zeros(0, dtype=torch.int64, device=self._v.device)
            return waited
        candidates = heavy_candidates(self._sketch, r.table, self.num_candidates)
        kept = self._v[candidates]
        wait_from = time.perf_counter()
        # sum_i v_i[candidates]
        exact = hvd.allreduce(kept, name=f"{self.name}.candidates", op=hvd.Sum, **self._ps_kwargs())
        waited += time.perf_counter() - wait_from
        self.traffic.add(r.t, value_bytes=exact.numel() * exact.element_size())
        indices, sums = select_applied(candidates, exact, self.k)
        r.update = applied_update(indices, sums, self.numel, self._size(), dtype=self._v.dtype)
        zero_applied_(self._u, self._v, indices)
        r.table = r.handle = None
        self.last_indices = indices
        return waited
