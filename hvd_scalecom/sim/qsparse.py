"""Qsparse-local-SGD (Basu, Data, Karakus, Diggavi, NeurIPS 2019, Alg. 1, synchronous) for the simulator.

Terms: ``x_i`` worker i's local model, ``x_last`` the shared model of the last synchronisation, ``H``
local steps between synchronisations, ``m_i`` worker i's error memory on the model delta. Every step,
every worker runs a local SGD step ``x_i <- x_i - lr * b_i`` (``b_i <- mu b_i + g_i``). Every H-th step,
per tensor:

1. ``delta_i = m_i + (x_i - x_last)``
2. ``c_i = Q(Top_k(delta_i))``, Q one of the operators of :mod:`hvd_scalecom.torch.quantize`
3. ``m_i <- delta_i - c_i``
4. ``x_new = x_last + mean_i c_i``; every worker restarts from ``x_new``

Tensors below ``min_numel`` are averaged densely. Traffic counts the paper's bits, sent by allgather:
per kept entry a ``ceil(log2 numel)``-bit index and a 32-bit value (``top_k``), 1 sign bit
(``sign_top_k``) or 1 sign bit and ``ceil(log2(s + 1))`` level bits (``qsgd_top_k``); a 32-bit scale
per tensor. Steps 1-4 are those of
:mod:`hvd_scalecom.torch.qsparse_steps`, the settings those of
:class:`hvd_scalecom.sketched_qsparse_config.QsparseConfig`, both shared with
:class:`hvd_scalecom.torch.QsparseLocalSGD`.
"""

import math

import torch

from hvd_scalecom.config import ScaleComConfig, check_real
from hvd_scalecom.sim.base import Scheme
from hvd_scalecom.sketched_qsparse_config import QSPARSE_OPERATORS, QsparseConfig
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.qsparse_steps import check_generator_state, compress_delta, mean_of_sparse, memory_kept
from hvd_scalecom.traffic import StepRecord

OPERATORS = QSPARSE_OPERATORS


