"""Framework-neutral configuration of the two baselines that run on real Horovod beside ScaleCom:
Sketched SGD (:class:`SketchedSGDConfig`) and Qsparse-local-SGD (:class:`QsparseConfig`).

Each is a frozen dataclass whose ``__post_init__`` validates every argument (``ValueError`` or
``TypeError`` naming it) and whose :meth:`as_dict` is what ranks compare before their first step and
what checkpoints store. The arguments ``ratio``, ``warmup_steps`` and ``min_numel`` mean what they mean
for ScaleCom and are validated by :class:`hvd_scalecom.config.ScaleComConfig`; the argument names are
those of the simulator's schemes (:mod:`hvd_scalecom.sim.sketched`, :mod:`hvd_scalecom.sim.qsparse`),
which validate their settings through these classes too, so both paths accept and reject the same.
"""

import dataclasses

from hvd_scalecom.config import (
    INDEX_DTYPES,
    INT32_INDEX_MAX_NUMEL,
    INT64_LIMIT,
    ScaleComConfig,
    check_dtype_name,
    check_int,
    check_real,
)

QSPARSE_OPERATORS = ("top_k", "sign_top_k", "qsgd_top_k")
MAX_SKETCH_COLUMNS = 2**31  # a count sketch's columns stay below it (its hashes: m c < 2**63)


def check_seed(seed, argument="seed"):
    """``int(seed)``; TypeError unless an int, ValueError outside ``[0, 2**63)`` (checked before any
    state exists: a torch generator refuses larger ones only when it is seeded)."""
    seed = check_int(seed, argument, 0)
    if seed >= INT64_LIMIT:
        raise ValueError(f"{argument} must be below 2**63, got {seed}")
    return seed


def _shared(ratio, warmup_steps, min_numel):
    """The arguments ScaleCom shares, validated (and normalised) by ScaleComConfig."""
    return ScaleComConfig(ratio=ratio, warmup_steps=warmup_steps, min_numel=min_numel)


