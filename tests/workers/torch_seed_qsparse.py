"""One rank of a small Qsparse-local-SGD training run (QsparseLocalSGD around torch.optim.SGD) under
horovodrun.

argv: JSON options, output directory. Writes ``rank<R>.npz`` with, per step t and parameter name,
``raw/<t>/<name>`` (this rank's gradient at its local weights), ``local/<t>/<name>`` (its weights after
``step()``), ``stats/<t>`` (``stats(step=t)`` as JSON), ``final/<name>`` and ``stats`` (``stats()``);
with ``nan_at`` (``[step, rank, name]`` triples), entry 7 of that rank's gradient of ``name`` is NaN at that
step, and ``memory/<t>/<name>`` holds the error memories after every step (absent: none yet); with
``broadcast_after_refusal`` a refused first step is recorded (``refused``), the model broadcast from
rank 0 as the error advises, and the step taken again on new gradients; with ``expect_refusal`` a
ValueError of a step is recorded (``refused``) and the run stops. ``per_rank`` (``{rank: options}``)
applies to every option (``dtype`` too); ``bf16_values``: the model's values rounded to bfloat16 on every
rank (as from a bfloat16 checkpoint), then cast to ``dtype``; with ``scaler`` (``{"inf_at": [[step,
rank], ...]}``) every step goes through a ``torch.amp.GradScaler`` (``scaler.step(optimizer)``, initial
scale 1024), the loss of the listed ranks and steps times inf; ``raw`` then holds the unscaled gradient
(exact: the scales are powers of two), zeros where the scaler skips the step, and ``scale/<t>`` the
scale after ``scaler.update()``.
"""

import copy
import json
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch
from states import same  # (tests/workers/states.py)

from hvd_scalecom.torch import QsparseLocalSGD

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

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


torch.manual_seed(opts.get("model_seed_offset", 0) * rank)  # offset: ranks start from different models
model = Net()
if opts.get("bf16_values"):
    model = model.to(torch.bfloat16)
model = model.to(getattr(torch, opts.get("dtype", "float32")))
named = list(model.named_parameters())
params = [p for _, p in named]
local = torch.optim.SGD(model.parameters(), lr=0.1, momentum=opts.get("momentum", 0.0))
optimizer = QsparseLocalSGD(local, model.named_parameters(), local_steps=opts.get("local_steps", 3),
                            ratio=opts.get("ratio", 0.05), max_k=opts.get("max_k"),
                            operator=opts.get("operator", "sign_top_k"), levels=opts.get("levels", 256),
                            min_numel=opts.get("min_numel", 600), seed=opts.get("seed", 0),
                            index_dtype=opts.get("index_dtype", "int32"))
if not opts.get("skip_broadcast") and opts.get("dtype") != "bfloat16":  # (Horovod broadcasts no bfloat16;
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)                 # the seed makes every rank alike)

if opts.get("resume_from"):
    saved = torch.load(os.path.join(opts["resume_from"], f"ckpt{rank}.pt"))
    model.load_state_dict(saved["model"])
    if opts.get("forget_compression_state"):
        saved["optimizer"] = {k: v for k, v in saved["optimizer"].items() if k != "qsparse_local_sgd"}
        local.load_state_dict(saved["optimizer"])
    else:
        optimizer.load_state_dict(saved["optimizer"])


def as_numpy(tensor):
    """A copy in NumPy (bfloat16, which NumPy lacks, as the float32 of the same value)."""
    tensor = tensor.detach()
    return (tensor.float() if tensor.dtype is torch.bfloat16 else tensor).numpy().copy()


nan_at = {(t, r): name for t, r, name in opts.get("nan_at", [])}
scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if "scaler" in opts else None
inf_at = {tuple(pair) for pair in opts.get("scaler", {}).get("inf_at", [])}
record = {}
first_step = opts.get("first_step", 0)
for t in range(first_step, first_step + opts.get("steps", 6)):
    if opts.get("reload") and t == opts["reload"]["save_at"]:
        earlier = copy.deepcopy(optimizer.state_dict())
    if opts.get("reload") and t == opts["reload"]["load_at"] and rank == opts["reload"]["rank"]:
        optimizer.load_state_dict(earlier)  # one rank alone goes back: the next sync must refuse it
    data_gen = torch.Generator().manual_seed(10000 * t + rank)
    x = torch.randn(16, 48, generator=data_gen).to(next(model.parameters()).dtype)
    y = torch.randint(0, 10, (16,), generator=data_gen)
    optimizer.zero_grad()
    if scaler is not None:
        loss = torch.nn.functional.cross_entropy(model(x), y) * (float("inf") if (t, rank) in inf_at else 1.0)
        scaler.scale(loss).backward()
        for name, p in named:  # (what the local step takes: a skipped step is one of zero gradient for SGD)
            record[f"raw/{t}/{name}"] = as_numpy(p.grad / scaler.get_scale() if (t, rank) not in inf_at
                                                 else torch.zeros_like(p))
        scaler.step(optimizer)
        scaler.update()
        record[f"scale/{t}"] = np.array(scaler.get_scale())
        for name, p in named:
            record[f"local/{t}/{name}"] = as_numpy(p)
        continue
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if (t, rank) in nan_at:
        dict(named)[nan_at[t, rank]].grad.view(-1)[7] = float("nan")
    for name, p in named:
        record[f"raw/{t}/{name}"] = as_numpy(p.grad)
    if opts.get("reload", {}).get("catch"):  # the refused synchronisation, caught: what it left behind
        before = copy.deepcopy(optimizer.state_dict()["qsparse_local_sgd"])
        try:
            optimizer.step()
        except ValueError as err:
            record["refused"] = np.array(str(err))
            record["refused_at"] = np.array(t)
            record["state_unchanged"] = np.array(same(before, optimizer.state_dict()["qsparse_local_sgd"]))
            break
    else:
        try:
            optimizer.step()
        except ValueError as err:
            if opts.get("expect_refusal"):
                record["refused"] = np.array(str(err))
                break
            if not opts.get("broadcast_after_refusal") or "refused" in record:
                raise
            record["refused"] = np.array(str(err))
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            for name, p in named:
                record[f"raw/{t}/{name}"] = as_numpy(p.grad)
            optimizer.step()
    for name, p in named:
        record[f"local/{t}/{name}"] = as_numpy(p)
        memory = optimizer.state_dict()["qsparse_local_sgd"]["params"][name]["memory"] if nan_at else None
        if memory is not None:
            record[f"memory/{t}/{name}"] = as_numpy(memory)
    record[f"stats/{t}"] = np.array(json.dumps(optimizer.stats(step=t)))

for name, p in named:
    record[f"final/{name}"] = as_numpy(p)
record["stats"] = np.array(json.dumps(optimizer.stats()))
record["param_dtype"] = np.array(str(params[0].dtype))
record["gloo"] = np.array(hvd.gloo_enabled())  # (the controller the job runs under: --gloo or --mpi)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
if opts.get("checkpoint"):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()},
               os.path.join(out_dir, f"ckpt{rank}.pt"))
hvd.allreduce(torch.zeros(1), name="worker.done")  # no rank leaves while others still reduce
print(f"rank {rank} done", flush=True)
