"""One rank of a horovodrun job: the Horovod ScaleCom compressor on the model, data and settings of
``ddp_common.MATCH``, the run the DDP hook's ``match`` scenario repeats under torchrun. argv: JSON
options (unused), output directory; writes ``rank<R>.npz`` with ``final/<name>`` (weights)."""

import os
import sys

import ddp_common  # (this folder, the script's, is first on sys.path)
import horovod.torch as hvd
import numpy as np
import torch

from hvd_scalecom.torch import ScaleCom

torch.set_num_threads(1)
hvd.init()
rank = hvd.rank()
settings = ddp_common.MATCH
model = ddp_common.make_net()
compression = ScaleCom(model.named_parameters(), ratio=settings["ratio"], beta=settings["beta"],
                       warmup_steps=settings["warmup_steps"], min_numel=settings["min_numel"])
optimizer = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=settings["lr"], momentum=settings["momentum"]),
    named_parameters=model.named_parameters(), compression=compression)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for step in range(settings["steps"]):
    optimizer.zero_grad()
    ddp_common.loss_of(model, step, rank).backward()
    optimizer.step()
np.savez(os.path.join(sys.argv[2], f"rank{rank}.npz"),
         **{f"final/{name}": p.detach().numpy().copy() for name, p in model.named_parameters()})
