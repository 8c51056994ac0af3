"""One Horovod worker of ``benchmarks.slow_link``: trains a model of ``benchmarks.models`` on
synthetic data for warm-up and timed steps, then times the same step with no communication, and rank
0 prints ``RESULT {json}``.

    python benchmarks/_slow_link_worker.py SPEC_JSON

SPEC_JSON holds ``compressor`` (a key of ``COMPRESSORS`` or ``OPTIMIZER_WRAPPERS``), ``kwargs``
(passed to its factory), ``model``, ``size`` and ``widths`` (see ``benchmarks.models``), ``batch``,
``warmup``, ``steps``, ``nic`` (the interface whose counters give the bytes on the wire) and
``link``: ``per-worker`` (every worker has its own ``nic``: each reads its own ``tx_bytes`` and
``rx_bytes``) or ``shared-loopback`` (all share one ``lo``: its counter is everyone's). Each worker
reads its counters between barriers around the timed steps (the totals) and before and after each
timed step (per step: a collective still in flight at a step's end counts in the next). The floor is
a copy of the model (taken before Horovod hooks its parameters) stepped with a plain optimizer by
every rank at once right after the timed steps: the same step, the same processes sharing the same
cores, no gradient exchange.

The DistributedDataParallel worker (``_slow_link_ddp_worker``) builds its model, batch and floor
copy with :func:`setup`, steps with :func:`sgd_step` and measures with :func:`measure`, as this one.
"""

import copy
import json
import statistics
import sys
import time

import torch

from benchmarks.models import build_model, make_batch, make_mlp, task_loss

make_model = make_mlp  # (the MLP of given widths, as other benchmarks size it)


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


def read_counters(nic):
    """``(tx_bytes, rx_bytes)`` of ``nic`` in this process's network namespace."""
    values = []
    for direction in ("tx", "rx"):
        with open(f"/sys/class/net/{nic}/statistics/{direction}_bytes") as f:
            values.append(int(f.read()))
    return tuple(values)


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


def setup(spec, rank):
    """The job's model (seed 0: the same on every rank), ``rank``'s synthetic batch ``(x, y)``, and a
    copy of the model (taken before a framework hooks its parameters) with a plain SGD optimizer for
    the floor."""
    torch.manual_seed(0)
    model_name, model_size, widths = spec.get("model", "mlp"), spec.get("size", "full"), spec.get("widths")
    model = build_model(model_name, model_size, widths)
    batch = make_batch(model_name, model_size, spec["batch"], torch.Generator().manual_seed(1000 + rank), widths)
    local_model = copy.deepcopy(model)
    local_optimizer = torch.optim.SGD(local_model.parameters(), lr=0.01, momentum=0.9)
    return model, batch, local_model, local_optimizer


def sgd_step(net, optimizer, batch):
    """One training step of ``net`` on ``batch``."""
    optimizer.zero_grad()
    task_loss(net(batch[0]), batch[1]).backward()
    optimizer.step()


def measure(spec, hvd, train_step, local_step, barrier, compression, wrapper, parameters, extra=None):
    """Warm-up, timed steps (counters and statistics around them), then the floor; rank 0 prints
    ``RESULT {json}`` (with ``extra``'s items). ``train_step()`` and ``local_step()`` run one step of
    the job and of the copy without communication; ``barrier(tag)`` is a tiny allreduce; ``hvd`` the
    frontend's module (``rank``, ``size``, ``allgather_object``); ``compression``'s ``stats()``, if
    it has one, gives each step's payload. Shared by the torch, TensorFlow and DDP workers."""
    rank, size = hvd.rank(), hvd.size()
    nic, per_worker = spec.get("nic", "lo"), spec.get("link", "shared-loopback") == "per-worker"
    for _ in range(spec["warmup"]):
        train_step()
    barrier("start")
    counters_start = read_counters(nic)
    totals_start = _totals(compression) if wrapper else None
    times, per_step, wire_steps = [], [], []
    for _ in range(spec["steps"]):
        before = read_counters(nic)
        start = time.perf_counter()
        train_step()
        times.append(time.perf_counter() - start)
        after = read_counters(nic)
        wire_steps.append([a - b for a, b in zip(after, before)])
        stats = _step_stats(compression)
        if stats is not None:
            per_step.append(stats)
    barrier("end")
    counters_end = read_counters(nic)
    if wrapper:  # per-step means over the timed steps (a synchronisation every few steps)
        totals_end = _totals(compression)
        per_step = [{k: (totals_end[k] - totals_start[k]) / spec["steps"]
                     for k in ("sent_bytes", "index_wait_seconds", "compress_seconds")
                     if totals_end.get(k) is not None}]
    # each worker's bytes: its totals between the barriers and its bytes in each timed step
    wire = {"tx_bytes": counters_end[0] - counters_start[0], "rx_bytes": counters_end[1] - counters_start[1],
            "tx_steps": [s[0] for s in wire_steps], "rx_steps": [s[1] for s in wire_steps]}
    wire = hvd.allgather_object(wire, name="slow_link.wire")
    local_step()  # warm-up
    barrier("floor")
    floor = []
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        local_step()
        floor.append(time.perf_counter() - start)
    floor = hvd.allgather_object(statistics.median(floor), name="slow_link.floor")
    if rank != 0:
        return
    result = {
        "compressor": spec["compressor"], "kwargs": spec.get("kwargs", {}), "workers": size,
        "rank": rank, "model": spec.get("model", "mlp"), "framework": spec.get("framework", "torch"),
        "parameters": parameters, "dense_bytes": 4 * parameters,
        "step_seconds": times,
        # the median step, or for an optimizer wrapper the mean (its synchronisations are rare steps)
        "median_step_seconds": statistics.fmean(times) if wrapper else statistics.median(times),
        "step_statistic": "mean" if wrapper else "median",
        "floor_seconds": statistics.median(floor),
        "link": "per-worker" if per_worker else "shared-loopback",
        # all workers' bytes sent over the timed steps: the sum of their own links', or the one
        # shared loopback's (every worker read the same counter)
        "tx_bytes": sum(w["tx_bytes"] for w in wire) if per_worker else wire[0]["tx_bytes"],
        "wire": wire if per_worker else None,
        "steps": spec["steps"],
    }
    result.update(extra or {})
    if per_step:
        result["compressor_stats"] = {k: statistics.median(s[k] for s in per_step)
                                      for k in per_step[0] if per_step[0][k] is not None}
    print("RESULT " + json.dumps(result), flush=True)


def main(spec):
    import horovod.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, batch, local_model, local_optimizer = setup(spec, hvd.rank())
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
    measure(spec, hvd, lambda: sgd_step(model, optimizer, batch),
            lambda: sgd_step(local_model, local_optimizer, batch),
            lambda tag: hvd.allreduce(torch.zeros(1), name=f"slow_link.barrier.{tag}"), compression, wrapper,
            sum(p.numel() for p in model.parameters()))


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
