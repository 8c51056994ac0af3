"""What a simulated step puts on the wire: every collective, its payload, and each worker's bytes sent.

A scheme reports each collective it would issue as a :class:`Collective` (what it carries, how many
bytes every worker hands over, in which dtype). :class:`StepRecord` turns them into bytes sent per
worker with the wire formulas of :mod:`hvd_scalecom.traffic`:

* ``allreduce`` (ring): every worker sends ``2 (n - 1) / n * B``;
* ``broadcast`` (pipelined chain ``root, root + 1, ..., root - 1``): every worker but the chain's last
  forwards ``B``, the last sends nothing, ``(n - 1) / n * B`` on average as in ``broadcast_bytes_sent``;
* ``allgather`` (ring): every worker sends ``(n - 1) * B``;
* ``exchange``: pairwise exchanges over ``rounds`` rounds (gTop-k's recursive doubling), every worker
  sends ``B`` per round.

Payloads are split into indices, values and dense tensors as :class:`hvd_scalecom.traffic.StepTraffic`
splits them, so a simulated ScaleCom step reports the same payload figures as
``hvd_scalecom.torch.ScaleCom.stats()`` on every rank (for bfloat16 gradients the simulator counts
bfloat16, which Horovod cannot send: ScaleCom, Sketched SGD and Qsparse-local-SGD on Horovod send
and count them as float32, their uncompressed baselines too; the simulator's sparse schemes also
round the values they select to bfloat16, as such a wire would, where Horovod's ScaleCom sends them
unrounded).
"""

import dataclasses

import numpy as np

from hvd_scalecom.traffic import StepTraffic, allgather_bytes_sent, allreduce_bytes_sent

ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4}
OPS = ("allreduce", "broadcast", "allgather", "exchange")
CARRIES = ("index", "value", "dense")


def itemsize(dtype):
    """Bytes of one entry of ``dtype`` (a name such as ``"float16"``, or a torch dtype)."""
    name = dtype_name(dtype)
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name} has no byte size here (known: {', '.join(ITEMSIZE)})")
    return ITEMSIZE[name]


def dtype_name(dtype):
    return str(dtype).rsplit(".", 1)[-1]


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
        """The payload split as :class:`hvd_scalecom.traffic.StepTraffic` (``ScaleCom.stats()``'s fields)."""
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

