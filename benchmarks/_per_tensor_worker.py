"""One Horovod worker of ``benchmarks.per_tensor``: times the backward pass and ``synchronize()`` of
a model of many same-sized parameters under each compression, and ScaleCom's own compute per tensor.

    python benchmarks/_per_tensor_worker.py RESULT.json --sizes 4096 --tensors 64 --steps 40 --warmup 5

For each size, every compression gets a model of its own (``--tensors`` parameters of that many
entries; the loss ``sum_i (w_i * x_i).sum()`` makes each gradient ``x_i``, drawn afresh from a pool
of three) and its own ``hvd.DistributedOptimizer``; the compressions take turns step by step. A step
is ``zero_grad``, ``backward`` (the gradient hooks, where the compressor runs) and ``synchronize``,
timed on every rank after a barrier; the step time is the slowest rank's. ScaleCom's ``stats(step)``
give its compute (``compress`` and
``decompress``, index waits excluded) and its waits for the leader's indices, split by whether the
rank led the step (with the cyclic leader every tensor of step t has the leader t mod size). Rank
0 writes ``RESULT.json``.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

from hvd_scalecom.torch import ScaleCom  # noqa: E402

SCHEMES = ("dense", "fp16", "scalecom", "scalecom, broadcast", "scalecom, pipelined")


def compression_for(scheme, named, ratio):
    if scheme == "dense":
        return hvd.Compression.none
    if scheme == "fp16":
        return hvd.Compression.fp16
    return ScaleCom(named, ratio=ratio, beta=0.1, pipelined=scheme.endswith("pipelined"),
                    index_exchange="broadcast" if scheme.endswith("broadcast") else "allgather")


def build(scheme, index, numel, tensors, ratio):
    """One model of ``tensors`` parameters of ``numel`` entries, its compression and its optimizer."""
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    named = [(f"s{index}.w{i}", p) for i, p in enumerate(params)]
    compression = compression_for(scheme, named, ratio)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.0), named_parameters=named,
                                         compression=compression)
    return params, compression, optimizer


def time_step(params, optimizer, inputs):
    """The slowest rank's seconds for one backward pass and ``synchronize()``."""
    optimizer.zero_grad()
    hvd.allreduce(torch.zeros(1), name="per_tensor.barrier")
    start = time.perf_counter()
    loss = sum((w * x).sum() for w, x in zip(params, inputs))
    loss.backward()
    optimizer.synchronize()
    elapsed = time.perf_counter() - start
    with optimizer.skip_synchronize():
        optimizer.step()
    return float(hvd.allreduce(torch.tensor([elapsed], dtype=torch.float64), op=hvd.Max,
                               name="per_tensor.elapsed"))


def time_schemes(numel, tensors, pool, args):
    """Per scheme: the slowest rank's seconds per step, and (ScaleCom) this rank's stats of each step.
    The schemes take turns step by step, in an order that rotates, so that a slow spell of the shared
    machine falls on all of them alike."""
    models = [build(scheme, i, numel, tensors, args.ratio) for i, scheme in enumerate(SCHEMES)]
    seconds = {scheme: [] for scheme in SCHEMES}
    stats = {scheme: [] for scheme in SCHEMES}
    for step in range(args.warmup + args.steps):
        inputs = pool[step % len(pool)]
        for turn in range(len(SCHEMES)):
            i = (step + turn) % len(SCHEMES)
            params, compression, optimizer = models[i]
            elapsed = time_step(params, optimizer, inputs)
            if step >= args.warmup:
                seconds[SCHEMES[i]].append(elapsed)
                if isinstance(compression, ScaleCom):
                    stats[SCHEMES[i]].append({"led": step % hvd.size() == hvd.rank(), **compression.stats(step)})
    return seconds, stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("result")
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    ap.add_argument("--tensors", type=int, nargs="+", required=True, help="one per size")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--warmup", type=int, required=True)
    ap.add_argument("--ratio", type=float, default=0.01)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    rows = []
    for numel, tensors in zip(args.sizes, args.tensors):
        pool = [[torch.randn(numel, generator=gen) for _ in range(tensors)] for _ in range(3)]
        seconds, stats = time_schemes(numel, tensors, pool, args)
        for scheme in SCHEMES:
            gathered = hvd.allgather_object(stats[scheme])
            per_role = {}
            for role, led in (("leader", True), ("non-leader", False)):
                mine = [s for rank_stats in gathered for s in rank_stats if s["led"] is led]
                if mine:
                    per_role[role] = {
                        "compute_us": statistics.median(1e6 * s["compress_seconds"] / s["tensors"] for s in mine),
                        "wait_us": statistics.median(1e6 * s["index_wait_seconds"] / s["tensors"] for s in mine)}
            rows.append({"numel": numel, "tensors": tensors, "scheme": scheme,
                         "step_ms": 1e3 * statistics.median(seconds[scheme]), "per_tensor": per_role})
    if hvd.rank() == 0:
        with open(args.result, "w") as f:
            json.dump({"size": hvd.size(), "rows": rows}, f)


if __name__ == "__main__":
    main()
