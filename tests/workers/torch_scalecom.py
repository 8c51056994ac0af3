"""One rank of a small ScaleCom training run under horovodrun; records what the tests check.

argv: JSON options, output directory. Writes ``rank<R>.npz`` with, per step t and parameter name,
``raw/<t>/<name>`` (this rank's gradient, taken before Horovod touches it), ``applied/<t>/<name>``
(the gradient the optimizer applied), ``final/<name>`` (weights) and the compressor's ``stats``;
with ``rollback``, ``first_attempt/<t>/<name>`` (what a step applied before it ran again); with
``commit_every_step``, ``next_indices/<t>/<name>`` ((step, *sorted indices) that state_dict() held).
``late_rank``: ``{"rank", "seconds"}`` that rank sleeps before its first step, and ``stats/first``
is ``stats()`` of the first step (at most 5 steps: those stats() keeps). ``skew_steps_at`` (given to one rank
through ``per_rank``): at the top of that step, that rank's step
counters move one ahead, through its own state_dict() and load_state_dict(); ``skew_next_indices_at``
likewise moves only the step of its pipelined next_indices, and ``drop_next_indices_at`` removes them.
``frozen_layer`` adds a layer frozen from the start (in ScaleCom's named_parameters, never reduced).
``per_rank`` applies to every option (``dtype`` too; ``no_loss_scaler``: the loss scale schedule
without ScaleCom's ``loss_scaler``; ``skip_broadcast``: no broadcast_parameters, the seed alone).
``health``: ScaleCom's health check options (``check_every``, ...); then ``stats/<t>`` is ``stats(step=t)``
after every step and ``warnings`` the count of health warnings this rank issued. ``same_data_from``: from
that step on every rank trains on the same data (rank 0's), so that the ranks' gradients agree.
``resync_at``: at the top of that step every rank calls ``compression.resync()`` (as elastic Horovod's sync).
"""

import copy
import json
import os
import sys
import time
import warnings

import horovod.torch as hvd
import lingering  # (this folder, the script's, is first on sys.path)
import numpy as np
import torch

from hvd_scalecom import native
from hvd_scalecom.torch import ScaleCom, clt_k

lingering.install()
torch.set_num_threads(1)
opts = json.loads(sys.argv[1])
traded = [0]  # decompress calls that traded a gradient's buffer with its memory's (or could have)
# clt_k as imported (an earlier run in the same process, tests/workers/sequence.py, may have changed it)
ORIGINAL = clt_k.__dict__.setdefault("_before_worker", (clt_k._ADVANCE_MIN_NUMEL, clt_k.filter_and_scatter_advanced))
clt_k._ADVANCE_MIN_NUMEL, clt_k.filter_and_scatter_advanced = ORIGINAL
if "advance_min_numel" in opts:  # small gradients take the path of large ones: buffers traded
    clt_k._ADVANCE_MIN_NUMEL = opts["advance_min_numel"]
    finish_advanced = clt_k.filter_and_scatter_advanced

    def counted(*args):
        traded[0] += 1
        return finish_advanced(*args)
    clt_k.filter_and_scatter_advanced = counted
out_dir = sys.argv[2]
process_set = None
if opts.get("process_set"):
    process_set = hvd.ProcessSet(opts["process_set"])
    hvd.init(process_sets=[process_set])
else:
    hvd.init()
rank, size = hvd.rank(), hvd.size()
set_kwargs = {"process_set": process_set} if process_set is not None else {}
per_rank = opts.get("per_rank", {}).get(str(rank), {})  # deliberately disagreeing ranks
opts = {**opts, **per_rank}


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        width = opts.get("hidden", 64)
        self.hidden = torch.nn.Linear(48, width)   # weight 3072 entries, bias 64 (by default)
        self.out = torch.nn.Linear(width, 10)      # weight 640, bias 10
        if opts.get("transposed_hidden"):  # stored column-major: its gradient is not contiguous either
            self.hidden.weight = torch.nn.Parameter(self.hidden.weight.detach().t().contiguous().t())
        if opts.get("embedding"):
            self.embed = torch.nn.Embedding(50, 48, sparse=True)
            if opts.get("embedding") == 2:  # a second, summed with it on the same tokens: equal gradients
                self.embed2 = torch.nn.Embedding(50, 48, sparse=True)
        if opts.get("conv"):  # a 4-d weight of 2304 entries (channels_last with "channels_last")
            self.conv = torch.nn.Conv2d(3, 48, 4, bias=False)
        if opts.get("tied_embedding"):  # one Parameter in two modules: named_parameters() lists it once
            self.embed = torch.nn.Embedding(50, 48)
            self.unembed = torch.nn.Linear(48, 50, bias=False)
            self.unembed.weight = self.embed.weight
        if opts.get("frozen_layer"):  # frozen before the optimizer is built, never used: Horovod never reduces it
            self.frozen = torch.nn.Linear(4, 4)
            self.frozen.requires_grad_(False)

    def forward(self, x, tokens=None, detach_out_weight=False):
        if tokens is not None:
            x = x + self.embed(tokens).mean(dim=1)
            if opts.get("embedding") == 2:
                x = x + self.embed2(tokens).mean(dim=1)
        if opts.get("conv"):
            x = x + self.conv(x.view(-1, 3, 4, 4).contiguous(
                memory_format=torch.channels_last if opts.get("channels_last") else torch.contiguous_format)
            ).view(-1, 48)
        if opts.get("tied_embedding"):  # the tied weight's second use: logits over the tokens
            x = x + torch.log_softmax(self.unembed(x), dim=1)[:, :48]
        h = torch.tanh(self.hidden(x))
        if detach_out_weight:  # out.weight gets no gradient: Horovod reduces zeros for it later
            return torch.nn.functional.linear(h, self.out.weight.detach(), self.out.bias)
        return self.out(h)


