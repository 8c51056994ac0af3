"""One rank of a small Sketched SGD training run (hvd.DistributedOptimizer + SketchedSGD) under horovodrun.

argv: JSON options, output directory. Writes ``rank<R>.npz`` with, per step t and parameter name,
``raw/<t>/<name>`` (this rank's gradient, computed apart so Horovod cannot touch it),
``applied/<t>/<name>`` (the gradient the optimizer applied), ``stats/<t>`` (``stats(step=t)`` as JSON),
``final/<name>`` (weights) and ``stats`` (``stats()`` after the last step). With ``skew_steps``
(``{rank: step}``) those ranks start from a state of that step and ``refused`` holds the error of the
first step; with ``skew_steps_at`` (``{rank: step}``) at the top of that step those ranks' step
counters move one ahead, through their own ``state_dict()`` and ``load_state_dict()``, and ``refused``
holds the error of the step; with ``loss_scales`` (one per step) the loss is scaled, ``loss_scaler=``
follows it, and the
reduced gradients are divided by it before the step (``applied``: unscaled); with ``frozen`` (a name)
that parameter is frozen before SketchedSGD and the optimizer are built (no ``applied`` entries).
``per_rank`` (``{rank: options}``) applies to every option (``dtype`` too; ``no_loss_scaler``: the loss
scale schedule without SketchedSGD's ``loss_scaler``); with ``expect_refusal`` a ValueError of the first
backward pass is recorded (``refused``) and the run stops. ``direct_allreduce``: no
hvd.DistributedOptimizer, the gradients reduced by ``hvd.grouped_allreduce(..., compression=...)``, and
from step ``single_at`` on by one ``hvd.allreduce(p.grad, compression=...)`` each: its error is recorded
(``refused``), with whether SketchedSGD's state is as before the step (``state_unchanged``).
``step_outside_skip_at`` (steps): there ``optimizer.synchronize()``, then ``optimizer.step()`` outside
``skip_synchronize()``, its error in ``refused/<t>`` (with ``state_unchanged/<t>``), then the step inside it.
"""

import json
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch
from states import same  # (tests/workers/states.py)

from hvd_scalecom.torch import SketchedSGD

torch.set_num_threads(1)
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
opts = {**opts, **opts.get("per_rank", {}).get(str(rank), {})}  # deliberately disagreeing ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(48, 64)   # weight 3072 entries, bias 64
        self.out = torch.nn.Linear(64, 10)      # weight 640, bias 10

    def forward(self, x, detach_out_weight=False):
        h = torch.tanh(self.hidden(x))
        if detach_out_weight:  # out.weight gets no gradient: Horovod reduces zeros for it later
            return torch.nn.functional.linear(h, self.out.weight.detach(), self.out.bias)
        return self.out(h)


torch.manual_seed(0)
model = Net()
if opts.get("dtype"):
    model = model.to(getattr(torch, opts["dtype"]))
if opts.get("frozen"):
    dict(model.named_parameters())[opts["frozen"]].requires_grad_(False)
named = list(model.named_parameters())
params = [p for _, p in named]
trained = [p for p in params if p.requires_grad]


class StepScale:
    """The loss scale of the current step (as torch.amp.GradScaler's get_scale())."""
    scale = 1.0

    def get_scale(self):
        return self.scale


scaler = StepScale() if opts.get("loss_scales") else None
compression = SketchedSGD(model.named_parameters(), ratio=opts.get("ratio", 0.02), rows=opts.get("rows", 3),
                          columns=opts.get("columns", 400), candidates=opts.get("candidates", 2),
                          momentum=opts.get("momentum", 0.9), warmup_steps=opts.get("warmup_steps", 0),
                          min_numel=opts.get("min_numel", 600), seed=opts.get("seed", 0),
                          loss_scaler=None if opts.get("no_loss_scaler") else scaler)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=opts.get("optimizer_momentum", 0.0))
compression.check_optimizer(optimizer)
passes = opts.get("backward_passes_per_step", 1)
direct = opts.get("direct_allreduce")
optimizer = optimizer if direct else hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression,
    backward_passes_per_step=passes,
    groups=[[model.hidden.weight, model.out.weight]] if opts.get("groups") else None,
    gradient_predivide_factor=opts.get("gradient_predivide_factor", 1.0),
    op=hvd.Sum if opts.get("op") == "sum" else hvd.Average)
if not opts.get("dtype"):  # (Horovod broadcasts no bfloat16; every rank starts alike from the seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

if opts.get("resume_from"):
    saved = torch.load(os.path.join(opts["resume_from"], f"ckpt{rank}.pt"))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if not opts.get("forget_compression_state"):
        compression.load_state_dict(saved["compression"])

if str(rank) in opts.get("skew_steps", {}):  # this rank alone resumes from a state of another step
    skewed = compression.state_dict()
    for entry in skewed["params"].values():
        entry["step"] = opts["skew_steps"][str(rank)]
    compression.load_state_dict(skewed)


