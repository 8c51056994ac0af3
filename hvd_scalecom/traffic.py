"""Byte accounting, framework-neutral: what each collective puts on the wire, and per-step totals,
for the Horovod frontends' ``stats()`` and for the simulator.

Per worker per step (the model every byte count of this project uses), for ``n`` workers:

* ring allreduce of B bytes: each worker sends ``2 (n - 1) / n * B``;
* broadcast of B bytes (pipelined chain ``root, root + 1, ..., root - 1``): every worker but the
  chain's last forwards ``B``, ``(n - 1) / n * B`` on average;
* ring allgather of B bytes per worker: each worker sends ``(n - 1) * B``;
* ``exchange`` (simulator): pairwise exchanges over ``rounds`` rounds (gTop-k's recursive doubling),
  every worker sends ``B`` per round.

:class:`StepTraffic` counts *payloads* (what this rank hands to each collective): the figures that
``stats()`` reports and that a Horovod timeline shows; :class:`TrafficMeter` keeps them per step on
a Horovod rank; :func:`scalecom_tensor_traffic` gives one tensor's for a ScaleCom configuration.
The simulator records each collective as a :class:`Collective` in a :class:`StepRecord`, which splits
payloads as ``StepTraffic`` does (for bfloat16 gradients it counts bfloat16, which Horovod cannot
send: the Horovod frontends send and count them as float32).
"""


import dataclasses
import numbers

import numpy as np

from hvd_scalecom.config import check_int, check_kept_step

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}


def dtype_name(dtype):
    """The name of ``dtype``: a string as it is, a TensorFlow or NumPy dtype's ``name``, a torch
    dtype's last dotted part (``torch.float16`` is ``"float16"``)."""
    if isinstance(dtype, str):
        return dtype
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).rsplit(".", 1)[-1]


def itemsize(dtype):
    """Bytes of one entry of ``dtype`` (a name such as ``"float16"``, or a framework's dtype)."""
    name = dtype_name(dtype)
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name} has no byte size here (known: {', '.join(ITEMSIZE)})")
    return ITEMSIZE[name]


def allreduce_bytes_sent(nbytes, n):
    """Bytes one worker sends in a ring allreduce of ``nbytes``."""
    _check_counts(n, nbytes)
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def broadcast_bytes_sent(nbytes, n):
    """Average bytes one worker sends in a pipelined broadcast of ``nbytes``."""
    _check_counts(n, nbytes)
    return (n - 1) / n * nbytes if n > 1 else 0.0


def allgather_bytes_sent(nbytes, n):
    """Bytes one worker sends in a ring allgather where each worker contributes ``nbytes``."""
    _check_counts(n, nbytes)
    return float((n - 1) * nbytes)


