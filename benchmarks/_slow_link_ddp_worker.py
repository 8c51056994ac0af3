"""One torchrun worker of ``benchmarks.slow_link``'s DDP jobs: the MLP and synthetic data of
``_slow_link_worker`` trained under DistributedDataParallel (Gloo) with a communication hook, warm-up
and timed steps, then the same step with no communication; rank 0 prints ``RESULT {json}`` in the
Horovod worker's format.

    python -m torch.distributed.run --nproc_per_node N benchmarks/_slow_link_ddp_worker.py SPEC_JSON

SPEC_JSON as for ``_slow_link_worker`` with ``compressor`` a key of ``HOOKS``. The payload per step
(``compressor_stats.sent_bytes``) is counted in the torch.distributed calls the hooks make
(``broadcast``, ``all_reduce``) during the backward pass; DDP's own reduction (``ddp_dense``) makes
them in C++, so it is the model's fp32 gradient size.
"""

import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks._slow_link_worker import make_model, read_tx  # noqa: E402


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


def main(spec):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    counted = [0]
    for name in ("broadcast", "all_reduce"):
        collective = getattr(dist, name)

        def call(tensor, *args, _collective=collective, **kwargs):
            counted[0] += tensor.numel() * tensor.element_size()
            return _collective(tensor, *args, **kwargs)
        setattr(dist, name, call)
    torch.manual_seed(0)
    widths = spec["widths"]
    model = make_model(widths)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["batch"], widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (spec["batch"],), generator=gen)
    local_model = copy.deepcopy(model)
    local_optimizer = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
    name, kwargs = spec["compressor"], spec.get("kwargs", {})
    # PowerSGD's hook on Gloo fails when the reductions of two buckets overlap (docs/ddp.md): its
    # jobs keep the whole model in one bucket
    one_bucket = {"bucket_cap_mb": 4 * sum(p.numel() for p in model.parameters()) / 2**20 + 1}
    ddp = DDP(model, **(one_bucket if name == "ddp_powersgd" else {}))
    state, hook = HOOKS[name](model, kwargs)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step(net, opt):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()

    for _ in range(spec["warmup"]):
        step(ddp, optimizer)
    dist.barrier()
    tx_start = read_tx()
    times, payloads = [], []
    for _ in range(spec["steps"]):
        before = counted[0]
        start = time.perf_counter()
        step(ddp, optimizer)
        times.append(time.perf_counter() - start)
        payloads.append(counted[0] - before)
    dist.barrier()
    tx_end = read_tx()
    step(local_model, local_optimizer)
    dist.barrier()
    floor = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step(local_model, local_optimizer)
        floor.append(time.perf_counter() - start)
    floors = [None] * size
    dist.all_gather_object(floors, statistics.median(floor))
    if rank != 0:
        dist.destroy_process_group()
        return
    params = sum(p.numel() for p in model.parameters())
    sent = statistics.median(payloads) if hook is not None else 4 * params
    result = {
        "compressor": name, "kwargs": kwargs, "workers": size, "rank": rank, "parameters": params,
        "dense_bytes": 4 * params, "step_seconds": times, "median_step_seconds": statistics.median(times),
        "step_statistic": "median", "floor_seconds": statistics.median(floors),
        "tx_bytes": None if tx_start is None or tx_end is None else tx_end - tx_start, "steps": spec["steps"],
        "compressor_stats": {"sent_bytes": sent},
    }
    if name == "ddp_powersgd":
        result["powersgd_rank"] = state.matrix_approximation_rank
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
