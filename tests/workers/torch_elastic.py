"""One worker of an elastic ScaleCom job (``horovodrun --min-np/--max-np --host-discovery-script``).

argv: JSON options, output directory. Options: ``steps``; ``commit_every`` (steps between commits,
default 1); ``hosts_file`` (what the discovery script prints); ``changes`` (``{"<step>": "<hosts file
text>"}``: when committing after ``<step>`` steps, rank 0 first rewrites the hosts file and waits for
Horovod's notice, so that this commit raises the change on every rank); ``fail_at`` (a step: at its
first start every rank raises ``HorovodInternalError``, as Horovod does when a collective fails);
``random_init`` (each process initialises its model differently: only the sync makes them agree);
``pipelined``, ``beta``, ``warmup_steps`` (ScaleCom options).

Every process appends JSON lines to ``proc<pid>.jsonl`` as it goes (a worker that is removed cannot
write at the end): ``enter`` (each entry into the elastic train function, after the sync), ``fail``,
``top`` (before each step: step counters, memory and weight digests), ``select`` (a top-k selection:
this rank led that step), ``agree`` (the configuration agreement check), ``resync``
(``ScaleCom.resync``, called by the state handler's sync), ``end`` (after the step: weight and memory
digests, this attempt's traffic, nonzeros of the applied gradients). A process that joined writes
``joined<pid>.npz`` after its first step (raw gradient, applied gradient, memory); the ranks of the
last world write ``final<rank>.npz`` (weights and memories).
"""

import json
import os
import sys
import time

import horovod.torch as hvd
import numpy as np
import torch
from horovod.common.exceptions import HorovodInternalError

from hvd_scalecom.torch import ScaleCom, clt_k
from hvd_scalecom.torch import scalecom as compressor
from hvd_scalecom.torch.collectives import tensors_digest

torch.set_num_threads(1)
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
hvd.init()
pid = os.getpid()
log_file = open(os.path.join(out_dir, f"proc{pid}.jsonl"), "a")
worlds = [0]  # entries into the elastic train function in this process


def log(ev, **fields):
    record = {"ev": ev, "pid": pid, "world": worlds[0], "rank": hvd.rank(), "size": hvd.size(),
              "time": time.time(), **fields}
    log_file.write(json.dumps(record) + "\n")
    log_file.flush()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(48, 64)   # weight 3072 entries (k = 154), bias 64
        self.out = torch.nn.Linear(64, 10)      # weight 640 (k = 32), bias 10

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


torch.manual_seed(pid if opts.get("random_init") else 0)  # the sync must make weights agree anyway
model = Net()
named = list(model.named_parameters())
params = [p for _, p in named]
compression = ScaleCom(model.named_parameters(), ratio=0.05, beta=opts.get("beta", 0.5),
                       warmup_steps=opts.get("warmup_steps", 1), min_numel=600,
                       pipelined=opts.get("pipelined", False))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression)

current_step = [-1]


def recording(select):
    """``select`` (a clt_k selection on (memory, gradient, ...)), logging that this rank selected."""
    def recorded(memory, grad, *args, **kwargs):
        log("select", step=current_step[0], numel=memory.numel())
        return select(memory, grad, *args, **kwargs)
    return recorded


# the compressor's two ways to select: in the step (select_and_take), or a step ahead (pipelined)
clt_k.select_and_take = recording(clt_k.select_and_take)
clt_k.select_top_k_of_sum = recording(clt_k.select_top_k_of_sum)
check_agreement = compressor.check_agreement
resync = ScaleCom.resync


def recording_check_agreement(*args, **kwargs):
    log("agree", step=current_step[0])
    return check_agreement(*args, **kwargs)


def recording_resync(self):
    log("resync")
    return resync(self)


compressor.check_agreement = recording_check_agreement
ScaleCom.resync = recording_resync


def memory_record():
    entries = compression.state_dict()["params"]
    return ({n: e["step"] for n, e in entries.items()},
            {n: None if e["memory"] is None else tensors_digest([e["memory"]]) for n, e in entries.items()},
            {n: 0.0 if e["memory"] is None else float(e["memory"].abs().sum()) for n, e in entries.items()})


def wait_for_host_notice(state):
    deadline = time.monotonic() + 60
    while state._host_messages.empty():  # as Horovod's own elastic tests wait for the driver
        if time.monotonic() > deadline:
            raise TimeoutError("no host update notice from the elastic driver within 60 s")
        time.sleep(0.05)


changes = {int(k): v for k, v in opts.get("changes", {}).items()}
failed = []
done_changes = set()


@hvd.elastic.run
def train(state):
    worlds[0] += 1
    joined = worlds[0] == 1 and state.step > 0  # a process started for a worker that joined
    log("enter", step=state.step, joined=joined)
    while state.step < opts["steps"]:
        t = state.step
        if t == opts.get("fail_at") and not failed:
            failed.append(t)
            log("fail", step=t)
            raise HorovodInternalError("a failure injected by the test at the start of a step")
        total_before = compression.stats()["total"]
        steps, digests, sums = memory_record()
        log("top", step=t, slot_steps=steps, memory=digests, memory_abs_sum=sums,
            weights=tensors_digest(params))
        gen = torch.Generator().manual_seed(1000 * t + hvd.rank())
        x = torch.randn(16, 48, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        raw = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y), params)
        optimizer.zero_grad()
        current_step[0] = t
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        current_step[0] = -1
        total = compression.stats()["total"]  # this attempt's bytes (stats(t) adds up a rerun step)
        _, digests, _ = memory_record()
        log("end", step=t, weights=tensors_digest(params), memory=digests,
            nonzero={n: int(torch.count_nonzero(p.grad)) for n, p in named},
            traffic={k: total[k] - total_before[k] for k in ("index_bytes", "value_bytes", "dense_bytes")})
        if joined:
            entries = compression.state_dict()["params"]
            np.savez(os.path.join(out_dir, f"joined{pid}.npz"), step=t,
                     **{f"raw/{n}": g.numpy() for (n, _), g in zip(named, raw)},
                     **{f"applied/{n}": p.grad.numpy() for n, p in named},
                     **{f"memory/{n}": e["memory"].numpy() for n, e in entries.items()
                        if e["memory"] is not None})
            joined = False
        state.step += 1
        if state.step % opts.get("commit_every", 1):
            continue
        if hvd.rank() == 0 and state.step in changes and state.step not in done_changes:
            done_changes.add(state.step)
            with open(opts["hosts_file"], "w") as f:
                f.write(changes[state.step])
            wait_for_host_notice(state)
        state.commit()


state = hvd.elastic.TorchState(model, optimizer, compression=compression, step=0)
assert type(state._handlers["compression"]).__name__ == "ScaleComStateHandler"
train(state)
hvd.stop_timeline()  # writes every queued timeline event (Horovod drops them at shutdown)
log("done", step=state.step)
entries = compression.state_dict()["params"]
np.savez(os.path.join(out_dir, f"final{hvd.rank()}.npz"),
         **{f"final/{n}": p.detach().numpy() for n, p in named},
         **{f"memory/{n}": e["memory"].numpy() for n, e in entries.items() if e["memory"] is not None})
