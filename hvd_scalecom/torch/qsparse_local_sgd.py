"""Qsparse-local-SGD (Basu, Data, Karakus, Diggavi, NeurIPS 2019, Alg. 1, synchronous) on Horovod: a
wrapper around any ``torch.optim`` optimizer, used *without* ``hvd.DistributedOptimizer``.

Every ``step()`` runs the wrapped optimizer locally (``x_i`` drifts from the shared model); every H-th
(``local_steps``) then synchronises each tensor with the equations of
:mod:`hvd_scalecom.torch.qsparse_steps` (those of the simulator, :class:`hvd_scalecom.sim.QsparseLocalSGD`):

1. ``delta_i = m_i + (x_i - x_last)``; ``c_i = Q(Top_k(delta_i))``; ``m_i <- delta_i - c_i``
2. every rank's ``(I_i, c_i)``, in their wire form, travel in one ``allgather`` of bytes
   (``qsparse_local_sgd.payload``), all tensors packed together
3. ``x_new = x_last + mean_i c_i`` (summed in rank order, so identical on every rank)

Tensors below ``min_numel`` are averaged densely (one grouped allreduce, ``qsparse_local_sgd.dense``).
The wrapped optimizer's state (momentum, Adam moments) stays local, as in the paper.

Every collective is issued from ``step()``, in a fixed order under fixed names; each payload starts with
a 16-byte header, the rank's step and a checksum of its ``x_last``, which every rank compares after the
allgather. The guide (docs/other-schemes.md) gives the bytes on the wire and the caveats.
"""

import time
from collections import OrderedDict

import horovod.torch as hvd
import torch

from hvd_scalecom.agreement import DTYPES_HINT, dtype_names, shapes_digest
from hvd_scalecom.config import check_int
from hvd_scalecom.sketched_qsparse_config import QsparseConfig
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.collectives import check_agreement, check_process_set, stall_times, tensors_digest
from hvd_scalecom.torch.dtypes import wire_dtype
from hvd_scalecom.torch.parameters import named_parameter_list
from hvd_scalecom.torch.qsparse_steps import (
    check_generator_state,
    compress_delta,
    decode,
    mean_of_sparse,
    memory_kept,
    payload_dtypes,
)
from hvd_scalecom.torch.saved_state import as_memory_of, check_state_entry
from hvd_scalecom.traffic import TrafficMeter, allgather_bytes_sent, allreduce_bytes_sent

PAYLOAD_NAME = "qsparse_local_sgd.payload"
DENSE_NAME = "qsparse_local_sgd.dense"
_STATE_KEY = "qsparse_local_sgd"
# torch's hook registries (register_step_*_hook, register_state_dict_*_hook,
# register_load_state_dict_*_hook), which torch.optim.Optimizer.__init__ would make
_HOOKS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
          "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
          "_optimizer_load_state_dict_post_hooks")


