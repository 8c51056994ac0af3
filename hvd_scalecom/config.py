"""Framework-neutral configuration of ScaleCom: validation, k, and the leader schedule.

Both frontends (``hvd_scalecom.torch`` and ``hvd_scalecom.tensorflow``) build a :class:`ScaleComConfig`
from their constructor arguments, so validation and the schedule exist once.

Terms (Chen et al., "ScaleCom", NeurIPS 2020, Sec. 3):

* **residue memory** ``m_i``: what rank i has not yet sent (error feedback).
* **leader**: the rank whose top-k indices every rank uses in a step.
* **CLT-k** (cyclic local top-k): the leader's top-k of ``|m_j + g_j|`` stands in for the global top-k.
* **low-pass filter** ``beta``: ``m <- (1 - beta) m + beta (p - sent)``; ``beta = 1`` is classic error
  feedback.
"""

import dataclasses
import fractions
import functools
import math
import numbers

LEADER_POLICIES = ("cyclic", "staggered")
SELECTIONS = ("exact", "threshold")
VALUE_DTYPES = (None, "float32", "float16", "bfloat16")
# Horovod 0.28.1's collectives take no bfloat16 (PyTorch: "BFloat16Tensor is not supported"; TensorFlow:
# no kernel): on Horovod, values travel in the gradient's dtype (PyTorch: a bfloat16 gradient's as
# float32) or these; the simulator takes all.
HOROVOD_VALUE_DTYPES = tuple(d for d in VALUE_DTYPES if d != "bfloat16")
INDEX_DTYPES = ("int64", "int32")
INT64_LIMIT = 2**63  # step counters and generator seeds are int64: they stay below it
INT32_INDEX_MAX_NUMEL = 2**31 - 1  # larger tensors' indices travel as int64 whatever index_dtype says