torch.manual_seed(0)
model = Net()
if opts.get("dtype"):
    model = model.to(getattr(torch, opts["dtype"]))
if opts.get("channels_last"):
    model = model.to(memory_format=torch.channels_last)
named = list(model.named_parameters())
params = [p for _, p in named]
class ScheduledLossScale:
    """A loss scaler whose scale follows a fixed schedule ({"step": scale}), like GradScaler's get_scale()."""

    def __init__(self, schedule):
        self.schedule = {int(k): float(v) for k, v in schedule.items()}
        self.step = 0

    def get_scale(self):
        return max((s for s in self.schedule.items() if s[0] <= self.step), default=(0, 1.0))[1]


scaler = ScheduledLossScale(opts["loss_scale_schedule"]) if opts.get("loss_scale_schedule") else None
grad_scaler = None  # {"init_scale", "growth_interval"}: a real torch.amp.GradScaler
if opts.get("grad_scaler"):
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=opts["grad_scaler"]["init_scale"],
                                       growth_interval=opts["grad_scaler"]["growth_interval"])
    scaler = grad_scaler
compression = ScaleCom(
    named[:-1] if opts.get("drop_last_param") else model.named_parameters(), ratio=opts.get("ratio", 0.05),
    beta=opts.get("beta", 0.5),
    warmup_steps=opts.get("warmup_steps", 0), min_numel=opts.get("min_numel", 600),
    leader=opts.get("leader", "cyclic"), selection=opts.get("selection", "exact"),
    value_dtype=opts.get("value_dtype"), index_dtype=opts.get("index_dtype", "int32"),
    pipelined=opts.get("pipelined", False), index_exchange=opts.get("index_exchange", "allgather"),
    loss_scaler=None if opts.get("no_loss_scaler") else scaler, timeout=opts.get("timeout"),
    **({} if opts.get("process_set_for_optimizer_only") else set_kwargs), **opts.get("health", {}))
non_contiguous = [0]  # gradients that reached compress() not contiguous
if opts.get("transposed_hidden") or opts.get("channels_last"):
    compress_contiguous = compression.compress

    def compress_counting(tensor):
        non_contiguous[0] += not tensor.is_contiguous()
        return compress_contiguous(tensor)
    compression.compress = compress_counting
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=opts.get("momentum", 0.0))
groups = None
if opts.get("groups") == "list":
    groups = [[model.hidden.weight, model.out.weight]]
elif opts.get("groups"):
    groups = int(opts["groups"])
passes = opts.get("backward_passes_per_step", 1)
compress_calls = [0]  # how many gradients Horovod handed to compress (per step, recorded below)
compress_once = compression.compress


def counted_compress(tensor):
    compress_calls[0] += 1
    return compress_once(tensor)


compression.compress = counted_compress
direct = opts.get("direct_allreduce")  # no DistributedOptimizer: p.grad.copy_(hvd.allreduce(p.grad, compression=...))
optimizer = optimizer if direct else hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=compression,
    backward_passes_per_step=passes, groups=groups, sparse_as_dense=opts.get("sparse_as_dense", False),
    gradient_predivide_factor=opts.get("gradient_predivide_factor", 1.0),
    op={"adasum": hvd.Adasum, "sum": hvd.Sum}.get(opts.get("op"), hvd.Average), **set_kwargs)
# (Horovod broadcasts contiguous tensors, and no bfloat16 ones; the others start equal from the common seed)
if not opts.get("skip_broadcast"):  # (the common seed alone: ranks whose dtypes differ reach ScaleCom's check)
    hvd.broadcast_parameters({n: v for n, v in model.state_dict().items()
                              if v.is_contiguous() and v.dtype is not torch.bfloat16}, root_rank=0)

