"""Tie the simulator to reality: the digits example under ``horovodrun -np 4`` and the simulator
replaying the same recipe.

The job is ``examples/pytorch_scalecom.py`` (Gloo, one thread per rank): rank r trains on
``train[r::n]`` in batches drawn from a fresh ``torch.randperm`` per epoch (generator seeded
``1000 * seed + r``), SGD with momentum at the per-worker ``lr`` scaled by n (or sqrt n), the model
seeded by ``torch.manual_seed(seed)``. :func:`replay` runs exactly that recipe in
:class:`hvd_scalecom.sim.Simulator` (same initial weights, same batches on every worker, same
optimizer), so both should end at the same accuracy and loss up to floating-point summation order,
with the same payload bytes per step. ``benchmarks.recipe`` sweeps it.
"""

import json
import math
import os
import re
import tempfile
import time

import torch

from benchmarks.convergence_tasks import digits_mlp, digits_split
from devtools.launch import run, split_by_rank
from hvd_scalecom.sim import Dense, ScaleCom, Simulator, per_worker_gradients

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_scalecom.py")
_EPOCH = re.compile(r"epoch\s+(\d+)/\d+\s+loss\s+([0-9.eE+-]+)\s+test accuracy\s+([0-9.]+)%")


def example_args(compression, epochs, ratio, beta, seed=0, batch=32, lr=0.05, momentum=0.9):
    return ["--compression", compression, "--epochs", str(epochs), "--ratio", str(ratio), "--beta", str(beta),
            "--min-numel", "1024", "--batch-size", str(batch), "--lr", str(lr), "--momentum", str(momentum),
            "--seed", str(seed)]


