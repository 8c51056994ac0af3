"""One rank of a job training an embedding (the first variable) and a dense layer with ScaleCom
through ``hvd.DistributedGradientTape(sparse_as_dense=True)``, eagerly and in a tf.function.

argv: JSON options (unused), output directory. Writes ``rank<R>.npz`` with, per mode (``eager``,
``function``), step t and variable i, ``<mode>/raw/<t>/<i>`` (this rank's own gradient, densified)
and ``<mode>/applied/<t>/<i>`` (the reduced gradient the update applied), and ``<mode>/error``.
Eagerly, Horovod reduces in a tf.function of its own, where the densified embedding gradient has
shape (None, 16).
"""

import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_scalecom.tensorflow import ScaleCom

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # TF started by an earlier run in this process (tests/jobs.py): TF_NUM_INTRAOP_THREADS=1 holds
    pass
out_dir = sys.argv[2]
hvd.init()
rank = hvd.rank()
record = {}
for mode in ("eager", "function"):
    rng = np.random.default_rng(0)  # the same weights on every rank
    weights = [tf.Variable(rng.standard_normal([500, 16]) * 0.1, dtype=tf.float32),
               tf.Variable(rng.standard_normal([16, 10]) * 0.1, dtype=tf.float32)]
    compression = ScaleCom(weights, ratio=0.05, beta=0.5, min_numel=100, warmup_steps=1, selection="exact")

    def loss_of(ids, y):
        hidden = tf.reduce_mean(tf.gather(weights[0], ids), axis=1)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=hidden @ weights[1]))

    def step(ids, y):
        with tf.GradientTape() as tape:
            loss = loss_of(ids, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=True)
        grads = tape.gradient(loss, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(0.5 * g)
        return grads

    if mode == "function":
        step = tf.function(step)
    try:
        for t in range(3):
            data = np.random.default_rng(100 * t + rank)
            ids = tf.constant(data.integers(0, 500, [8, 5]), tf.int32)
            y = tf.constant(data.integers(0, 10, [8]), tf.int32)
            with tf.GradientTape() as tape:
                loss = loss_of(ids, y)
            raw = tape.gradient(loss, weights)
            applied = step(ids, y)
            for i, (r, a) in enumerate(zip(raw, applied)):
                record[f"{mode}/raw/{t}/{i}"] = tf.convert_to_tensor(r).numpy()
                record[f"{mode}/applied/{t}/{i}"] = a.numpy()
        record[f"{mode}/error"] = np.array("")
    except Exception as error:  # (before: eagerly, an InaccessibleTensorError at the first step)
        record[f"{mode}/error"] = np.array(f"{type(error).__name__}: {error}")

np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
hvd.allreduce(tf.constant(0.0), name="worker_done")
print(f"rank {rank} done", flush=True)