poison = opts.get("poison")  # {"rank", "step", "value"[, "index"]}: entry 7 (or "all") of hidden.weight's gradient
current_step = [-1]  # the step whose loss.backward() is running (-1: none)
if poison and rank == poison["rank"]:
    def inject(grad):
        if current_step[0] != poison["step"]:
            return grad
        grad = grad.clone()
        grad.view(-1)[slice(None) if poison.get("index") == "all" else poison.get("index", 7)] = float(poison["value"])
        return grad
    model.hidden.weight.register_hook(inject)

if opts.get("resume_from"):
    saved = torch.load(os.path.join(opts["resume_from"], f"ckpt{rank}.pt"))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    if not opts.get("forget_compression_state"):
        compression.load_state_dict(saved["compression"])

freeze = opts.get("freeze")
record = {}
if opts.get("record_indices"):  # I of every compressed step, as decompress receives it (sorted)
    decompress_once = compression.decompress

    def recording_decompress(tensor, ctx):
        if ctx is not None and not isinstance(ctx, torch.dtype):
            slot, step, indices = ctx[:3]
            if indices is not None:  # (none on a dense fallback step)
                record[f"chosen/{step}/{slot.name}"] = indices.long().sort().values.numpy()
        return decompress_once(tensor, ctx)
    compression.decompress = recording_decompress
first_step = opts.get("first_step", 0)
schedule = list(range(first_step, first_step + opts.get("steps", 6)))
rollback = opts.get("rollback")  # {"after": a, "to": b}: after step a, back to the state at the top of step b
if rollback:  # steps to..after run twice
    end = schedule.index(rollback["after"]) + 1
    schedule[end:end] = range(rollback["to"], rollback["after"] + 1)
snapshot = None  # (compression, model, optimizer) state at the top of step rollback["to"]


def commit(t):
    """What elastic's state.commit() does: every rank takes state_dict(), then joins a collective."""
    for name, entry in compression.state_dict()["params"].items():
        if "next_indices" in entry:
            step, indices = entry["next_indices"]
            record[f"next_indices/{t}/{name}"] = np.array([step, *sorted(indices.tolist())])
    hvd.allreduce(torch.zeros(1), name=f"worker.commit.{t}")


