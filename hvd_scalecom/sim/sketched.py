"""Sketched SGD (Ivkin, Rothchild, Ullah, Braverman, Stoica, Arora, NeurIPS 2019, Alg. 1) for the simulator.

Terms: ``u_i`` momentum and ``v_i`` error accumulation of worker i, ``S(.)`` an ``r x c`` count sketch
(:mod:`hvd_scalecom.torch.sketch`), ``P`` the candidate factor. Per step, on the sketched coordinates
(matrices and higher-order tensors with ``numel >= min_numel``, concatenated into one vector):

1. ``u_i <- rho u_i + g_i``; ``v_i <- v_i + u_i``
2. round 1: ``S = sum_i S(v_i)``, computed as ``S(sum_i v_i)`` (the sketch is linear)
3. the ``P k`` coordinates of largest estimated ``|sum_i v_i|`` are the candidates
4. round 2: their exact sums ``sum_i v_i[candidates]``; the top k of them, ``I``, are kept
5. every worker applies ``scatter(I, sum_i v_i[I]) / n`` and zeroes ``u_i[I]`` and ``v_i[I]``

Other tensors are applied densely with the same momentum, ``mean_i u_i``. The equations are those of
:mod:`hvd_scalecom.torch.sketched_steps`, the settings those of
:class:`hvd_scalecom.sketched_qsparse_config.SketchedSGDConfig`, both shared with the Horovod
compressor :class:`hvd_scalecom.torch.SketchedSGD`.
"""

import functools

import torch

from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.sim.base import Scheme, mean_over_workers, public
from hvd_scalecom.sketched_qsparse_config import SketchedSGDConfig
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.dtypes import wire_dtype
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
from hvd_scalecom.traffic import StepRecord


