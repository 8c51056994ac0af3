"""One worker of ``benchmarks.slow_link``'s DDP jobs: the model, batch, step and measurement of
``_slow_link_worker`` (its :func:`setup`, :func:`sgd_step` and :func:`measure`: warm-up, timed
steps with the link counters around them, the floor, rank 0's ``RESULT {json}``), trained under
DistributedDataParallel (Gloo) with a communication hook.

    RANK=i WORLD_SIZE=N MASTER_ADDR=... MASTER_PORT=... python benchmarks/_slow_link_ddp_worker.py SPEC_JSON
    python -m torch.distributed.run --standalone --nproc_per_node N benchmarks/_slow_link_ddp_worker.py SPEC_JSON

(torch.distributed's ``env://`` variables: the benchmark sets them for one worker per namespace on
per-worker links, and runs torchrun on a shared loopback.) SPEC_JSON as for ``_slow_link_worker``
with ``compressor`` a key of ``HOOKS``. The payload per step (``compressor_stats.sent_bytes``) is
counted in the torch.distributed calls the hooks make (``broadcast``, ``all_reduce``) during the
step (:class:`HookPayload`); DDP's own reduction (``ddp_dense``) makes them in C++, so its payload
is the model's fp32 gradient size (the measurement's ``dense_bytes``).
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._slow_link_worker import measure, setup, sgd_step


def _dense(model, kwargs):
    return None, None  # DDP's own allreduce


def _fp16(model, kwargs):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    return None, default_hooks.fp16_compress_hook


def _powersgd(model, kwargs):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    kwargs = {"matrix_approximation_rank": powersgd_rank(model, kwargs.get("ratio", 0.01)),
              "start_powerSGD_iter": 2, **{k: v for k, v in kwargs.items() if k != "ratio"}}
    return powerSGD_hook.PowerSGDState(process_group=None, **kwargs), powerSGD_hook.powerSGD_hook


def _scalecom(model, kwargs):
    from hvd_scalecom.ddp import ScaleComState, scalecom_hook
    return ScaleComState(named_parameters=model.named_parameters(), **kwargs), scalecom_hook


# name -> factory(model, kwargs) returning (state, hook); hook None: DDP's own reduction.
HOOKS = {"ddp_dense": _dense, "ddp_fp16": _fp16, "ddp_powersgd": _powersgd, "ddp_scalecom": _scalecom}
NO_OPTIONS = {"ddp_dense", "ddp_fp16"}


def scalecom_payload(model, ratio):
    """Bytes per step ScaleCom (``ratio``, int32 indices, fp32 values, min_numel 1024) hands over."""
    from hvd_scalecom.config import ScaleComConfig
    config = ScaleComConfig(ratio=ratio)
    return sum(8 * config.num_selected(p.numel()) if config.compresses(p.numel()) else 4 * p.numel()
               for p in model.parameters())


def powersgd_payload(model, rank):
    """Bytes per step PowerSGD of ``rank`` hands over (P and Q of each matrix that its
    ``min_compression_rate`` 2 compresses; the rest dense), fp32."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        compressed = p.ndim > 1 and (n + m) * r * 2 < n * m  # (its _should_compress)
        total += 4 * ((n + m) * r if compressed else p.numel())
    return total


def powersgd_rank(model, ratio):
    """The PowerSGD rank whose payload is closest to ScaleCom's at ``ratio`` (the smaller on a tie)."""
    target = scalecom_payload(model, ratio)
    widest = max(min(p.shape[0], p.numel() // p.shape[0]) for p in model.parameters() if p.ndim > 1)
    return min(range(1, widest + 1), key=lambda r: (abs(powersgd_payload(model, r) - target), r))


class HookPayload:
    """Bytes handed to ``torch.distributed.broadcast`` and ``all_reduce`` (which the hooks call)
    within each :meth:`run`; :meth:`stats` gives the last run's as ``sent_bytes``, the way a Horovod
    compressor's ``stats()`` gives its step's, for :func:`measure`."""

    def __init__(self):
        self.counted, self.last = 0, None
        for name in ("broadcast", "all_reduce"):
            setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, collective):
        def call(tensor, *args, **kwargs):
            self.counted += tensor.numel() * tensor.element_size()
            return collective(tensor, *args, **kwargs)
        return call

    def run(self, step):
        before = self.counted
        step()
        self.last = self.counted - before

    def stats(self):
        return {"sent_bytes": self.last}


class _Frontend:
    """torch.distributed as :func:`measure` expects a frontend module (``rank``, ``size``,
    ``allgather_object``)."""

    rank = staticmethod(dist.get_rank)
    size = staticmethod(dist.get_world_size)

    @staticmethod
    def allgather_object(obj, name=None):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered


def main(spec):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    # (the benchmark stops a job past its --timeout; this bounds a collective's wait on its own)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout", 900)))
    payload = HookPayload()
    model, batch, local_model, local_optimizer = setup(spec, dist.get_rank())
    name, kwargs = spec["compressor"], spec.get("kwargs", {})
    # PowerSGD's hook on Gloo fails when the reductions of two buckets overlap (docs/ddp.md): its
    # jobs keep the whole model in one bucket
    one_bucket = {"bucket_cap_mb": 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1}
    ddp = DDP(model, **(one_bucket if name == "ddp_powersgd" else {}))  # (broadcasts rank 0's weights)
    state, hook = HOOKS[name](model, kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    extra = {"powersgd_rank": state.matrix_approximation_rank} if name == "ddp_powersgd" else {}
    measure(spec, _Frontend, lambda: payload.run(lambda: sgd_step(ddp, optimizer, batch)),
            lambda: sgd_step(local_model, local_optimizer, batch), lambda tag: dist.barrier(),
            payload if hook is not None else None, False, sum(p.numel() for p in model.parameters()), extra)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    # Done: leave without the interpreter's finalization, in which torch 2.13's Gloo process group
    # aborted now and then ("terminate called without an active exception") after a complete job
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
