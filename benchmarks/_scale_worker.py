"""One Horovod worker of ``benchmarks.scale``: steps ScaleCom (or dense) on synthetic gradients that
the parent can regenerate; rank 0 prints ``RESULT {json}``.

    python benchmarks/_scale_worker.py SPEC_JSON

SPEC_JSON holds ``compression`` ("scalecom" or "dense"), ``ratio``, ``beta``, ``warmup_steps``,
``min_numel``, ``steps``, ``lr``, ``seed`` and ``out_dir``. The parameters are :data:`SHAPES`; the
loss at step t on rank r is ``sum_p <p, G_p(r, t)>``, so each gradient is :func:`gradient`'s seeded
normal tensor, whatever the weights. Each rank writes ``rank<R>.npz`` with ``initial/<name>`` and
``final/<name>`` (weights). Bytes on the wire come from the network namespace's loopback counter,
read by rank 0 between barriers around the measured steps (all ranks share that loopback: the parent divides
by the number of ranks).
"""

import json
import resource
import statistics
import sys
import time

import numpy as np
import torch

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"
# two compressed tensors (a 1M-entry one, so that the values and indices outweigh Horovod's own
# messages on the wire) and a dense one (below min_numel)
SHAPES = {"w1": (1024, 1024), "w2": (256, 64), "b": (64,)}


def gradient(name, rank, step, seed):
    """G_name(rank, step): the gradient of rank ``rank`` at step ``step`` (float32, seeded)."""
    index = list(SHAPES).index(name)
    gen = torch.Generator().manual_seed(((seed * 1009 + rank) * 100_003 + step) * 7 + index)
    return torch.randn(SHAPES[name], generator=gen)


def tx_bytes():
    try:
        with open(TX_BYTES) as f:
            return int(f.read())
    except OSError:
        return None


def barrier(hvd, name):
    hvd.allreduce(torch.zeros(1), name=name)


def main():
    import horovod.torch as hvd

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(spec["seed"])
    params = {name: torch.nn.Parameter(0.1 * torch.randn(shape)) for name, shape in SHAPES.items()}
    named = list(params.items())
    if spec["compression"] == "scalecom":
        from hvd_scalecom.torch import ScaleCom
        compression = ScaleCom(named, ratio=spec["ratio"], beta=spec["beta"],
                               warmup_steps=spec["warmup_steps"], min_numel=spec["min_numel"])
    else:
        compression = hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params.values(), lr=spec["lr"]),
                                         named_parameters=named, compression=compression)
    hvd.broadcast_parameters(params, root_rank=0)
    record = {f"initial/{n}": p.detach().numpy().copy() for n, p in named}

    # measured: the steps after the dense warm-up and the first compressed step (which also checks
    # that the ranks agree on the configuration)
    measure_from = spec["warmup_steps"] + 1
    times, sent_by_stats, sent_before = [], [], None
    for t in range(spec["steps"]):
        if t == measure_from:
            barrier(hvd, "before_steps")
            sent_before = tx_bytes() if rank == 0 else None
        grads = {name: gradient(name, rank, t, spec["seed"]) for name in SHAPES}  # (not timed)
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = sum((p * grads[name]).sum() for name, p in named)
        loss.backward()
        optimizer.step()
        if t < measure_from:
            continue
        times.append(time.perf_counter() - start)
        if spec["compression"] == "scalecom":
            sent_by_stats.append(compression.stats()["sent_bytes"])
    barrier(hvd, "after_steps")
    sent_after = tx_bytes() if rank == 0 else None

    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    all_rss = hvd.allgather(torch.tensor([rss_mb], dtype=torch.float64), name="rss").tolist()
    record.update({f"final/{n}": p.detach().numpy().copy() for n, p in named})
    np.savez(f"{spec['out_dir']}/rank{rank}.npz", **record)
    barrier(hvd, "written")
    if rank == 0:
        wire = None if sent_before is None or sent_after is None else sent_after - sent_before
        print("RESULT " + json.dumps({
            "ranks": size, "measured_steps": len(times), "step_seconds": statistics.median(times),
            "wire_bytes": wire, "rss_mb": all_rss,
            "stats_sent_bytes": statistics.median(sent_by_stats) if sent_by_stats else None,
            "dense_bytes": sum(p.numel() * p.element_size() for _, p in named)}), flush=True)


if __name__ == "__main__":
    main()
