"""One Horovod worker of ``benchmarks.slow_link``: trains an MLP on synthetic data for warm-up and
timed steps, then times the same step with no communication, and rank 0 prints ``RESULT {json}``.

    python benchmarks/_slow_link_worker.py SPEC_JSON

SPEC_JSON holds ``compressor`` (a key of ``COMPRESSORS``), ``kwargs`` (passed to the compressor's
factory), ``widths``, ``batch``, ``warmup`` and ``steps``. Bytes on the wire come from the network
namespace's loopback counter, read by rank 0 between barriers around the timed steps. The floor is a
copy of the model (taken before Horovod hooks its parameters) stepped with a plain optimizer by
every rank at once right after the timed steps: the same step, the same processes sharing the same
cores, no gradient exchange.
"""

import copy

import json
import statistics
import sys
import time

import torch

TX_BYTES = "/sys/class/net/lo/statistics/tx_bytes"


def _dense(hvd, model, kwargs):
    return hvd.Compression.none


def _fp16(hvd, model, kwargs):
    return hvd.Compression.fp16


def _scalecom(hvd, model, kwargs):
    from hvd_scalecom.torch import ScaleCom
    return ScaleCom(model.named_parameters(), **kwargs)


def _sketched(hvd, model, kwargs):
    from hvd_scalecom.torch import SketchedSGD
    return SketchedSGD(model.named_parameters(), **kwargs)


def _qsparse(model, optimizer, kwargs):
    from hvd_scalecom.torch import QsparseLocalSGD
    return QsparseLocalSGD(optimizer, model.named_parameters(), **kwargs)


# A new scheme is one more entry: name -> factory(hvd, model, kwargs) returning a Horovod compressor.
# Per-step statistics are read from the compressor's stats() when it has one (see _step_stats).
COMPRESSORS = {"dense": _dense, "fp16": _fp16, "scalecom": _scalecom, "sketched": _sketched}
# Schemes that wrap the optimizer instead (name -> factory(model, optimizer, kwargs)): they
# synchronise every few steps, so their step time and bytes are means over the timed steps.
OPTIMIZER_WRAPPERS = {"qsparse": _qsparse}
# Schemes whose factory takes no options (a JSON given to one is refused, not ignored).
NO_OPTIONS = {"dense", "fp16"}
# Sketched SGD keeps the momentum inside the sketch (Ivkin et al.): its optimizer has none.
OWN_MOMENTUM = {"sketched"}


def make_model(widths):
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(torch.nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def read_tx():
    try:
        with open(TX_BYTES) as f:
            return int(f.read())
    except OSError:
        return None


def _step_stats(compression):
    stats = getattr(compression, "stats", None)
    if not callable(stats):
        return None
    s = stats()
    return {"sent_bytes": s.get("sent_bytes"), "index_wait_seconds": s.get("index_wait_seconds"),
            "compress_seconds": s.get("compress_seconds"), "tensors": s.get("tensors")}


def _totals(compression):
    stats = getattr(compression, "stats", None)
    return stats()["total"] if callable(stats) else None


def main(spec):
    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(0)
    widths = spec["widths"]
    model = make_model(widths)
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(spec["batch"], widths[0], generator=gen)
    y = torch.randint(0, widths[-1], (spec["batch"],), generator=gen)
    local_model = copy.deepcopy(model)  # no Horovod hooks on its parameters
    local_optimizer = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
    name, kwargs = spec["compressor"], spec.get("kwargs", {})
    momentum = 0.0 if name in OWN_MOMENTUM else 0.9
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    wrapper = name in OPTIMIZER_WRAPPERS
    if wrapper:
        optimizer = compression = OPTIMIZER_WRAPPERS[name](model, optimizer, kwargs)
    else:
        compression = COMPRESSORS[name](hvd, model, kwargs)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)

    def barrier(tag):
        hvd.allreduce(torch.zeros(1), name=f"slow_link.barrier.{tag}")

    def step(net, opt):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss

    for _ in range(spec["warmup"]):
        step(model, optimizer)
    barrier("start")
    tx_start = read_tx()
    totals_start = _totals(compression) if wrapper else None
    times, per_step = [], []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step(model, optimizer)
        times.append(time.perf_counter() - start)
        stats = _step_stats(compression)
        if stats is not None:
            per_step.append(stats)
    barrier("end")
    tx_end = read_tx()
    if wrapper:  # per-step means over the timed steps (a synchronisation every few steps)
        totals_end = _totals(compression)
        per_step = [{k: (totals_end[k] - totals_start[k]) / spec["steps"]
                     for k in ("sent_bytes", "index_wait_seconds", "compress_seconds")
                     if totals_end.get(k) is not None}]
    step(local_model, local_optimizer)  # warm-up
    barrier("floor")
    floor = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        step(local_model, local_optimizer)
        floor.append(time.perf_counter() - start)
    floor = hvd.allgather_object(statistics.median(floor), name="slow_link.floor")
    if rank != 0:
        return
    params = sum(p.numel() for p in model.parameters())
    result = {
        "compressor": spec["compressor"], "kwargs": spec.get("kwargs", {}), "workers": size,
        "rank": rank, "parameters": params, "dense_bytes": 4 * params,
        "step_seconds": times,
        # the median step, or for an optimizer wrapper the mean (its synchronisations are rare steps)
        "median_step_seconds": statistics.fmean(times) if wrapper else statistics.median(times),
        "step_statistic": "mean" if wrapper else "median",
        "floor_seconds": statistics.median(floor),
        "tx_bytes": None if tx_start is None or tx_end is None else tx_end - tx_start,
        "steps": spec["steps"],
    }
    if per_step:
        result["compressor_stats"] = {k: statistics.median(s[k] for s in per_step)
                                      for k in per_step[0] if per_step[0][k] is not None}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
