"""PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019, Alg. 1-2) for the simulator.

Per matrix-shaped gradient (viewed as ``shape[0] x prod(shape[1:])``), with error feedback ``e_i``:
``M_i = g_i + e_i``; ``P = mean_i M_i Q`` (allreduce 1); ``P_hat = orthogonalise(P)``;
``Q <- mean_i M_i^T P_hat`` (allreduce 2); every worker applies ``P_hat Q^T``; ``e_i <- M_i - P_hat Q^T``.
``Q`` is kept for the next step (warm start) and starts i.i.d. standard normal from a shared seed.
Vectors, tensors below ``min_numel`` and matrices where rank r would not compress are allreduced
densely. The guide (docs/other-schemes.md) gives the edge cases.
"""

import torch

from hvd_scalecom.config import ScaleComConfig, check_int
from hvd_scalecom.sim.base import Scheme, mean_over_workers
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.powersgd import approximation, as_matrix, left_factor, orthogonalise_, right_factor
from hvd_scalecom.traffic import dtype_name, itemsize


class PowerSGD(Scheme):
    """Rank-``rank`` PowerSGD with warm start and error feedback; the factors travel as fp32 (float64
    for float64 gradients)."""

    name = "powersgd"
    nonfinite_skips = 0  # compressed tensor-steps whose error update a non-finite result skipped

    def __init__(self, rank=2, warmup_steps=0, min_numel=1024, *, seed=0):
        super().__init__(ScaleComConfig(ratio=1.0, warmup_steps=warmup_steps, min_numel=min_numel))
        self.rank, self.seed = check_int(rank, "rank", 1), check_int(seed, "seed", 0)

    def compresses(self, spec):
        if len(spec.shape) < 2:
            return False
        rows, cols = as_matrix(spec.shape)
        factors = (rows + cols) * self.rank * itemsize(clt_k.memory_dtype(spec.dtype))
        return factors < rows * cols * itemsize(spec.dtype)

    def residue_keys(self):
        return ("error",)

    def state_shapes(self, spec):
        shapes = super().state_shapes(spec)
        if len(spec.shape) >= 2:
            shapes["q"] = (as_matrix(spec.shape)[1], self.rank)  # Q, warm-started from step to step
        return shapes

    def made_later(self):
        return (*super().made_later(), "q")

    def compress(self, spec, G, t, record, diagnostics):
        n = G.shape[0]
        rows, cols = as_matrix(spec.shape)
        entry = self.state[spec.name]
        error = self.memory(spec, G, key="error")  # fp32, or the gradient's dtype if wider (float64)
        if "q" not in entry:
            generator = torch.Generator().manual_seed((self.seed * 100_003 + spec.index) % 2**63)
            entry["q"] = torch.randn(cols, self.rank, generator=generator).to(G.device, error.dtype)
        M = (error + G).view(n, rows, cols)                                   # M_i = g_i + e_i
        P = mean_over_workers(left_factor(M, entry["q"]))                     # allreduce 1
        orthogonalise_(P)
        Q = mean_over_workers(right_factor(M, P))                             # allreduce 2
        applied = approximation(P, Q)
        if clt_k.all_finite(applied):
            error.copy_((M - applied).view(n, -1))                            # e_i = M_i - P_hat Q^T
        else:
            self.nonfinite_skips += 1
        if bool(torch.isfinite(Q).all()) and bool(Q.abs().amax(dim=0).gt(0).all()):
            entry["q"] = Q                                                    # warm start
        record.add("allreduce", "value", spec.name, rows * self.rank, dtype_name(error.dtype))
        record.add("allreduce", "value", spec.name, cols * self.rank, dtype_name(error.dtype))
        return applied.reshape(-1).to(G.dtype)

    def describe(self):
        return {"config": self.config.as_dict(), "rank": self.rank, "seed": self.seed}