class QsparseLocalSGD(torch.optim.Optimizer):
    """Local SGD with Top-k + quantization of the model deltas and error compensation.

    Args:
        optimizer: the local optimizer (any ``torch.optim.Optimizer``, not ``hvd.DistributedOptimizer``).
        named_parameters: ``model.named_parameters()``; every parameter of ``optimizer`` must be in it
            (named parameters the optimizer does not update are not synchronised).
        local_steps: H, steps between synchronisations (the authors' code: 8).
        ratio, max_k: ``k = min(max(1, ceil(ratio * numel)), max_k)`` per tensor.
        operator: ``"top_k"``, ``"sign_top_k"`` or ``"qsgd_top_k"``; levels: QSGD's s.
        min_numel: tensors with fewer entries are averaged densely (default 0: none).
        seed: QSGD's rounding stream (each rank uses its own row of a shared draw).
        index_dtype: ``"int32"`` or ``"int64"`` (or the torch dtypes) for the indices on the wire.
        process_set: the Horovod process set to synchronise over (default: all ranks).

    Example::

        hvd.init()
        model = Net()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = QsparseLocalSGD(local, model.named_parameters(), local_steps=8, ratio=1.0,
                                    max_k=1000, operator="sign_top_k")
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()            # every 8th step synchronises the model

    With ``torch.amp.GradScaler``, ``scaler.step(optimizer)`` calls ``step()`` at every iteration;
    broadcast the local optimizer's state before wrapping it (docs/other-schemes.md says why).
    """

    # torch.amp.GradScaler.step then calls step() at every iteration, with found_inf and grad_scale set
    _step_supports_amp_scaling = True

    def __init_subclass__(cls, **kwargs):
        """TypeError for the subclass ``hvd.DistributedOptimizer`` makes of its optimizer's class (one
        with Horovod's ``synchronize`` and ``skip_synchronize``): this wrapper synchronises by itself."""
        if "synchronize" in cls.__dict__ and "skip_synchronize" in cls.__dict__:
            raise TypeError("hvd.DistributedOptimizer cannot wrap a QsparseLocalSGD, which synchronises the "
                            "model itself every local_steps steps: step the QsparseLocalSGD directly")
        super().__init_subclass__(**kwargs)

    def __init__(self, optimizer, named_parameters, local_steps=8, ratio=0.01, *, max_k=None,
                 operator="sign_top_k", levels=256, min_numel=0, seed=0, index_dtype="int32",
                 process_set=None):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, QsparseLocalSGD):
            raise ValueError("optimizer is already a QsparseLocalSGD")
        if hasattr(type(optimizer), "synchronize") and hasattr(type(optimizer), "skip_synchronize"):
            raise ValueError("optimizer must be a plain torch optimizer, not hvd.DistributedOptimizer: "
                             "QsparseLocalSGD synchronises the model itself, every local_steps steps")
        self.config = QsparseConfig(local_steps=local_steps, ratio=ratio, max_k=max_k, operator=operator,
                                    levels=levels, min_numel=min_numel, seed=seed, index_dtype=index_dtype)
        pairs = named_parameter_list(named_parameters, "QsparseLocalSGD")
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        unnamed = optimized - {id(p) for _, p in pairs}
        if unnamed:
            raise ValueError(f"optimizer updates {len(unnamed)} parameter(s) that are not in "
                             f"named_parameters: they would train without ever being synchronised")
        pairs = [(n, p) for n, p in pairs if id(p) in optimized]
        self.optimizer = optimizer
        self._names = [n for n, _ in pairs]
        self._params = [p for _, p in pairs]
        self._process_set = check_process_set(process_set)
        self._step = 0  # optimizer steps taken
        self._shared = None  # x_last per parameter (flat, fp32 at least), taken at the first step
        self._memory = [None] * len(self._params)  # m_i per compressed parameter, (1, numel)
        self._generator = torch.Generator().manual_seed(self.config.seed)
        self._agreed = False
        self._last_sync = None
        self.nonfinite_skips = 0  # compressed tensor-synchronisations whose memory update a non-finite mean skipped
        self.traffic = TrafficMeter(keep=4 * self.config.local_steps)  # the last five synchronisations
        self._reset_hooks()

    # -- torch.optim.Optimizer interface -----------------------------------------------------------

    @property
    def param_groups(self):  # (the wrapped optimizer's, also once its load_state_dict replaced them)
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __repr__(self):
        return f"QsparseLocalSGD({self.config}, {self.optimizer!r})"

    def __getstate__(self):  # (copy.deepcopy, pickle: the whole wrapper; hooks dropped, as torch does)
        return {k: v for k, v in self.__dict__.items() if k not in _HOOKS}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._reset_hooks()

    def _reset_hooks(self):
        for name in _HOOKS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        raise ValueError("QsparseLocalSGD synchronises the parameters it was built with; add parameter "
                         "groups to the local optimizer before wrapping it")

    def step(self, closure=None):
        """One local step of the wrapped optimizer; every ``local_steps``-th also synchronises. Ranks
        that synchronise from different steps or models all raise a ValueError, this wrapper's state left
        as it was (the local step has been taken). Called by ``torch.amp.GradScaler.step``
        (``found_inf``, ``grad_scale``), a non-finite iteration takes no local step but counts."""
        try:
            return self._step_once(closure, getattr(self, "found_inf", None), getattr(self, "grad_scale", None))
        except BaseException:
            self.__dict__.pop("found_inf", None)  # (GradScaler removes them only after a step that returns)
            self.__dict__.pop("grad_scale", None)
            raise

    def _step_once(self, closure, found_inf, grad_scale):
        shared = self._shared
        if shared is None:  # x_last, kept once the ranks agree on it
            shared = [p.detach().reshape(-1).to(clt_k.memory_dtype(p.dtype), copy=True) for p in self._params]
        if not self._agreed:
            self._check_agreement(shared)
        self._shared = shared
        loss = None
        if found_inf is None or not bool(found_inf):
            if grad_scale is not None:
                self._unscale_grads(grad_scale)
            loss = self.optimizer.step() if closure is None else self.optimizer.step(closure)
        t = self._step
        if self.config.is_sync_step(t):
            self._synchronize(t)  # (raises, this wrapper's state unchanged, where the ranks' states differ)
        self._step = t + 1
        return loss

    def _unscale_grads(self, grad_scale):
        """Every gradient of the local optimizer times the float32 reciprocal of ``grad_scale``, as
        ``torch.amp.GradScaler.unscale_`` computes it (exact for its power-of-two scales)."""
        inverse = grad_scale.double().reciprocal().float()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(inverse.to(p.grad.device))

    # -- state and statistics -----------------------------------------------------------------------

    def shared_parameters(self):
        """``{name: x_last}``: the model of the last synchronisation, in each parameter's shape."""
        if self._shared is None:
            return {n: p.detach().clone() for n, p in zip(self._names, self._params)}
        return {n: s.view(p.shape).clone() for n, s, p in zip(self._names, self._shared, self._params)}

    def stats(self, step=None):
        """Payload bytes and compute time of synchronisation step ``step`` on this rank (default: the
        last synchronisation; other steps report zeros; the last five synchronisations are kept), with
        ScaleCom's keys: ``index_bytes`` and ``value_bytes`` (this rank's part of the payload allgather),
        ``dense_bytes`` (the small tensors' allreduce, in the memory's dtype: fp32, fp64 for fp64 parameters),
        ``uncompressed_bytes`` (what dense synchronous
        SGD would have sent in the ``local_steps`` steps since the previous synchronisation),
        ``wire_bytes`` (``(n - 1) (index + value) + 2 (n - 1) / n dense``), ``nonfinite_skips`` and
        ``total`` (all steps).
        """
        explicit = step is not None  # (a default step is never refused)
        if step is None:
            step = self._last_sync if self._last_sync is not None else 0
        out = self.traffic.step(step, strict=explicit).as_dict()
        n = self._size()
        out["wire_bytes"] = self._wire(out, n)
        out["step"] = step
        out["nonfinite_skips"] = self.nonfinite_skips
        out["total"] = self.traffic.total.as_dict()
        out["total"]["wire_bytes"] = self._wire(out["total"], n)
        return out

    def state_dict(self):
        """The wrapped optimizer's state dict, with this wrapper's state (step counter, ``x_last``,
        error memories, QSGD's generator, configuration) under ``"qsparse_local_sgd"``; hooks registered
        with ``register_state_dict_pre_hook``/``_post_hook`` run around it, as in torch."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = self.optimizer.state_dict()
        params = {}
        for i, name in enumerate(self._names):
            memory = self._memory[i]
            params[name] = {"shape": list(self._params[i].shape),
                            "shared": None if self._shared is None else self._shared[i].clone(),
                            "memory": None if memory is None else memory.reshape(-1).clone()}
        state[_STATE_KEY] = {"config": self.config.as_dict(), "step": self._step, "params": params,
                             "generator": self._generator.get_state(), "last_sync": self._last_sync}
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            if result is not None:
                state = result
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`'s output (wrapper and wrapped optimizer); checks the wrapper's part
        before changing anything. Ranks compare their steps and models at the next synchronisation.
        Hooks registered with ``register_load_state_dict_pre_hook``/``_post_hook`` run before (on a
        shallow copy; one may return the dict to load) and after, as in torch."""
        if isinstance(state_dict, dict):
            state_dict = dict(state_dict)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        if not isinstance(state_dict, dict) or _STATE_KEY not in state_dict:
            raise ValueError("state_dict must be a dict returned by QsparseLocalSGD.state_dict()")
        mine = state_dict[_STATE_KEY]
        if not isinstance(mine, dict):
            raise TypeError(f"state_dict[{_STATE_KEY!r}] must be a dict (QsparseLocalSGD.state_dict()'s), "
                            f"got {type(mine).__name__}")
        if mine.get("config") != self.config.as_dict():
            raise ValueError(f"state was saved with config {mine.get('config')}, this QsparseLocalSGD has "
                             f"{self.config.as_dict()}")
        step = check_int(mine.get("step"), "state step", 0)
        if step >= 2 ** 63:
            raise ValueError(f"state step must be below 2**63 (the payload's int64 header), got {step}")
        last_sync = check_int(mine.get("last_sync"), "state last_sync", 0, allow_none=True)
        if last_sync is not None and not (last_sync < step and self.config.is_sync_step(last_sync)):
            raise ValueError(f"state last_sync must be None or a synchronisation step before step {step} "
                             f"(local_steps {self.config.local_steps}), got {last_sync}")
        check_generator_state(mine.get("generator"), "state generator")
        params = mine.get("params")
        if not isinstance(params, dict):
            raise TypeError(f"state params must be a dict, got {type(params).__name__}")
        if set(params) != set(self._names):
            missing = sorted(set(self._names) - set(params))
            extra = sorted(set(params) - set(self._names))
            raise ValueError(f"state does not match the parameters: missing {missing}, unexpected {extra}")
        for name, p in zip(self._names, self._params):
            check_state_entry(name, params[name], p.shape, ("shared", "memory"), step=False,
                              dtype=clt_k.memory_dtype(p.dtype))
        have_shared = {params[n].get("shared") is not None for n in self._names}
        if len(have_shared) > 1:
            raise ValueError("state holds x_last of some parameters but not of others")
        inner = {k: v for k, v in state_dict.items() if k != _STATE_KEY}
        self.optimizer.load_state_dict(inner)
        self._step = step
        self._last_sync = last_sync
        # x_last and the memories as the first step makes them: fp32 at least, on the parameter's device
        if have_shared == {True}:
            self._shared = [as_memory_of(params[n]["shared"], p) for n, p in zip(self._names, self._params)]
        else:
            self._shared = None
        self._memory = [None if params[n].get("memory") is None else as_memory_of(params[n]["memory"], p).reshape(1, -1)
                        for n, p in zip(self._names, self._params)]
        self._generator.set_state(mine["generator"])
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # -- internals ---------------------------------------------------------------------------------

    def _check_agreement(self, shared):
        shapes = [(n, p.shape) for n, p in zip(self._names, self._params)]
        summary = {"scheme": "QsparseLocalSGD", **self.config.as_dict(), "step": self._step,
                   "parameters": len(self._names), "parameter_digest": shapes_digest(shapes),
                   "parameter_dtypes": dtype_names(p.dtype for p in self._params),
                   "shared_digest": tensors_digest(shared)}
        check_agreement("QsparseLocalSGD", summary, self._process_set, {
            "parameter_digest": "(parameter_digest covers the names and shapes of named_parameters.)",
            "parameter_dtypes": DTYPES_HINT,
            "shared_digest": "The model differs across ranks at the start of local SGD (shared_digest "
                             "covers the values of the parameters): broadcast it first, "
                             "hvd.broadcast_parameters(model.state_dict(), root_rank=0), or restore "
                             "the same checkpoint on every rank.",
            "step": "Ranks resumed from checkpoints of different steps."}, stall=stall_times())
        self._agreed = True

    def _size_rank(self):
        if self._process_set is not None:
            return self._process_set.size(), self._process_set.rank()
        return hvd.size(), hvd.rank()

    def _size(self):
        if self._process_set is not None:
            return self._process_set.size()
        return hvd.size() if hvd.is_initialized() else 1

    def _ps_kwargs(self):
        return {} if self._process_set is None else {"process_set": self._process_set}

    @staticmethod
    def _wire(counts, n):
        return (allgather_bytes_sent(counts["index_bytes"] + counts["value_bytes"], n)
                + allreduce_bytes_sent(counts["dense_bytes"], n))

    def _synchronize(self, t):
        """Steps 1-3 for every tensor; every rank ends at the same ``x_new``."""
        start = time.perf_counter()
        n, rank = self._size_rank()
        cfg = self.config
        compressed = [i for i, p in enumerate(self._params) if cfg.is_compressed(p.numel())]
        dense = [i for i, p in enumerate(self._params) if not cfg.is_compressed(p.numel())]
        dense_handle = None
        if dense:  # x_new = mean_i x_i
            dense_handle = hvd.grouped_allreduce_async(
                [self._params[i].detach().reshape(-1).to(self._shared[i].dtype, copy=True) for i in dense],
                name=DENSE_NAME, op=hvd.Average, **self._ps_kwargs())
        # The header: this rank's step and x_last, compared after the allgather (see the module doc).
        chunks = [torch.tensor([t, _checksum(self._shared)], dtype=torch.int64).view(torch.uint8)]
        layout = []
        new_memory = {}  # adopted once every rank's header has been checked
        generator_state = self._generator.get_state()  # (restored with the memories if the check fails)
        level_dtype = cfg.level_dtype()
        for i in compressed:
            p, shared = self._params[i], self._shared[i]
            numel, k = p.numel(), cfg.num_selected(p.numel())
            memory = self._memory[i]
            if memory is None:
                memory = torch.zeros(1, numel, dtype=shared.dtype, device=shared.device)
            drift = (p.detach().reshape(1, -1).to(shared.dtype) - shared)            # x_i - x_last
            noise = None
            if cfg.operator == "qsgd_top_k":  # the shared (n, k) draw; this rank's row
                noise = torch.rand(n, k, generator=self._generator)[rank:rank + 1].to(shared.device)
            indices, scale, codes, _, new_memory[i] = compress_delta(memory, drift, k, cfg.operator, cfg.levels,
                                                                     noise, level_dtype)
            index_dtype, scale_dtype, code_dtype = payload_dtypes(cfg.operator, cfg.index_dtype_for(numel),
                                                                  level_dtype, shared.dtype)
            parts = [indices.to(index_dtype)] + ([] if scale is None else [scale.to(scale_dtype)]) + [codes]
            chunks += [part.reshape(-1).contiguous().view(torch.uint8) for part in parts]
            layout.append((i, k, index_dtype, scale_dtype, code_dtype))
        sizes = {}
        # The header travels even where no tensor is compressed (then alone): ranks at different steps
        # or models must raise alike, never average silently.
        payload = torch.cat(chunks)
        handle = hvd.allgather_async(payload, name=PAYLOAD_NAME, **self._ps_kwargs())
        waited = time.perf_counter()
        gathered = hvd.synchronize(handle).view(n, payload.numel())
        means = hvd.synchronize(dense_handle) if dense_handle is not None else []
        start += time.perf_counter() - waited
        headers, at = _take(gathered, 0, 2, torch.int64)
        try:
            _check_same_state(headers)
        except ValueError:
            self._generator.set_state(generator_state)
            raise
        for i, k, index_dtype, scale_dtype, code_dtype in layout:
            indices, at = _take(gathered, at, k, index_dtype)
            scale = None
            if scale_dtype is not None:
                scale, at = _take(gathered, at, 1, scale_dtype)
            codes, at = _take(gathered, at, k, code_dtype)
            c = decode(scale, codes, cfg.operator, cfg.levels, dtype=self._shared[i].dtype)
            change = mean_of_sparse(indices, c, self._params[i].numel(), n)          # mean_i c_i
            if memory_kept(change):  # (a rank sent NaN: x_new carries it, every memory stays)
                self.nonfinite_skips += 1
            else:
                self._memory[i] = new_memory[i]
            self._shared[i].add_(change)                                             # x_new
            scale_bytes = 0 if scale_dtype is None else _itemsize(scale_dtype)
            sizes[i] = (k * _itemsize(index_dtype), scale_bytes + k * _itemsize(code_dtype))
        for i, mean in zip(dense, means):
            self._shared[i].add_(mean.to(self._shared[i].dtype) - self._shared[i])
        with torch.no_grad():
            for p, shared in zip(self._params, self._shared):
                p.copy_(shared.view(p.shape))                                        # restart from x_new
        self._last_sync = t
        seconds = (time.perf_counter() - start) / max(1, len(self._params))
        for i, p in enumerate(self._params):
            baseline = cfg.local_steps * p.numel() * wire_dtype(p.dtype).itemsize  # (bf16 travels as fp32)
            if i in sizes:
                self.traffic.record(t, index_bytes=sizes[i][0], value_bytes=sizes[i][1],
                                    uncompressed_bytes=baseline, compress_seconds=seconds)
            else:
                self.traffic.record(t, dense_bytes=p.numel() * self._shared[i].element_size(),
                                    uncompressed_bytes=baseline, compress_seconds=seconds)


