"""Framework-neutral byte accounting: what each collective puts on the wire, and per-step totals.

Per worker per step (the model every byte count of this project uses):

* ring allreduce of B bytes: each worker sends ``2 (n - 1) / n * B``;
* broadcast of B bytes (pipelined chain): each worker sends ``(n - 1) / n * B`` on average, the root
  sends ``B``;
* ring allgather of B bytes per worker: each worker sends ``(n - 1) * B``.

``StepTraffic`` counts *payloads* (what this rank hands to each collective): the figures that
``stats()`` reports and that a Horovod timeline shows. The wire formulas turn them into bytes sent.
"""

import dataclasses
import numbers

from hvd_scalecom.config import check_int, check_kept_step


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