late = opts.get("late_rank")  # {"rank", "seconds"}: that rank sleeps before its first step
health_warnings = []
for t in schedule:
    if late and rank == late["rank"] and t == schedule[0]:
        time.sleep(late["seconds"])
    if opts.get("resync_at") == t:
        compression.resync()
    if opts.get("skew_steps_at") == t:  # this rank's step counters jump by one (a state of another step)
        skewed = compression.state_dict()
        for entry in skewed["params"].values():
            entry["step"] += 1
        compression.load_state_dict(skewed)
    if opts.get("drop_next_indices_at") == t:  # this rank's state loses its pipelined next_indices
        dropped = compression.state_dict()
        for entry in dropped["params"].values():
            entry.pop("next_indices", None)
        compression.load_state_dict(dropped)
    if opts.get("skew_next_indices_at") == t:  # this rank's pipelined indices claim the next step
        skewed = compression.state_dict()
        for entry in skewed["params"].values():
            if "next_indices" in entry:
                entry["next_indices"] = (entry["next_indices"][0] + 1, entry["next_indices"][1])
        compression.load_state_dict(skewed)
    if rollback and t == rollback["to"] and snapshot is None:
        snapshot = copy.deepcopy((compression.state_dict(), model.state_dict(), optimizer.state_dict()))
    raw = [torch.zeros_like(p) for p in params]
    for k in range(passes):
        data_rank = 0 if t >= opts.get("same_data_from", float("inf")) else rank
        data_gen = torch.Generator().manual_seed(10000 * t + 100 * k + data_rank)  # resumable data order
        x = torch.randn(16, 48, generator=data_gen).to(params[0].dtype)
        y = torch.randint(0, 10, (16,), generator=data_gen)
        tokens = (torch.randint(0, 50, (16, 3), generator=data_gen)
                  if opts.get("embedding") or opts.get("tied_embedding") else None)
        if freeze:  # {"param", "ranks", "from", "to"}: requires_grad off for steps [from, to)
            frozen = rank in freeze["ranks"] and freeze["from"] <= t < freeze["to"]
            dict(named)[freeze["param"]].requires_grad_(not frozen)

        no_grad = rank == opts.get("no_out_weight_grad_on_rank") and t % 2 == 1

        def split_parts():  # split_backward: one loss term per layer (each reaches one layer only)
            h = torch.tanh(model.hidden(x))
            return [torch.nn.functional.cross_entropy(model.out(h.detach()), y),
                    (h * model.out.weight.detach().sum(dim=0)).mean()]

        def loss_fn():
            if opts.get("split_backward"):
                return sum(split_parts())
            return torch.nn.functional.cross_entropy(model(x, tokens, no_grad), y)

        # This rank's gradient, computed apart so that Horovod's in-place reduction cannot touch it.
        trainable = [i for i, p in enumerate(params) if p.requires_grad]
        grads = torch.autograd.grad(loss_fn(), [params[i] for i in trainable], allow_unused=True)
        for i, g in zip(trainable, grads):
            if g is not None:
                raw[i] += g.to_dense() if g.is_sparse else g
        current_step[0] = t
        if opts.get("split_backward"):
            # Two backward passes, one per layer, in a rank-dependent order: the gradient hooks of
            # hidden.* and out.* fire in opposite orders on even and odd ranks.
            parts = split_parts()
            for part in parts if rank % 2 else parts[::-1]:
                part.backward()
        else:
            loss = loss_fn()
            if grad_scaler is not None:
                record[f"scale/{t}"] = np.array(grad_scaler.get_scale())
                loss = grad_scaler.scale(loss)
            elif scaler is not None:
                scaler.step = t
                loss = loss * scaler.get_scale()
            loss.backward()
        current_step[0] = -1
    if grad_scaler is not None:  # as torch.amp's recipe for Horovod has it
        optimizer.synchronize()
        grad_scaler.unscale_(optimizer)
        with optimizer.skip_synchronize():
            grad_scaler.step(optimizer)
        grad_scaler.update()
    elif scaler is not None:  # unscale, as GradScaler.unscale_ would
        optimizer.synchronize()
        for p in params:
            p.grad /= scaler.get_scale()
        with optimizer.skip_synchronize():
            optimizer.step()
    elif direct:  # one blocking reduction per gradient, in the same order on every rank
        for name, p in named:
            p.grad.copy_(hvd.allreduce(p.grad, name=f"direct.{name}", compression=compression))
        optimizer.step()
    elif opts.get("skip_nonfinite"):  # what a loss scaler does: skip a step with a non-finite gradient
        optimizer.synchronize()
        if all(bool(torch.isfinite(p.grad).all()) for p in params):
            with optimizer.skip_synchronize():
                optimizer.step()
    else:
        with warnings.catch_warnings(record=True) as caught:  # (the health check's, issued in synchronize())
            warnings.simplefilter("always")
            optimizer.step()
        health_warnings += [str(w.message) for w in caught if "health check" in str(w.message)]
        for w in caught:
            if "health check" not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if opts.get("health"):
        record[f"stats/{t}"] = np.array(json.dumps(compression.stats(step=t)))
    record[f"compress_calls/{t}"] = np.array(compress_calls[0])
    compress_calls[0] = 0
    for (name, p), r in zip(named, raw):
        if p.grad is None:  # (frozen_layer: never trained)
            continue
        record[f"raw/{t}/{name}"] = r.float().numpy()
        record[f"applied/{t}/{name}"] = (p.grad.to_dense() if p.grad.is_sparse else p.grad).float().numpy()
    record["applied_dtype"] = np.array(str(params[0].grad.dtype))
    optimizer.zero_grad()
    if opts.get("commit_every_step"):
        commit(t)
    if rollback and t == rollback["after"] and "rolled_back" not in record:
        record["rolled_back"] = np.array(t)
        for redo in range(rollback["to"], t + 1):  # the first attempts, before the steps run again
            for name, _ in named:
                record[f"first_attempt/{redo}/{name}"] = record[f"applied/{redo}/{name}"]
        compression.load_state_dict(snapshot[0])
        model.load_state_dict(snapshot[1])
        optimizer.load_state_dict(snapshot[2])

if opts.get("join"):  # uneven data: this rank is out of batches (set "steps" per rank)
    hvd.join()
for name, p in named:
    record[f"final/{name}"] = p.detach().float().numpy()
for name, entry in compression.state_dict()["params"].items():
    if entry["memory"] is not None:
        record[f"memory/{name}"] = (entry["memory"] / (entry["scale"] or 1.0)).numpy()  # unscaled
record["stats"] = np.array(json.dumps(compression.stats()))
if late:
    record["stats/first"] = np.array(json.dumps(compression.stats(step=schedule[0])))
record["traded"] = np.array(traded[0])
record["warnings"] = np.array(len(health_warnings))
record["native"] = np.array(native.library() is not None)  # which path the job's passes could take
record["non_contiguous"] = np.array(non_contiguous[0])
record["gloo"] = np.array(hvd.gloo_enabled())  # (the controller the job runs under: --gloo or --mpi)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
if opts.get("checkpoint"):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "compression": compression.state_dict()}, os.path.join(out_dir, f"ckpt{rank}.pt"))
hvd.allreduce(torch.zeros(1), name="worker.done")  # no rank leaves while others still reduce
hvd.stop_timeline()  # writes every queued timeline event (Horovod drops them at shutdown)
print(f"rank {rank} done", flush=True)