class QsparseLocalSGD(Scheme):
    """Qsparse-local-SGD: H local steps, then composed Top-k + quantization with error compensation.

    lr, momentum: the workers' local SGD.
    local_steps: H (the authors' code: 8).
    ratio, max_k: ``k = min(ceil(ratio * numel), max_k)`` per tensor (the authors' code:
        ``min(1000, numel)``, i.e. ``ratio=1.0, max_k=1000``).
    operator: ``"top_k"``, ``"sign_top_k"`` or ``"qsgd_top_k"``; levels: s of QSGD (the code: 256).
    seed: QSGD's stochastic rounding draws from a generator of this seed, one uniform per kept
        entry, per tensor in parameter order, per worker, entries in increasing index order.
    """

    name = "qsparse_local_sgd"
    kind = "model"
    nonfinite_skips = 0  # compressed tensor-synchronisations whose memory update a non-finite mean skipped

    def __init__(self, lr, local_steps=8, ratio=0.01, *, max_k=None, operator="sign_top_k", levels=256,
                 momentum=0.0, min_numel=0, seed=0):
        settings = QsparseConfig(local_steps=local_steps, ratio=ratio, max_k=max_k, operator=operator,
                                 levels=levels, min_numel=min_numel, seed=seed)  # errors name the argument
        super().__init__(ScaleComConfig(ratio=settings.ratio, min_numel=settings.min_numel))
        self.settings = settings
        self.lr = check_real(lr, "lr", 0.0, math.inf, low_open=True, high_open=True)
        self.momentum = check_real(momentum, "momentum", 0.0, 1.0, high_open=True)
        self.generator = torch.Generator().manual_seed(self.seed)

    # read from the configuration, which the steps follow (so they cannot be set apart from it)
    local_steps = property(lambda self: self.settings.local_steps)
    max_k = property(lambda self: self.settings.max_k)
    operator = property(lambda self: self.settings.operator)
    levels = property(lambda self: self.settings.levels)
    seed = property(lambda self: self.settings.seed)

    def bind(self, specs, n, params):
        super().bind(specs, n, params)
        for spec, p in zip(self.specs, params):
            flat = p.detach().reshape(-1)
            self.state[spec.name]["shared"] = flat.to(clt_k.memory_dtype(p.dtype), copy=True)  # x_last
            self.state[spec.name]["local"] = flat.expand(n, -1).clone()  # x_i: the parameter, in its dtype

    def state_shapes(self, spec):
        return {**super().state_shapes(spec), "shared": (spec.numel,), "local": (self.n, spec.numel)}

    def state_dtype(self, spec, key):
        return spec.dtype if key == "local" else super().state_dtype(spec, key)  # x_i: the parameter's

    def worker_params(self):
        """Each worker's local model, ``(n, *shape)`` per parameter: where gradients must be taken."""
        return [self.state[s.name]["local"].view(self.n, *s.shape) for s in self.specs]

    def shared_params(self):
        """``x_last``, the model of the last synchronisation, in each parameter's shape."""
        return [self.state[s.name]["shared"].view(s.shape) for s in self.specs]

    def num_selected(self, numel):
        return self.settings.num_selected(numel)

    def step(self, grads, t):
        record = StepRecord(t, self.n)
        for spec, G in zip(self.specs, grads):
            record.baseline(spec.numel, G.dtype)
            x = self.state[spec.name]["local"]
            if self.momentum:
                b = self.memory(spec, G, key="momentum")
                b.mul_(self.momentum).add_(G)
                x.sub_(b, alpha=self.lr)
            else:
                x.sub_(G, alpha=self.lr)
        synced = self.settings.is_sync_step(t)
        updates = []
        for spec, G in zip(self.specs, grads):
            entry = self.state[spec.name]
            if not synced:
                updates.append(torch.zeros(spec.numel, dtype=G.dtype, device=G.device))
                continue
            x, shared = entry["local"], entry["shared"]
            if self.settings.is_compressed(spec.numel):
                change = self._compress(spec, x.to(shared.dtype) - shared, record)
            else:
                change = x.to(shared.dtype).mean(dim=0) - shared
                record.dense(spec.name, spec.numel, shared.dtype)
            shared.add_(change)                                                   # x_new
            x.copy_(shared.expand_as(x))
            updates.append(change.to(G.dtype))
        diagnostics = {"synced": synced}
        diagnostics.update(self.residue_diagnostics())
        return updates, record, diagnostics

    def _compress(self, spec, drift, record):
        """Steps 1-3 for one tensor; returns ``mean_i c_i``. ``drift`` is ``x_i - x_last`` (n, numel)."""
        n, numel = drift.shape
        k = self.num_selected(numel)
        M = self.memory(spec, drift)
        noise = None
        if self.operator == "qsgd_top_k":  # one uniform per kept entry, (n, k), only for QSGD
            noise = torch.rand(n, k, generator=self.generator).to(drift.device)
        indices, _, _, c, new_memory = compress_delta(
            M, drift, k, self.operator, self.levels, noise, self.settings.level_dtype())  # steps 1-3, every row
        change = mean_of_sparse(indices, c, numel, n)                             # mean_i c_i
        if memory_kept(change):
            self.nonfinite_skips += 1
        else:
            self.state[spec.name]["memory"] = new_memory
        if self.operator == "top_k":
            value_bits = 32 * k
        elif self.operator == "sign_top_k":
            value_bits = k + 32
        else:
            value_bits = k * (1 + math.ceil(math.log2(self.levels + 1))) + 32
        record.add_bits("allgather", "index", spec.name, k * max(1, math.ceil(math.log2(numel))))
        record.add_bits("allgather", "value", spec.name, value_bits)
        return change

    def describe(self):
        return {"config": self.config.as_dict(), "lr": self.lr, "local_steps": self.local_steps,
                "max_k": self.max_k, "operator": self.operator, "levels": self.levels,
                "momentum": self.momentum, "seed": self.seed}

    def extra_state(self):
        return {"generator": self.generator.get_state()}

    def load_extra_state(self, extra):
        """The QSGD noise generator's state, tried on a generator of its own before it is set."""
        generator = extra.get("generator") if isinstance(extra, dict) else None
        self.generator.set_state(check_generator_state(generator, "QsparseLocalSGD state generator"))