def _check_counts(n, nbytes):
    """ValueError unless ``n`` (workers) is an int >= 1 and ``nbytes`` a finite number >= 0."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"n (workers) must be an int >= 1, got {n!r}")
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Real) or not 0 <= nbytes < float("inf"):
        raise ValueError(f"nbytes must be a finite number >= 0, got {nbytes!r}")


@dataclasses.dataclass
class StepTraffic:
    """Payload bytes of one step on one rank, split by what they carry."""

    index_bytes: int = 0  # indices handed to a broadcast (the leader's) or received (others)
    value_bytes: int = 0  # selected values handed to the allreduce
    dense_bytes: int = 0  # tensors reduced densely (small ones, warm-up)
    uncompressed_bytes: int = 0  # what dense SGD would have handed over for the same tensors
    compress_seconds: float = 0.0  # compute in compress() and decompress()
    index_wait_seconds: float = 0.0  # waiting for the leader's indices
    tensors: int = 0

    @property
    def sent_bytes(self):
        return self.index_bytes + self.value_bytes + self.dense_bytes

    @property
    def ratio(self):
        """Uncompressed over sent bytes (1.0 for dense)."""
        return self.uncompressed_bytes / self.sent_bytes if self.sent_bytes else 1.0

    def scaled(self, times):
        """These payloads (and tensors) ``times`` over, in place: one tensor's step counted for
        ``times`` steps (the seconds are left as they are)."""
        self.index_bytes *= times
        self.value_bytes *= times
        self.dense_bytes *= times
        self.uncompressed_bytes *= times
        self.tensors *= times
        return self

    def add(self, other):
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self):
        d = dataclasses.asdict(self)
        d["sent_bytes"] = self.sent_bytes
        d["ratio"] = self.ratio
        return d


_COUNTED = frozenset(f.name for f in dataclasses.fields(StepTraffic)) - {"tensors"}


class TrafficMeter:
    """Per-step ``StepTraffic`` keyed by step number, plus running totals.

    Tensors report with their own step counters (each tensor is reduced once per optimizer step), so
    a step is complete once every tensor that reports has moved past it.
    """

    def __init__(self, keep=4):
        self._by_step = {}
        self._total = StepTraffic()
        self._keep = keep

    def record(self, step, **counts):
        """One tensor of ``step``: ``counts`` are ``StepTraffic`` fields to add (once per tensor and
        step, so kept cheap); TypeError, before anything is counted, for a name that is none."""
        self._add(step, 1, counts)

    def add(self, step, **counts):
        """``counts`` of ``step`` that belong to no one tensor (a round the step's tensors share), as
        :meth:`record` but without counting a tensor."""
        self._add(step, 0, counts)

    def add_time(self, step, seconds):
        self._add(step, 0, {"compress_seconds": seconds})

    def _add(self, step, tensors, counts):
        unknown = counts.keys() - _COUNTED
        if unknown:
            raise TypeError(f"TrafficMeter: {sorted(unknown)} are not StepTraffic fields")
        entry = self._by_step.get(step)
        if entry is None:
            entry = self._by_step[step] = StepTraffic()
            for old in [s for s in self._by_step if s < step - self._keep]:
                del self._by_step[old]
        for target in (entry, self._total):
            target.tensors += tensors
            for name, value in counts.items():
                setattr(target, name, getattr(target, name) + value)

    def step(self, step, strict=True):
        """The counts of ``step`` (zeros for one that sent nothing or has not begun); ValueError for
        one before those kept, the last ``keep + 1`` step numbers (``total`` counts every step), where
        ``strict`` (else zeros: for a default step, which a rollback can leave behind the newest)."""
        check_int(step, "step", 0)
        entry = self._by_step.get(step)
        if entry is not None:
            return entry
        if strict:
            check_kept_step(step, max(self._by_step, default=None), self._keep + 1)
        return StepTraffic()

    @property
    def total(self):
        return self._total

    def reset(self):
        self._by_step.clear()
        self._total = StepTraffic()


def scalecom_tensor_traffic(numel, k, compressible, grad_dtype, value_dtype, index_bytes, warmup=False):
    """One tensor's payload in one ScaleCom step: reduced densely (``compressible`` false: fewer
    than ``min_numel`` entries), in warm-up (``warmup``: the dense gradient and the k placeholder
    values Horovod's allreduce carries, as the TensorFlow frontend sends them), or compressed (k
    values of ``value_dtype``, None: the gradient's, and ``index_bytes`` of indices)."""
    full = numel * itemsize(grad_dtype)
    if not compressible:
        return StepTraffic(dense_bytes=full, uncompressed_bytes=full, tensors=1)
    value_bytes = k * itemsize(value_dtype or grad_dtype)
    if warmup:
        return StepTraffic(dense_bytes=full + value_bytes, uncompressed_bytes=full, tensors=1)
    return StepTraffic(index_bytes=index_bytes, value_bytes=value_bytes, uncompressed_bytes=full, tensors=1)


def index_exchange_bytes(k, index_dtype, with_count=False):
    """The index payload of one exchange: k indices of ``index_dtype`` (and, ``with_count``, the
    count of leaders an index allreduce appends)."""
    return (k + int(with_count)) * itemsize(index_dtype)


# -- the simulator's record of a step ------------------------------------------------------------

OPS = ("allreduce", "broadcast", "allgather", "exchange")
CARRIES = ("index", "value", "dense")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of one step: ``nbytes`` is what each worker hands over (per round for exchange).

    ``dtype`` names the entries (``"int32"``, ``"float16"``, ...; ``"bits"`` for bit-packed payloads,
    whose ``nbytes`` may then be fractional).
    """

    op: str
    carries: str
    tensor: str
    nbytes: float
    dtype: str
    root: int = 0
    rounds: int = 1

    def __post_init__(self):
        if self.op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {self.op!r}")
        if self.carries not in CARRIES:
            raise ValueError(f"carries must be one of {CARRIES}, got {self.carries!r}")

    @property
    def payload(self):
        """Bytes one worker hands over in all (every round of an exchange)."""
        return self.nbytes * self.rounds if self.op == "exchange" else self.nbytes

    def sent_by_worker(self, n):
        """Bytes each of the ``n`` workers sends, as an ``(n,)`` float array."""
        if self.op == "allreduce":
            return np.full(n, allreduce_bytes_sent(self.nbytes, n))
        if self.op == "allgather":
            return np.full(n, allgather_bytes_sent(self.nbytes, n))
        if self.op == "exchange":
            return np.full(n, float(self.rounds * self.nbytes) if n > 1 else 0.0)
        sent = np.full(n, float(self.nbytes) if n > 1 else 0.0)
        sent[(self.root - 1) % n] = 0.0  # the chain's last worker forwards nothing
        return sent


class StepRecord:
    """Collectives of one simulated step for ``n`` workers, and what they cost.

    ``uncompressed_bytes`` is what dense SGD would hand to its allreduce for the same tensors (each
    gradient in its own dtype), the baseline of :attr:`ratio`.
    """

    def __init__(self, step, n):
        self.step = step
        self.n = n
        self.collectives = []
        self.uncompressed_bytes = 0
        self.tensors = 0

    # -- what schemes call ----------------------------------------------------------------------------

    def add(self, op, carries, tensor, count, dtype, root=0, rounds=1):
        """Record a collective where each worker hands over ``count`` entries of ``dtype``."""
        nbytes = count * itemsize(dtype)
        self.collectives.append(Collective(op, carries, tensor, nbytes, dtype_name(dtype), root, rounds))

    def add_bits(self, op, carries, tensor, bits, rounds=1):
        """Record a bit-packed collective of ``bits`` per worker (``nbytes = bits / 8``)."""
        self.collectives.append(Collective(op, carries, tensor, bits / 8.0, "bits", 0, rounds))

    def dense(self, tensor, numel, dtype):
        """A tensor reduced densely by ring allreduce (small tensors, warm-up, dense SGD)."""
        self.add("allreduce", "dense", tensor, numel, dtype)

    def baseline(self, numel, dtype):
        """Count one tensor towards ``uncompressed_bytes`` (call once per tensor per step)."""
        self.uncompressed_bytes += numel * itemsize(dtype)
        self.tensors += 1

    # -- what callers read ----------------------------------------------------------------------------

    def payload(self, carries=None):
        """Bytes one worker hands over to collectives (optionally only those carrying ``carries``)."""
        return sum(c.payload for c in self.collectives if carries in (None, c.carries))

    def sent_by_worker(self, carries=None):
        """``(n,)`` bytes sent by each worker on the wire."""
        sent = np.zeros(self.n)
        for c in self.collectives:
            if carries in (None, c.carries):
                sent += c.sent_by_worker(self.n)
        return sent

    def sent_bytes(self, carries=None):
        """Bytes sent per worker, averaged over workers."""
        return float(self.sent_by_worker(carries).mean())

    @property
    def uncompressed_sent_bytes(self):
        """Bytes per worker of dense SGD's ring allreduce of the same tensors."""
        return allreduce_bytes_sent(self.uncompressed_bytes, self.n)

    @property
    def ratio(self):
        """Dense SGD's bytes sent over this step's (1.0 with one worker or nothing sent)."""
        sent = self.sent_bytes()
        return self.uncompressed_sent_bytes / sent if sent else 1.0

    def step_traffic(self):
        """The payload split as :class:`StepTraffic` (``ScaleCom.stats()``'s fields)."""
        return StepTraffic(index_bytes=self.payload("index"), value_bytes=self.payload("value"),
                           dense_bytes=self.payload("dense"), uncompressed_bytes=self.uncompressed_bytes,
                           tensors=self.tensors)

    def as_dict(self):
        """Scalars of the step (payload and bytes sent per worker, by what they carry)."""
        out = {"step": self.step, "n": self.n}
        for carries in CARRIES:
            out[f"{carries}_bytes"] = self.payload(carries)
            out[f"sent_{carries}_bytes"] = self.sent_bytes(carries)
        out["payload_bytes"] = self.payload()
        out["sent_bytes"] = self.sent_bytes()
        out["uncompressed_bytes"] = self.uncompressed_bytes
        out["uncompressed_sent_bytes"] = self.uncompressed_sent_bytes
        out["ratio"] = self.ratio
        out["tensors"] = self.tensors
        return out
