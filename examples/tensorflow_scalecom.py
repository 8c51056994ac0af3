r"""Train a Keras 3 MLP (167k parameters) on scikit-learn's handwritten digits with ScaleCom and Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_scalecom.py --compression scalecom

The TensorFlow twin of ``examples/pytorch_scalecom.py``: the same 64-512-256-10 network, split, shards
and optimizer settings. Each worker trains on its shard of the 1,437 training images; accuracy is
measured on the 360 held-out ones. Rank 0 prints per-epoch loss, test accuracy and the gradient bytes
this rank handed to Horovod per step against what dense SGD would have sent.

Checkpoints (``--checkpoint DIR``): after every epoch each rank writes a ``tf.train.Checkpoint`` of
the model, the optimizer, the epoch and ScaleCom (its residue memories and step counters) to
``DIR/rank<R>``: the memories differ from rank to rank, so every rank saves and restores its own.
``--resume`` restores each rank's latest checkpoint and trains on to ``--epochs``, with the same
steps as a run that was never interrupted (same size and arguments: a checkpoint records its
--compression, --lr, --momentum and number of workers, and a resume with others is refused)::

    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_scalecom.py \
        --epochs 10 --checkpoint ckpt
    horovodrun -np 2 -H localhost:2 --gloo python examples/tensorflow_scalecom.py \
        --epochs 25 --checkpoint ckpt --resume
"""

import argparse
import json
import os
import sys
import time

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from digits_common import (
    add_scalecom_arguments,
    check_scalecom_arguments,
    check_trained_with,
    epoch_steps,
    learning_rate,
    momentum_value,
    positive_int,
    result_path,
    seed_value,
    trained_with,
)
from sklearn.datasets import load_digits

from hvd_scalecom.tensorflow import ScaleCom, make_train_step


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--compression", choices=["scalecom", "dense", "fp16"], default="scalecom")
    add_scalecom_arguments(ap, ["float32", "float16"])
    ap.add_argument("--index-exchange", choices=["broadcast", "allreduce", "allgather"], default="broadcast")
    ap.add_argument("--pipelined", action="store_true", help="indices selected one step ahead")
    ap.add_argument("--epochs", type=positive_int, default=25)
    # batch 16 and lr 0.0125 per worker (0.05 at 4 workers): at ratio 0.01 the residue memory sends
    # held-back gradient in bursts that momentum 0.9 amplifies, and 0.2 at 4 workers diverged; the
    # smaller batch gives ScaleCom twice the steps in the same epochs
    ap.add_argument("--batch-size", type=positive_int, default=16,
                    help="per worker, at most its shard of the 1,437 training images")
    ap.add_argument("--lr", type=learning_rate, default=0.0125, help="per worker: learning rate = lr x workers")
    ap.add_argument("--momentum", type=momentum_value, default=0.9)
    ap.add_argument("--seed", type=seed_value, default=0)
    ap.add_argument("--eager", action="store_true", help="run the train step eagerly")
    ap.add_argument("--result", type=result_path, help="rank 0 writes final figures here as JSON")
    ap.add_argument("--progress", action="store_true", help="a progress bar per epoch (rank 0)")
    ap.add_argument("--checkpoint", metavar="DIR", help="each rank checkpoints to DIR/rank<R> after "
                                                        "every epoch")
    ap.add_argument("--resume", action="store_true", help="restore the latest checkpoint in "
                                                          "--checkpoint DIR and train on")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint:
        ap.error("--resume needs --checkpoint DIR")
    check_scalecom_arguments(ap, args)
    if args.fallback is not None and args.pipelined:
        ap.error("--fallback needs exact ScaleCom (without --pipelined)")
    return args


def digits_split():
    """Standardised digits: the first 1,437 images train, the last 360 test (no download)."""
    x, y = load_digits(return_X_y=True)
    x = ((x / 16.0 - 0.5) / 0.5).astype(np.float32)
    y = y.astype(np.int32)
    return x[:1437], y[:1437], x[1437:], y[1437:]


def make_model():
    return keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(512, activation="relu"),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(10)])