class SketchedSGD(Scheme):
    """Sketched SGD with momentum and error accumulation.

    ratio: ``k = sum over compressed tensors of ceil(ratio * numel)``.
    rows, columns: sketch size ``r x c`` (default ``c = 10 k``, the ratio of FetchSGD's defaults
        r = 5, c = 500,000, k = 50,000).
    candidates: ``P``: round 2 fetches the exact sums of ``P k`` heavy-hitter candidates (``p2`` in the
        authors' code).
    momentum: ``rho``.
    """

    name = "sketched_sgd"
    nonfinite_skips = 0  # steps whose summed sketch was not finite (round 2 skipped)

    def __init__(self, ratio=0.01, rows=5, columns=None, candidates=2, momentum=0.9, warmup_steps=0,
                 min_numel=1024, *, seed=0):
        settings = SketchedSGDConfig(ratio=ratio, rows=rows, columns=columns, candidates=candidates,
                                     momentum=momentum, warmup_steps=warmup_steps, min_numel=min_numel,
                                     seed=seed)  # raises ValueError / TypeError naming the argument
        super().__init__(ScaleComConfig(ratio=settings.ratio, warmup_steps=settings.warmup_steps,
                                        min_numel=settings.min_numel))
        self.settings = settings
        self.rows, self.columns, self.candidates = settings.rows, settings.columns, settings.candidates
        self.momentum = settings.momentum
        self.seed = settings.seed

    def bind(self, specs, n, params):
        sketched = [s for s in specs if self.settings.is_sketched(s.shape)]
        k = self.settings.num_selected([s.numel for s in sketched])
        c = self.settings.num_columns(k)  # may raise: before the scheme is bound
        super().bind(specs, n, params)
        self.sketched, self.numel, self.k, self.c = sketched, sum(s.numel for s in sketched), k, c
        self.sketch = None  # the count sketch (its hashes' seeds), built at the first step
        self._u = None  # (n, numel) momentum of the sketched coordinates
        self._v = None  # (n, numel) error accumulation

    def residue_keys(self):
        return ()

    def step(self, grads, t):
        record = StepRecord(t, self.n)
        diagnostics = {}
        by_name = {s.name: G for s, G in zip(self.specs, grads)}
        updates = {}
        for spec, G in zip(self.specs, grads):
            record.baseline(spec.numel, G.dtype)
            if spec not in self.sketched:
                u = self.memory(spec, G, key="momentum")
                momentum_(u, G, self.momentum)
                record.dense(spec.name, spec.numel, G.dtype)
                updates[spec.name] = self._dense_mean(u, G.dtype)
                reset_nonfinite_(u)
        if self.sketched:
            G = torch.cat([by_name[s.name] for s in self.sketched], dim=1)
            if self._u is None:
                self._u = torch.zeros(G.shape, dtype=vector_dtype([G.dtype]), device=G.device)  # as on Horovod
                self._v = torch.zeros_like(self._u)
            sizes = [s.numel for s in self.sketched]
            if t < self.config.warmup_steps:  # dense momentum SGD, nothing accumulated in v
                # Horovod reduces u whole, in the sketched gradients' wire dtypes promoted (fp16 and
                # fp32 matrices: all as fp32); counted in their own dtypes promoted (bf16 as bf16, as
                # everywhere here: see hvd_scalecom.traffic)
                dtypes = [spec.dtype for spec in self.sketched]
                counted = functools.reduce(torch.promote_types, dtypes)
                wire = warmup_wire_dtype(dtypes)
                momentum_(self._u, G, self.momentum)
                mean = mean_over_workers(self._u.to(wire))
                for spec, part in zip(self.sketched, torch.split(mean, sizes)):
                    record.dense(spec.name, spec.numel, counted)
                    updates[spec.name] = part.to(spec.dtype)
                reset_nonfinite_(self._u)
            else:
                update = self._sketched_step(G, record, diagnostics)
                for spec, part in zip(self.sketched, torch.split(update, sizes)):
                    updates[spec.name] = part.to(by_name[spec.name].dtype)
        if self._v is not None:
            norms = torch.linalg.vector_norm(self._v, dim=1).double()
            diagnostics.update(residue_norms=norms, residue_norm=float(norms.mean()))
        return [updates[s.name] for s in self.specs], record, public(diagnostics)

    @staticmethod
    def _dense_mean(u, dtype):
        """The allreduce-average of the rows of ``u`` as Horovod gets them: cast to the gradient's
        wire dtype (bfloat16 travels as float32), back in ``dtype``."""
        return mean_over_workers(u.to(wire_dtype(dtype))).to(dtype)

    def _sketched_step(self, G, record, diagnostics):
        n, numel = G.shape
        if self.sketch is None:
            self.sketch = CountSketch(numel, self.rows, self.c, seed=self.seed, device=G.device)
        u, v = self._u, self._v
        accumulate_(u, v, G, self.momentum)                                      # u <- rho u + g; v <- v + u
        total = v.sum(dim=0)
        table = self.sketch.sketch(total)                                        # round 1: sum_i S(v_i)
        record.add("allreduce", "value", "sketch", self.rows * self.c, v.dtype)
        if not clt_k.all_finite(table):                                          # no round 2
            self.nonfinite_skips += 1
            return skip_nonfinite_(u, v, numel, dtype=v.dtype)
        candidates = heavy_candidates(self.sketch, table, self.settings.num_candidates(self.k, numel))
        exact = total[candidates]                                                # round 2: exact sums
        indices, sums = select_applied(candidates, exact, self.k)
        update = applied_update(indices, sums, numel, n, dtype=v.dtype)          # scatter(I, sums) / n
        if self.diagnose:
            true = torch.topk(total.abs(), self.k, sorted=False).indices
            hit = torch.zeros(numel, dtype=torch.bool, device=v.device)
            hit[true] = True
            diagnostics["recall"] = float(hit[indices].sum()) / self.k
        zero_applied_(u, v, indices)                                             # u[I] = v[I] = 0
        record.add("allreduce", "value", "candidates", candidates.numel(), v.dtype)
        return update

    def describe(self):
        return {"config": self.config.as_dict(), "rows": self.rows, "columns": self.columns,
                "candidates": self.candidates, "momentum": self.momentum, "seed": self.seed}

    def extra_state(self):
        return {"u": None if self._u is None else self._u.clone(),
                "v": None if self._v is None else self._v.clone()}

    def load_extra_state(self, extra):
        """The momentum ``u`` and error accumulation ``v`` of the sketched coordinates: both None, or
        two tensors of the same ``(n, sketched entries)`` shape; checked before either is set."""
        if not (isinstance(extra, dict) and {"u", "v"} <= set(extra)):
            raise ValueError(f"SketchedSGD state extra must be a dict of u and v (its state_dict()'s), got "
                             f"{f'keys {list(extra)}' if isinstance(extra, dict) else type(extra).__name__}")
        u, v = extra["u"], extra["v"]
        if not (u is None and v is None) and not (
                isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor)
                and u.dtype.is_floating_point and v.dtype.is_floating_point
                and tuple(u.shape) == tuple(v.shape) == (self.n, self.numel)):
            raise ValueError(f"SketchedSGD state u and v must both be None or floating-point tensors of shape "
                             f"({self.n}, {self.numel}), got {getattr(u, 'shape', u)!r} "
                             f"{getattr(u, 'dtype', '')} and {getattr(v, 'shape', v)!r} {getattr(v, 'dtype', '')}")
        if u is not None:  # kept as the first step makes them: fp32 at least, as the gradients' dtype
            dtype = vector_dtype([s.dtype for s in self.sketched])
            u, v = (x.to(dtype, copy=True, memory_format=torch.contiguous_format) for x in (u, v))
        self._u, self._v = u, v