_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(tensors):
    """The sum of the tensors' bit patterns as integers, modulo 2**63: equal on ranks holding equal
    tensors, whatever their threads (integer sums do not depend on the order)."""
    total = 0
    for t in tensors:
        total += int(t.detach().contiguous().view(_BITS[t.element_size()]).sum(dtype=torch.int64))
    return total % (1 << 63)


def _check_same_state(headers):
    """ValueError, alike on every rank (all see the same gathered ``(step, checksum)`` rows), unless
    every rank synchronises at the same step from the same ``x_last``."""
    if not bool((headers == headers[:1]).all()):
        steps, checksums = headers[:, 0].tolist(), headers[:, 1].tolist()
        raise ValueError(f"QsparseLocalSGD: the ranks synchronise at steps {steps} from models with "
                         f"x_last checksums {checksums}: every rank must restore the same state "
                         f"(load_state_dict on every rank, or on none)")


def _itemsize(dtype):
    return torch.empty(0, dtype=dtype).element_size()


def _take(gathered, at, count, dtype):
    """``(rows, count)`` entries of ``dtype`` from byte column ``at`` of every rank's payload."""
    nbytes = count * _itemsize(dtype)
    # (a copy with rows of its own width: with one rank, a plain clone keeps the payload's row stride)
    part = gathered[:, at:at + nbytes].clone(memory_format=torch.contiguous_format)
    return part.view(dtype), at + nbytes