def main(argv=None):
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    keras.utils.set_random_seed(args.seed)
    x_train, y_train, x_test, y_test = digits_split()
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    steps_per_epoch = epoch_steps(len(x_train), args.batch_size, size, rank, args.compression)
    model = make_model()

    if args.compression == "scalecom":
        compression = ScaleCom(model.trainable_variables, ratio=args.ratio, beta=args.beta,
                               warmup_steps=args.warmup_steps, min_numel=args.min_numel,
                               leader=args.leader, selection=args.selection,
                               value_dtype=args.value_dtype, index_dtype=args.index_dtype,
                               index_exchange=args.index_exchange,
                               pipelined=args.pipelined, check_every=args.check_every,
                               fallback=args.fallback, min_captured=args.min_captured)
    elif args.compression == "fp16":
        compression = hvd.Compression.fp16
    else:
        compression = hvd.Compression.none
    optimizer = keras.optimizers.SGD(args.lr * size, momentum=args.momentum)
    # Broadcasts rank 0's weights and optimizer state, then trains through DistributedGradientTape.
    train_step = make_train_step(model, optimizer,
                                 keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                 compression, jit=not args.eager)

    # Per rank: the model and optimizer are the same everywhere, ScaleCom's residue memories are not.
    epoch_done = tf.Variable(0, dtype=tf.int64, trainable=False)
    record = trained_with(args, size)  # the arguments saved (as JSON)
    record_saved = tf.Variable(json.dumps(record), trainable=False)
    tracked = {"compression": compression} if args.compression == "scalecom" else {}
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=epoch_done,
                                     trained_with=record_saved, **tracked)
    manager = None
    if args.checkpoint:
        manager = tf.train.CheckpointManager(checkpoint, os.path.join(args.checkpoint, f"rank{rank}"),
                                             max_to_keep=2)
    if args.resume:
        if manager.latest_checkpoint is None:
            raise FileNotFoundError(f"--resume: no checkpoint in {args.checkpoint}/rank{rank}")
        # Checked before restoring: another --compression would drop ScaleCom's memories (or miss
        # them), and the optimizer restored keeps its --lr, --momentum and learning rate scaled for its
        # number of workers. An older checkpoint's record is the --compression alone.
        saved = tf.train.load_checkpoint(manager.latest_checkpoint).get_tensor(
            "trained_with/.ATTRIBUTES/VARIABLE_VALUE").decode()
        check_trained_with(json.loads(saved) if saved.startswith("{") else saved, record, args.checkpoint)
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        if int(epoch_done) >= args.epochs:
            raise SystemExit(f"--epochs {args.epochs}: the checkpoint in {args.checkpoint} has trained "
                             f"{int(epoch_done)} epochs already; ask for more to resume")

    dense_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
    sent_by_dtype = {"fp16": dense_bytes // 2}.get(args.compression, dense_bytes)
    order_gen = np.random.RandomState((args.seed * 1000 + rank) % 2 ** 32)  # (numpy's seeds: 32 bits)
    if rank == 0:
        n_params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        print(f"{args.compression}: {size} workers, {n_params:,} parameters, "
              f"{steps_per_epoch} steps per epoch", flush=True)
        if args.resume:
            print(f"resumed from {manager.latest_checkpoint} after epoch {int(epoch_done)}", flush=True)
    for _ in range(int(epoch_done)):  # the data order of the epochs already trained
        order_gen.permutation(len(shard_x))
    start = time.perf_counter()
    accuracy = mean_loss = sent = reduction = None
    for epoch in range(int(epoch_done), args.epochs):
        order = order_gen.permutation(len(shard_x))
        total_loss = 0.0
        steps = range(steps_per_epoch)
        if args.progress and rank == 0:
            from tqdm import tqdm
            steps = tqdm(steps, desc=f"epoch {epoch + 1}", leave=False, file=sys.stdout)
        for step in steps:
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            total_loss += float(train_step(shard_x[batch], shard_y[batch]))
        mean_loss = float(hvd.allreduce(tf.constant(total_loss / steps_per_epoch), name="epoch_loss"))
        accuracy = evaluate(model, x_test, y_test)
        if args.compression == "scalecom":
            last, total = compression.stats(), compression.stats()["total"]
            sent = last["sent_bytes"]  # (nothing at all with one process: then 1x)
            reduction = total["uncompressed_bytes"] / total["sent_bytes"] if total["sent_bytes"] else 1.0
        else:
            sent, reduction = sent_by_dtype, dense_bytes / sent_by_dtype
        health = last.get("health") if args.compression == "scalecom" else None
        if rank == 0:
            checks = "" if not health or "captured" not in health else (
                f"  captured {health['captured']:.2f} overlap {health['overlap']:.2f} "
                f"dense tensors {health['dense_tensors']}")
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy "
                  f"{100 * accuracy:6.2f}%  gradient bytes/step {sent:9,} vs dense {dense_bytes:,} "
                  f"({reduction:5.1f}x fewer over the run){checks}", flush=True)
        epoch_done.assign(epoch + 1)
        if manager is not None:
            manager.save(checkpoint_number=epoch + 1)
    if rank == 0:
        result = {"compression": args.compression, "workers": size, "accuracy": accuracy,
                  "loss": mean_loss, "sent_bytes_last_step": sent, "dense_bytes_per_step": dense_bytes,
                  "reduction": reduction, "seconds": time.perf_counter() - start,
                  "epochs": int(epoch_done),
                  "weights_l2": float(np.sqrt(sum(np.sum(np.square(v.numpy()))
                                                  for v in model.trainable_variables)))}
        if health:
            result["health"] = {key: value for key, value in health.items() if key != "by_tensor"}
        print("result " + json.dumps(result), flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f)


def evaluate(model, x, y):
    logits = model(x, training=False)
    return float(np.mean(np.argmax(logits, axis=1) == y))


if __name__ == "__main__":
    sys.exit(main())