nan_at = {(t, r): name for t, r, name in opts.get("nan_at", [])}  # (step, rank): entry 7 of name is NaN


def poisoned(grad):
    grad = grad.clone()
    grad.view(-1)[7] = float("nan")
    return grad


record = {}
first_step = opts.get("first_step", 0)
for t in range(first_step, first_step + opts.get("steps", 6)):
    if opts.get("skew_steps_at", {}).get(str(rank)) == t:  # a state of the next step, mid-job
        skewed = compression.state_dict()
        for entry in skewed["params"].values():
            entry["step"] += 1
        compression.load_state_dict(skewed)
    raw = [torch.zeros_like(p) for p in params]
    if scaler is not None:
        scaler.scale = opts["loss_scales"][t - first_step]
    poison = dict(named)[nan_at[t, rank]].register_hook(poisoned) if (t, rank) in nan_at else None
    for k in range(passes):
        data_gen = torch.Generator().manual_seed(10000 * t + 100 * k + rank)
        x = torch.randn(16, 48, generator=data_gen).to(params[0].dtype)
        y = torch.randint(0, 10, (16,), generator=data_gen)
        no_grad = rank == opts.get("no_out_weight_grad_on_rank") and t % 2 == 1

        def loss_fn():
            return torch.nn.functional.cross_entropy(model(x, no_grad), y)

        grads = iter(torch.autograd.grad(loss_fn(), trained, allow_unused=True))
        for acc, p in zip(raw, params):
            g = next(grads) if p.requires_grad else None
            if g is not None:
                acc += g
        try:
            (loss_fn() * (1.0 if scaler is None else scaler.scale)).backward()
        except ValueError as err:
            if not (opts.get("skew_steps") or opts.get("expect_refusal")):
                raise
            record["refused"] = np.array(str(err))
            break
    if "refused" in record:
        break
    if poison is not None:
        poison.remove()
    if direct and t >= opts.get("single_at", float("inf")):  # one gradient at a time
        before = compression.state_dict()
        try:
            for name, p in named:
                p.grad.copy_(hvd.allreduce(p.grad, name=f"direct.{name}", compression=compression))
        except RuntimeError as err:
            record["refused"] = np.array(str(err))
            record["state_unchanged"] = np.array(same(before, compression.state_dict()))
            break
        optimizer.step()
    elif direct:  # every gradient in one grouped allreduce
        reduced = hvd.grouped_allreduce([p.grad for p in params], name="direct", compression=compression)
        for p, g in zip(params, reduced):
            p.grad.copy_(g)
        optimizer.step()
    elif scaler is not None:  # as GradScaler.unscale_ before its step
        optimizer.synchronize()
        for p in params:
            p.grad.div_(scaler.scale)
        with optimizer.skip_synchronize():
            optimizer.step()
    elif t in opts.get("step_outside_skip_at", []):  # step() after synchronize(), outside skip_synchronize()
        optimizer.synchronize()
        before = compression.state_dict()
        try:
            optimizer.step()  # Horovod warns and reduces every gradient again
        except RuntimeError as err:
            record[f"refused/{t}"] = np.array(str(err))
            record[f"state_unchanged/{t}"] = np.array(same(before, compression.state_dict()))
        with optimizer.skip_synchronize():  # the step as it should be
            optimizer.step()
    elif opts.get("skew_steps_at"):
        try:
            optimizer.step()
        except RuntimeError as err:
            record["refused"] = np.array(str(err))
            break
    elif not nan_at:
        optimizer.step()
    else:  # a non-finite reduced gradient skips the step, as a loss scaler would
        optimizer.synchronize()
        if all(bool(torch.isfinite(p.grad).all()) for p in params):
            with optimizer.skip_synchronize():
                optimizer.step()
    for (name, p), r in zip(named, raw):
        record[f"raw/{t}/{name}"] = r.float().numpy()
        if p.grad is not None:
            record[f"applied/{t}/{name}"] = p.grad.float().numpy()
    record["applied_dtype"] = np.array(str(params[-1].grad.dtype))
    record[f"stats/{t}"] = np.array(json.dumps(compression.stats(step=t)))
    optimizer.zero_grad()

for name, p in named:
    record[f"final/{name}"] = p.detach().float().numpy()
record["stats"] = np.array(json.dumps(compression.stats()))
record["gloo"] = np.array(hvd.gloo_enabled())  # (the controller the job runs under: --gloo or --mpi)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
if opts.get("checkpoint"):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "compression": compression.state_dict()}, os.path.join(out_dir, f"ckpt{rank}.pt"))
hvd.allreduce(torch.zeros(1), name="worker.done")  # no rank leaves while others still reduce
print(f"rank {rank} done", flush=True)
