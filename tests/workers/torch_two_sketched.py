"""One rank of a run with two SketchedSGD instances whose steps overlap (an encoder and a decoder, each
with its own hvd.DistributedOptimizer, stepped after one backward) under horovodrun.

argv: JSON options, output directory. With ratio 1 every coordinate is applied each step, so (momentum
0) each step applies the ranks' mean gradient: the weights are compared with a copy trained by plain
hvd.DistributedOptimizer. ``names``: the two instances' ``name=`` (null: the default). Writes
``rank<R>.npz``: ``max_difference`` (over the weights, after ``steps`` steps) and ``final/<i>.<name>``.
"""

import json
import os
import sys

import horovod.torch as hvd
import numpy as np
import torch

from hvd_scalecom.torch import SketchedSGD

torch.set_num_threads(1)
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
hvd.init()
rank = hvd.rank()


def build(names, compressed, prefix):
    torch.manual_seed(0)
    parts = [torch.nn.Linear(48, 64), torch.nn.Linear(64, 10)]  # weights of 3072 and 640 entries: sketched
    optimizers = []
    for i, (part, name) in enumerate(zip(parts, names)):
        named = [(f"{prefix}{i}.{n}", p) for n, p in part.named_parameters()]
        kwargs = {}
        if compressed:
            kwargs["compression"] = SketchedSGD(named, ratio=1.0, rows=3, momentum=0.0, min_numel=600,
                                                **({"name": name} if name else {}))
        optimizers.append(hvd.DistributedOptimizer(torch.optim.SGD(part.parameters(), lr=0.1),
                                                   named_parameters=named, **kwargs))
    return parts, optimizers


def step(parts, optimizers, t):
    for o in optimizers:
        o.zero_grad()
    data = torch.Generator().manual_seed(1000 * t + rank)
    x = torch.randn(16, 48, generator=data)
    parts[1](torch.tanh(parts[0](x))).pow(2).mean().backward()
    for o in optimizers:
        o.step()


record = {}
sketched = build(opts["names"], True, "")
plain = build([None, None], False, "plain.")
for t in range(opts.get("steps", 4)):
    step(*sketched, t)
    step(*plain, t)
pairs = [(a.detach(), b.detach()) for pa, pb in zip(sketched[0], plain[0])
         for a, b in zip(pa.parameters(), pb.parameters())]
record["max_difference"] = np.array(max(float((a - b).abs().max()) for a, b in pairs))
for i, part in enumerate(sketched[0]):
    for n, p in part.named_parameters():
        record[f"final/{i}.{n}"] = p.detach().numpy()
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
hvd.allreduce(torch.zeros(1), name="worker.done")  # no rank leaves while others still reduce
print(f"rank {rank} done", flush=True)