def is_real(x):
    """A real number (NumPy's too), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x):
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_int(value, argument, minimum, allow_none=False):
    """``int(value)``; TypeError unless an int (bools are not), ValueError below ``minimum``."""
    if value is None and allow_none:
        return None
    if not _is_int(value):
        raise TypeError(f"{argument} must be an int{' or None' if allow_none else ''}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{argument} must be >= {minimum}, got {value}")
    return int(value)


def check_kept_step(step, newest, kept):
    """``int(step)`` (checked as by ``check_int``); ValueError for one before the last ``kept`` steps
    up to ``newest`` whose statistics are kept (none counted yet: ``newest`` is None)."""
    check_int(step, "step", 0)
    if newest is not None and step <= newest - kept:
        raise ValueError(f"step {step} is not kept: the statistics keep the last {kept} steps "
                         f"({newest - kept + 1}..{newest}); 'total' counts every step")
    return int(step)


def check_real(value, argument, low, high, low_open=False, high_open=False):
    """``float(value)``; TypeError unless a real number, ValueError outside the interval or NaN."""
    if not is_real(value):
        raise TypeError(f"{argument} must be a number, got {value!r}")
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):  # NaN fails both
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{argument} must be in {interval}, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ScaleComConfig:
    """What every rank must agree on. Arguments are checked in ``__post_init__``.

    ratio: fraction of each tensor's entries sent, ``k = max(1, ceil(ratio * numel))``, the product
        taken exactly with ratio as the decimal it prints as (0.07 of 100 entries is 7, not the 8
        that ``0.07 * 100 = 7.000000000000001`` would give).
    beta: low-pass filter weight of the residue memory, in (0, 1].
    warmup_steps: optimizer steps (from 0) reduced densely before compression starts.
    min_numel: tensors with fewer entries are always reduced densely.
    leader: ``"cyclic"`` (leader ``t mod n``, the paper's) or ``"staggered"``
        (``(t + tensor index) mod n``, spreading the top-k work over ranks).
    selection: ``"threshold"`` (default: candidates above a sampled threshold,
        then an exact top-k among them) or ``"exact"`` (a full top-k): the same indices, the first
        found several times faster on large tensors.
    value_dtype: dtype the selected values travel in (``None``: the gradient's own; on Horovod in
        PyTorch a bfloat16 gradient's travel as float32).
    index_dtype: dtype the indices travel in; ``"int32"`` widens to int64 for tensors of 2**31 or
        more entries.
    pipelined: use at step t the indices the leader of step t selected at step t - 1 from its
        ``p = m + g`` then (one step stale), so that their broadcast overlaps a whole step instead of
        being waited for inside the gradient hook. The first compressed step selects fresh indices.
    """

    ratio: float = 0.01
    beta: float = 0.1
    warmup_steps: int = 0
    min_numel: int = 1024
    leader: str = "cyclic"
    selection: str = "threshold"
    value_dtype: "str | None" = None
    index_dtype: str = "int32"
    pipelined: bool = False

    def __post_init__(self):
        if not is_real(self.ratio) or not (0.0 < self.ratio <= 1.0) or math.isnan(self.ratio):
            raise ValueError(f"ratio must be a number in (0, 1], got {self.ratio!r}")
        if not is_real(self.beta) or not (0.0 < self.beta <= 1.0) or math.isnan(self.beta):
            raise ValueError(f"beta must be a number in (0, 1], got {self.beta!r}")
        if not _is_int(self.warmup_steps):
            raise TypeError(f"warmup_steps must be an int, got {type(self.warmup_steps).__name__}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.warmup_steps >= INT64_LIMIT:
            raise ValueError(f"warmup_steps must be below 2**63 (step counters are int64), got "
                             f"{self.warmup_steps}")
        if not _is_int(self.min_numel):
            raise TypeError(f"min_numel must be an int, got {type(self.min_numel).__name__}")
        if self.min_numel < 0:
            raise ValueError(f"min_numel must be >= 0, got {self.min_numel}")
        if self.leader not in LEADER_POLICIES:
            raise ValueError(f"leader must be one of {LEADER_POLICIES}, got {self.leader!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}")
        # dtypes by name, or as the frameworks' dtype objects (torch.float16, tf.int32), as the frontends take them
        object.__setattr__(self, "value_dtype", check_dtype_name(self.value_dtype, "value_dtype", VALUE_DTYPES))
        object.__setattr__(self, "index_dtype", check_dtype_name(self.index_dtype, "index_dtype", INDEX_DTYPES))
        if not isinstance(self.pipelined, bool):
            raise TypeError(f"pipelined must be True or False, got {self.pipelined!r}")
        # Normalise numbers so that configs built from 1 and 1.0 (or np.float32(0.1)) compare (and hash)
        # equal, each number as the decimal it prints as (see ``ratio``).
        object.__setattr__(self, "ratio", _as_printed(self.ratio))
        object.__setattr__(self, "beta", _as_printed(self.beta))
        object.__setattr__(self, "warmup_steps", int(self.warmup_steps))
        object.__setattr__(self, "min_numel", int(self.min_numel))

    def num_selected(self, numel):
        """k for a tensor of ``numel`` entries: ``max(1, ceil(ratio * numel))``, at most ``numel``
        (exact: see ``ratio``)."""
        ratio = _decimal(self.ratio)
        return min(numel, max(1, -(-numel * ratio.numerator // ratio.denominator)))

    def compresses(self, numel):
        """Whether a tensor of ``numel`` entries is ever compressed (an empty one never is)."""
        return numel > 0 and numel >= self.min_numel

    def is_compressed(self, numel, step):
        """Whether a tensor of ``numel`` entries is compressed at optimizer step ``step``."""
        return self.compresses(numel) and step >= self.warmup_steps

    def leader_rank(self, step, size, tensor_index=0):
        """The leader of ``step`` among ``size`` ranks (relative rank in the process set)."""
        if self.leader == "cyclic":
            return step % size
        return (step + tensor_index) % size

    def as_dict(self):
        return dataclasses.asdict(self)

    def index_dtype_for(self, numel):
        """The index dtype used for a tensor of ``numel`` entries."""
        return "int64" if numel > INT32_INDEX_MAX_NUMEL else self.index_dtype

    def index_itemsize(self, numel):
        """Bytes of one index of a tensor of ``numel`` entries."""
        from hvd_scalecom.traffic import itemsize  # (traffic imports this module)
        return itemsize(self.index_dtype_for(numel))


def check_dtype_name(name, argument, allowed):
    """Map a framework dtype or a string to one of ``allowed`` names, else ``ValueError``."""
    if name is None or isinstance(name, str):
        text = name
    elif isinstance(getattr(name, "name", None), str):
        text = name.name  # tf.DType, numpy dtype
    else:
        text = str(name).rsplit(".", 1)[-1]  # torch.float16
    if text not in allowed:
        raise ValueError(f"{argument} must be one of {allowed}, got {name!r}")
    return text


def _as_printed(x):
    """``x`` as the Python float of the decimal it prints as: ``np.float32(0.1)`` prints as 0.1 and
    gives 0.1, not its binary value 0.10000000149011612 (``float(x)`` where ``str`` names no decimal,
    e.g. a ``Fraction``)."""
    try:
        return float(str(x))
    except ValueError:
        return float(x)


@functools.lru_cache(maxsize=64)
def _decimal(ratio):
    """``ratio`` as the fraction its shortest decimal form names (``repr``): 0.07 is 7/100 exactly."""
    return fractions.Fraction(repr(ratio))
