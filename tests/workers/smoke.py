"""Allreduce and broadcast through one frontend; writes rank<R>.npz. argv: JSON {"framework"}, out dir."""

import json
import os
import sys

import numpy as np

opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]

if opts["framework"] == "torch":
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank = hvd.rank()
    summed = hvd.allreduce(torch.arange(5, dtype=torch.float32) + 10 * rank, op=hvd.Sum, name="smoke.sum")
    averaged = hvd.allreduce(torch.full((3,), float(rank)), name="smoke.avg")
    bcast = hvd.broadcast(torch.full((4,), float(rank + 1)), root_rank=hvd.size() - 1, name="smoke.bcast")
    result = {"sum": summed.numpy(), "avg": averaged.numpy(), "bcast": bcast.numpy()}
else:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    hvd.init()
    rank = hvd.rank()
    summed = hvd.allreduce(tf.range(5, dtype=tf.float32) + 10.0 * rank, op=hvd.Sum, name="smoke.sum")
    averaged = hvd.allreduce(tf.fill([3], float(rank)), name="smoke.avg")
    bcast = hvd.broadcast(tf.fill([4], float(rank + 1)), root_rank=hvd.size() - 1, name="smoke.bcast")
    result = {"sum": summed.numpy(), "avg": averaged.numpy(), "bcast": bcast.numpy()}

result["size"] = np.array(hvd.size())
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **result)