@dataclasses.dataclass(frozen=True)
class SketchedSGDConfig:
    """Sketched SGD (Ivkin et al., NeurIPS 2019): what every rank must agree on.

    ratio: ``k = sum over sketched tensors of max(1, ceil(ratio * numel))`` coordinates applied per step.
    rows, columns: the count sketch is ``rows x columns`` (rows odd: the estimate is their median);
        ``columns=None`` means ``10 k`` (the ratio of FetchSGD's defaults r = 5, c = 500,000, k = 50,000).
    candidates: ``P``: the second round fetches the exact sums of ``P k`` heavy-hitter candidates.
    momentum: ``rho`` of ``u <- rho u + g`` (the compressor's momentum; the user's optimizer has none).
    warmup_steps: steps (from 0) of dense momentum SGD before sketching starts.
    min_numel: tensors with fewer entries, and all vectors (biases, norms), are reduced densely.
    seed: seed of the sketch's hashes (identical on every rank).
    """

    ratio: float = 0.01
    rows: int = 5
    columns: "int | None" = None
    candidates: int = 2
    momentum: float = 0.9
    warmup_steps: int = 0
    min_numel: int = 1024
    seed: int = 0

    def __post_init__(self):
        shared = _shared(self.ratio, self.warmup_steps, self.min_numel)
        object.__setattr__(self, "ratio", shared.ratio)
        object.__setattr__(self, "warmup_steps", shared.warmup_steps)
        object.__setattr__(self, "min_numel", shared.min_numel)
        object.__setattr__(self, "rows", check_int(self.rows, "rows", 1))
        if self.rows % 2 == 0:  # (torch.median, and the reference code, take the lower middle value)
            raise ValueError(f"rows must be odd, got {self.rows}: each coordinate is estimated by the median "
                             f"of its rows, which for an even number of rows is the lower middle value, biased "
                             f"towards smaller estimates")
        object.__setattr__(self, "columns", check_int(self.columns, "columns", 1, allow_none=True))
        if self.columns is not None and self.columns >= MAX_SKETCH_COLUMNS:
            raise ValueError(f"columns must be below 2**31 (the count sketch's hashes), got {self.columns}")
        object.__setattr__(self, "candidates", check_int(self.candidates, "candidates", 1))
        object.__setattr__(self, "seed", check_seed(self.seed))
        object.__setattr__(self, "momentum", check_real(self.momentum, "momentum", 0.0, 1.0, high_open=True))

    def is_sketched(self, shape):
        """Whether a parameter of this shape is sketched (matrices and higher, ``numel >= min_numel``);
        the paper leaves biases uncompressed, and so does the simulator."""
        numel = 1
        for s in shape:
            numel *= int(s)
        return len(shape) >= 2 and numel > 0 and numel >= self.min_numel

    def num_selected(self, numels):
        """k for sketched tensors of these sizes (at most their total)."""
        shared = _shared(self.ratio, self.warmup_steps, self.min_numel)
        return min(sum(numels), sum(shared.num_selected(n) for n in numels))

    def num_columns(self, k):
        """The sketch's columns: ``columns``, or ``10 k``; ValueError (before any state exists) where
        ``10 k`` reaches 2**31."""
        if self.columns is not None:
            return self.columns
        if 10 * k >= MAX_SKETCH_COLUMNS:
            raise ValueError(f"the count sketch would have 10 k = {10 * k} columns, 2**31 or more: lower "
                             f"ratio or give columns")
        return 10 * k

    def num_candidates(self, k, numel):
        return min(numel, self.candidates * k)

    def as_dict(self):
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class QsparseConfig:
    """Qsparse-local-SGD (Basu et al., NeurIPS 2019): what every rank must agree on.

    local_steps: H, optimizer steps between synchronisations (the authors' code: 8).
    ratio, max_k: ``k = min(max(1, ceil(ratio * numel)), max_k)`` per tensor (the authors' code:
        ``k = min(1000, numel)``, i.e. ``ratio=1.0, max_k=1000``).
    operator: ``"top_k"`` (values as they are), ``"sign_top_k"`` (one scale and k signs) or
        ``"qsgd_top_k"`` (QSGD with ``levels`` levels, scaled to a contraction).
    levels: s of QSGD (the authors' code: 256); at most 2**24, the integers float32 holds exactly.
    min_numel: tensors with fewer entries are averaged densely at each synchronisation.
    seed: seed of QSGD's stochastic rounding (the same stream on every rank, each rank its own row).
    index_dtype: ``"int32"`` (int64 for tensors of 2**31 entries or more) or ``"int64"`` (or the torch or
        NumPy dtypes), as ScaleCom's.
    """

    local_steps: int = 8
    ratio: float = 0.01
    max_k: "int | None" = None
    operator: str = "sign_top_k"
    levels: int = 256
    min_numel: int = 0
    seed: int = 0
    index_dtype: str = "int32"

    def __post_init__(self):
        shared = _shared(self.ratio, 0, self.min_numel)
        object.__setattr__(self, "ratio", shared.ratio)
        object.__setattr__(self, "min_numel", shared.min_numel)
        object.__setattr__(self, "local_steps", check_int(self.local_steps, "local_steps", 1))
        object.__setattr__(self, "max_k", check_int(self.max_k, "max_k", 1, allow_none=True))
        object.__setattr__(self, "levels", check_int(self.levels, "levels", 1))
        if self.levels > 2**24:  # xi = floor(s |v| / ||v||) + 0 or 1 is computed in float32
            raise ValueError(f"levels must be at most 2**24 (QSGD's levels are counted in float32), got {self.levels}")
        object.__setattr__(self, "seed", check_seed(self.seed))
        if self.operator not in QSPARSE_OPERATORS:
            raise ValueError(f"operator must be one of {QSPARSE_OPERATORS}, got {self.operator!r}")
        object.__setattr__(self, "index_dtype", check_dtype_name(self.index_dtype, "index_dtype", INDEX_DTYPES))

    def num_selected(self, numel):
        k = _shared(self.ratio, 0, self.min_numel).num_selected(numel)
        return k if self.max_k is None else min(k, self.max_k)

    def is_compressed(self, numel):
        return numel > 0 and numel >= self.min_numel  # (an empty tensor never is)

    def is_sync_step(self, step):
        """Whether optimizer step ``step`` (from 0) ends with a synchronisation."""
        return (step + 1) % self.local_steps == 0

    def index_dtype_for(self, numel):
        return "int64" if numel > INT32_INDEX_MAX_NUMEL else self.index_dtype

    def level_dtype(self):
        """The narrowest signed integer that holds ``sign * level`` for QSGD's levels 0..s."""
        if self.levels <= 127:
            return "int8"
        return "int16" if self.levels <= 32767 else "int32"

    def as_dict(self):
        return dataclasses.asdict(self)