def horovod_job(compression, workers, epochs, ratio, beta, timeout=900):
    """Run the example under ``horovodrun -np workers --gloo``; rank 0's result dict and wall seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        start = time.perf_counter()
        output = run([EXAMPLE, *example_args(compression, epochs, ratio, beta), "--result", path],
                     np=workers, controller="gloo", timeout=timeout)
        wall = time.perf_counter() - start
        with open(path) as f:
            result = json.load(f)
    result["wall_seconds"] = wall
    result["per_epoch"] = [{"epoch": int(m.group(1)), "loss": float(m.group(2)), "accuracy": float(m.group(3)) / 100}
                           for m in _EPOCH.finditer(split_by_rank(output).get(0, output))]
    return result


def replay(compression, workers, epochs, ratio, beta, seed=0, batch=32, lr=0.05, momentum=0.9, *,
           lr_scaling="linear", warmup_steps=0, lr_warmup=0, trace=False):
    """The example's recipe in the simulator: final accuracy, last epoch's mean loss, payload bytes.

    As the example's options: ``lr`` per worker, scaled by ``workers`` (``lr_scaling="linear"``) or
    ``sqrt(workers)`` (``"sqrt"``); ``warmup_steps`` dense steps before ScaleCom compresses. Beyond
    the example: ``lr_warmup`` steps of a linear learning-rate warm-up (step t uses
    ``min(1, (t + 1) / lr_warmup)`` of the scaled rate; 0 for none). ``trace=True`` adds ``trace``:
    per step the loss, the norm of the aggregated update and the norm of the residue memories
    ``m_i`` over all workers (Alg. 1's ``m``; 0 for dense).
    """
    if lr_scaling not in ("linear", "sqrt"):
        raise ValueError(f"lr_scaling must be 'linear' or 'sqrt', got {lr_scaling!r}")
    if warmup_steps < 0 or lr_warmup < 0:
        raise ValueError(f"warmup_steps and lr_warmup must be >= 0, got {warmup_steps} and {lr_warmup}")
    x_train, y_train, x_test, y_test = digits_split()
    torch.manual_seed(seed)
    model = digits_mlp()
    scheme = Dense() if compression == "dense" else \
        ScaleCom(ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=1024)
    sim = Simulator(scheme, workers, model.named_parameters(), diagnostics=False)
    peak_lr = lr * (workers if lr_scaling == "linear" else workers ** 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=peak_lr, momentum=momentum)
    shards = [(x_train[r::workers], y_train[r::workers]) for r in range(workers)]
    generators = [torch.Generator().manual_seed(seed * 1000 + r) for r in range(workers)]
    steps_per_epoch = len(x_train) // workers // batch  # from the smallest shard, as the example
    if steps_per_epoch == 0:
        raise ValueError(f"batch {batch} is larger than the smallest shard ({len(x_train) // workers} images)")
    loss_fn = torch.nn.functional.cross_entropy
    start, cpu = time.perf_counter(), time.process_time()
    per_epoch, steps = [], []
    t = 0
    for epoch in range(epochs):
        orders = [torch.randperm(len(x), generator=g) for (x, _), g in zip(shards, generators)]
        losses = []
        for step in range(steps_per_epoch):
            if lr_warmup:
                for group in optimizer.param_groups:
                    group["lr"] = peak_lr * min(1.0, (t + 1) / lr_warmup)
            take = [o[step * batch:(step + 1) * batch] for o in orders]
            x = torch.stack([shards[r][0][take[r]] for r in range(workers)])
            y = torch.stack([shards[r][1][take[r]] for r in range(workers)])
            with torch.no_grad():
                losses.append(sum(float(loss_fn(model(x[r]), y[r])) for r in range(workers)) / workers)
            grads = per_worker_gradients(model, loss_fn, sim.worker_params(), x, y)
            result = sim.step_stacked(grads)
            result.apply_to(model.parameters(), optimizer)
            if trace:
                memories = [entry["memory"] for entry in sim.scheme.state.values() if "memory" in entry]
                steps.append({"step": t, "loss": losses[-1],
                              "update_norm": _norm(result.update), "memory_norm": _norm(memories)})
            t += 1
        with torch.no_grad():
            accuracy = float((model(x_test).argmax(dim=1) == y_test).float().mean())
        per_epoch.append({"epoch": epoch + 1, "loss": sum(losses) / len(losses), "accuracy": accuracy})
    out = {"per_epoch": per_epoch, "compression": compression, "workers": workers, "accuracy": accuracy,
           "loss": sum(losses) / len(losses), "payload_bytes_last_step": sim.history[-1]["payload_bytes"],
           "sent_bytes_last_step": sim.history[-1]["sent_bytes"],
           "payload_bytes_total": sum(h["payload_bytes"] for h in sim.history), "steps": len(sim.history),
           "peak_lr": peak_lr, "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}
    if trace:
        out["trace"] = steps
    return out


def _norm(tensors):
    """The 2-norm of a list of tensors taken as one vector."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def first_difference(job, sim):
    """The first epoch whose test accuracy differs, or whose loss differs by more than the example's
    printed precision (4 decimals) and 1 % of its value; None if none does."""
    for a, b in zip(job["per_epoch"], sim["per_epoch"]):
        if round(a["accuracy"], 4) != round(b["accuracy"], 4) or abs(a["loss"] - b["loss"]) > 1e-4 + 0.01 * b["loss"]:
            return a["epoch"]
    return None


def compare(workers=4, epochs=15, ratio=0.01, beta=0.1, progress=print):
    """Dense and ScaleCom, each as two identical horovodrun jobs and as the simulator's replay."""
    rows = []
    for compression in ("dense", "scalecom"):
        job = horovod_job(compression, workers, epochs, ratio, beta)
        again = horovod_job(compression, workers, epochs, ratio, beta)  # the same command once more
        sim = replay(compression, workers, epochs, ratio, beta)
        rows.append({"compression": compression, "workers": workers, "epochs": epochs, "ratio": ratio,
                     "beta": beta, "horovod": job, "horovod_again": again, "simulator": sim,
                     "first_different_epoch": first_difference(job, sim),
                     "first_different_epoch_between_jobs": first_difference(job, again)})
        progress(f"horovodrun -np {workers} {compression}: accuracy {100 * job['accuracy']:.2f}% "
                 f"(again {100 * again['accuracy']:.2f}%) "
                 f"(simulator {100 * sim['accuracy']:.2f}%), loss {job['loss']:.4f} "
                 f"(simulator {sim['loss']:.4f}), payload bytes/step {job['sent_bytes_last_step']:,} "
                 f"(simulator {sim['payload_bytes_last_step']:,.0f}), {job['wall_seconds']:.0f} s wall")
    return rows
