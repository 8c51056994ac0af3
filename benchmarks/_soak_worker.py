"""One Horovod worker of ``benchmarks.soak``: trains the digits MLP of the examples with ScaleCom for
``--steps`` steps and every ``--every`` steps records this process's RSS, the residue-memory norm,
the mean loss since the last record, the number of objects Python's garbage collector tracks and ``stats()``, one JSON
line each in ``OUT_DIR/rank{r}.jsonl`` (after a first line with the rank, size and options).

    python benchmarks/_soak_worker.py OUT_DIR --steps 2000 --every 20 [--framework tensorflow] [EXAMPLE ARGS]

Model, data and the options after the worker's own (``--ratio``, ``--beta``, ``--batch-size``, ...)
come from ``examples/pytorch_scalecom.py`` (or ``examples/tensorflow_scalecom.py``), imported, so the
soak trains exactly what the example trains; the worker only replaces the epoch loop by a step loop
that walks through a fresh permutation of the rank's shard whenever it is used up.
"""

import argparse
import gc
import json
import os
import resource
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

from hvd_scalecom.monitor import residue_norm  # noqa: E402


def rss_bytes():
    """Resident set size of this process now (``VmRSS``; the peak from ``getrusage`` without /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def scalecom_kwargs(args):
    """The ScaleCom options both examples share, from their parsed arguments."""
    return dict(ratio=args.ratio, beta=args.beta, warmup_steps=args.warmup_steps,
                min_numel=args.min_numel, leader=args.leader, selection=args.selection,
                value_dtype=args.value_dtype, pipelined=args.pipelined)


def learning_rate(args, size):
    """The torch example's learning rate at ``size`` workers: ``--lr`` scaled by ``--lr-scaling``."""
    return args.lr * (size if args.lr_scaling == "linear" else size ** 0.5)


def torch_trainer(example_argv):
    """``(rank, size, args, step(batch_indices) -> loss, compression, shard length, version)``."""
    import horovod.torch as hvd
    import pytorch_scalecom as example
    import torch

    from hvd_scalecom.torch import ScaleCom

    args = example.parse_args(example_argv)
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    x_train, y_train, _, _ = example.digits_split()
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    model = example.make_model()
    compression = ScaleCom(model.named_parameters(), index_dtype=args.index_dtype, **scalecom_kwargs(args))
    optimizer = torch.optim.SGD(model.parameters(), lr=learning_rate(args, size), momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def step(batch):
        batch = torch.from_numpy(batch)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(shard_x[batch]), shard_y[batch])
        loss.backward()
        optimizer.step()
        return loss.item()

    return rank, size, args, step, compression, len(shard_x), f"torch {torch.__version__}"


def tensorflow_trainer(example_argv):
    """The same for TensorFlow (Keras 3 model, ``make_train_step``)."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf
    import tensorflow_scalecom as example

    from hvd_scalecom.tensorflow import ScaleCom, make_train_step

    args = example.parse_args(example_argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, _, _ = example.digits_split()
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    model = example.make_model()
    compression = ScaleCom(model.trainable_variables, index_exchange=args.index_exchange,
                           **scalecom_kwargs(args))
    optimizer = keras.optimizers.SGD(args.lr * size, momentum=args.momentum)
    train_step = make_train_step(model, optimizer,
                                 keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 compression, jit=not args.eager)

    def step(batch):
        return float(train_step(shard_x[batch], shard_y[batch]))

    return rank, size, args, step, compression, len(shard_x), f"TensorFlow {tf.__version__}"


TRAINERS = {"torch": torch_trainer, "tensorflow": tensorflow_trainer}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("out_dir")
    ap.add_argument("--framework", choices=list(TRAINERS), default="torch")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=20, help="record every this many steps")
    own, example_argv = ap.parse_known_args(argv)

    rank, size, args, step, compression, shard_len, version = TRAINERS[own.framework](example_argv)
    import horovod
    order_gen = np.random.RandomState(args.seed * 1000 + rank)
    order, position = None, shard_len
    losses = []
    out = open(os.path.join(own.out_dir, f"rank{rank}.jsonl"), "w")
    out.write(json.dumps({"rank": rank, "size": size, "framework": own.framework, "steps": own.steps,
                          "every": own.every, "options": vars(args),
                          "framework_version": version, "horovod": horovod.__version__}) + "\n")
    start = time.perf_counter()

    def record(done):
        """One line of the output; nothing is kept in memory, so the records cannot grow the RSS."""
        line = {"step": done, "seconds": time.perf_counter() - start, "rss_bytes": rss_bytes(),
                "residue_norm": residue_norm(compression),
                "loss": float(np.mean(losses)) if losses else None,
                "python_objects": len(gc.get_objects()), "stats": compression.stats()}
        out.write(json.dumps(line) + "\n")
        out.flush()
        losses.clear()

    record(0)
    for done in range(1, own.steps + 1):
        if position + args.batch_size > shard_len:
            order, position = order_gen.permutation(shard_len), 0
        losses.append(step(order[position:position + args.batch_size]))
        position += args.batch_size
        if done % own.every == 0 or done == own.steps:
            record(done)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
