"""One rank of a torchrun job that runs several DDP + ScaleCom scenarios in sequence (Gloo).

argv: JSON options, output directory. ``options["scenarios"]`` is a list of dicts, each with
``name`` and ``kind``:

* ``"train"``: :func:`train` (options below); records, per step t and parameter name, ``raw/t/name``
  (this rank's gradient as the hook got it), ``out/t/name`` (the averaged update it returned),
  ``mem/name`` (residue memories after the last step), ``final/name`` (weights), ``iter`` and, per
  step, ``bytes/t`` (payload bytes this rank handed to torch.distributed's collectives during the
  backward pass, counted in the calls themselves) and ``stats/t`` (stats()'s sent_bytes of that step);
  with ``"model": "health"`` (``ddp_common.HealthNet``, gradients the test chooses), also
  ``stats_of/t`` (stats() after step t, JSON) and ``warnings`` (the health check's warnings this rank
  raised, JSON);
* ``"dense_bytes"``: the same model reduced by a plain allreduce hook: ``bytes/t`` only;
* ``"mismatch"``: rank-dependent ratios; ``error`` holds the message every rank raised.

``train`` with ``save_after``: model, optimizer and ScaleCom state after that many steps saved to
``ckpt/rank<R>.pt``; with ``load``: continued from there (in a new job).

Every key is prefixed with the scenario's name. Writes ``rank<R>.npz``.
"""

import json
import os
import sys
import warnings

import ddp_common  # (this folder, the script's, is first on sys.path)
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_scalecom.ddp import ScaleComState, scalecom_hook
from hvd_scalecom.monitor import residue_norm, stats_scalars
from hvd_scalecom.torch import log_stats

torch.set_num_threads(1)
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
record = {}
counted = [0]  # payload bytes handed to collectives since the last reset


def _counting(collective, tensors_of):
    def call(*args, **kwargs):
        counted[0] += sum(t.numel() * t.element_size() for t in tensors_of(*args, **kwargs))
        return collective(*args, **kwargs)
    return call


# Count what reaches the process group: every tensor handed to these collectives (for a broadcast:
# the leader's indices, or the buffer another rank receives them into).
dist.broadcast = _counting(dist.broadcast, lambda tensor, *a, **k: [tensor])
dist.all_reduce = _counting(dist.all_reduce, lambda tensor, *a, **k: [tensor])
dist.all_gather = _counting(dist.all_gather, lambda out, tensor, *a, **k: [tensor])


def named(model):
    return [(n[len("module."):] if n.startswith("module.") else n, p) for n, p in model.named_parameters()]


def recording_hook(prefix, names):
    """scalecom_hook, recording the gradients it is given and the update it returns."""
    def hook(state, bucket):
        t = state.iter
        params = list(bucket.parameters())
        for param, grad in zip(params, bucket.gradients()):
            record[f"{prefix}/raw/{t}/{names[id(param)]}"] = grad.detach().float().clone().numpy()

        def returned(future):
            buffer = future.value()
            for param, grad in zip(params, bucket.gradients()):
                record[f"{prefix}/out/{t}/{names[id(param)]}"] = grad.detach().float().clone().numpy()
            return buffer
        return scalecom_hook(state, bucket).then(returned)
    return hook


def dense_hook(group, bucket):
    """DDP's own reduction, through torch.distributed.all_reduce (so that its bytes are counted)."""
    buffer = bucket.buffer()
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0].div_(size))


def train(sc):
    """A DDP model trained ``steps`` synchronised steps with ScaleCom (``state`` options), with DDP's
    ``ddp`` options, by SGD (``lr``, ``momentum``); ``accumulate``: micro-batches per step under no_sync() before the
    synchronised
    one; ``dtype``: the model's; ``unused``: a layer the forward pass never uses."""
    name = sc["name"]
    dtype = getattr(torch, sc.get("dtype", "float32"))
    health = sc.get("model") == "health"
    model = ddp_common.HealthNet() if health else ddp_common.make_net(unused=sc.get("unused", False), dtype=dtype)
    ddp = DDP(model, **sc.get("ddp", {}))
    names = {id(p): n for n, p in named(model)}
    state = ScaleComState(**sc.get("state", {}), named_parameters=named(model))
    ddp.register_comm_hook(state, recording_hook(name, names))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=sc.get("lr", 0.05), momentum=sc.get("momentum", 0.9))
    first = 0
    ckpt = os.path.join(sc.get("ckpt_dir", os.path.join(out_dir, "ckpt")), f"rank{rank}.pt")
    if sc.get("load"):
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["scalecom"])
        first = saved["step"]
    with warnings.catch_warnings(record=True) as warned:  # (the hook warns from the process group's threads)
        warnings.simplefilter("always")
        for step in range(first, sc["steps"]):
            for micro in range(sc.get("accumulate", 0)):
                with ddp.no_sync():
                    ddp_common.loss_of(ddp, step, rank, micro + 1, dtype).backward()
            counted[0] = 0
            if health:
                ddp_common.health_loss(ddp, step, rank, size).backward()
                record[f"{name}/stats_of/{step}"] = json.dumps(state.stats())
            else:
                ddp_common.loss_of(ddp, step, rank, 0, dtype).backward()
            record[f"{name}/bytes/{step}"] = counted[0]
            record[f"{name}/stats/{step}"] = state.stats()["sent_bytes"]
            optimizer.step()
            optimizer.zero_grad()
            if sc.get("save_after") == step + 1:
                os.makedirs(os.path.dirname(ckpt), exist_ok=True)
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "scalecom": state.state_dict(), "step": step + 1}, ckpt)
    record[f"{name}/warnings"] = json.dumps([str(w.message) for w in warned if "health check" in str(w.message)])
    record[f"{name}/iter"] = state.iter
    for n, p in named(model):
        record[f"{name}/final/{n}"] = p.detach().float().numpy().copy()
    for n, entry in state.state_dict()["params"].items():
        if entry["memory"] is not None:
            record[f"{name}/mem/{n}"] = entry["memory"].numpy()
            record[f"{name}/memdtype/{n}"] = str(entry["memory"].dtype)
    tags = {}

    class Writer:
        def add_scalar(self, tag, value, step):
            tags[tag] = value
    log_stats(Writer(), state, state.iter)
    record[f"{name}/log_stats"] = json.dumps(tags)
    record[f"{name}/scalars"] = json.dumps(stats_scalars(state.stats()))
    record[f"{name}/residue_norm"] = residue_norm(state)


def dense_bytes(sc):
    model = ddp_common.make_net()
    ddp = DDP(model, **sc.get("ddp", {}))
    ddp.register_comm_hook(None, dense_hook)
    for step in range(sc["steps"]):
        counted[0] = 0
        ddp_common.loss_of(ddp, step, rank).backward()
        record[f"{sc['name']}/bytes/{step}"] = counted[0]


def mismatch(sc):
    model = ddp_common.make_net()
    ddp = DDP(model)
    ddp.register_comm_hook(ScaleComState(ratio=0.01 * (rank + 1), named_parameters=named(model)), scalecom_hook)
    try:
        ddp_common.loss_of(ddp, 0, rank).backward()
        record[f"{sc['name']}/error"] = ""
    except Exception as error:  # (DDP may hand the hook's ValueError on as it is or wrapped)
        record[f"{sc['name']}/error"] = str(error)


for scenario in opts["scenarios"]:
    {"train": train, "dense_bytes": dense_bytes, "mismatch": mismatch}[scenario["kind"]](scenario)
    dist.barrier()
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
dist.destroy_process_group()
