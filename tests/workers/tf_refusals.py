"""One rank of a job where ScaleCom (TF) refuses steps through ``hvd.DistributedGradientTape``.

argv: JSON options (unused), output directory. Writes ``rank<R>.npz`` with:

* ``bypass/...``: four variables of one shape, the second one's gradient sparse (an
  ``IndexedSlices``, which Horovod allgathers past ``compress``), so the third and fourth gradients
  go to the second and third variables. Step 0 goes through; step 1 is refused. ``steps/<when>``,
  ``tallies/<when>``, ``memories/<when>`` and ``stats/<when>`` are the state after step 0 and after
  the refused step; ``error`` its message; ``after`` a Sum-allreduce of the rank run after it.
* ``groups/error``: the ValueError of ``groups=1`` with fp16 values and a variable below min_numel.
* ``groups_order/...``: ``groups=`` as lists of variables out of ScaleCom's order (``swapped``
  groups, or a ``partial`` one, after which Horovod reduces the variables in no group): each step's
  ``error`` (eager and traced) and the step counters after them (``refused_steps``); then a traced
  step with lists in ScaleCom's order: the counters (``in_order_steps``), the first variable
  (``weight``) and its reduced gradient (``grad``).
* ``op/<eager|function>/error``: a warm-up step of a tape with ``op=hvd.Sum`` and a ScaleCom that
  averages.
* ``xla/...``: a step in ``tf.function(jit_compile=True)``: its ``error``, the step counters
  (``steps``) and weights (``moved``: whether any changed) after it.
* ``frozen/<step|fit>/...``: a Keras model's first layer frozen after a ``make_train_step`` step, its
  last layer frozen after a ``model.fit`` step and compiled again with a new ``DistributedOptimizer``
  around the same ScaleCom: the next step's ``error``, ``moved`` and ``steps``.
* ``unused/<step|fit>/...``: a Keras model with a layer the loss does not use (None gradients), trained
  by ``make_train_step`` or ``model.fit`` with ``DistributedOptimizer``: the first step's ``error``,
  ``moved`` and ``steps``.
"""

import json
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


def state(compression, when):
    record[f"bypass/steps/{when}"] = np.array([int(s.numpy()) for s in compression.steps])
    record[f"bypass/tallies/{when}"] = np.array([s.tally.numpy() for s in compression._slots])
    record[f"bypass/memories/{when}"] = np.stack([m.numpy() for m in compression.memories])
    record[f"bypass/stats/{when}"] = np.array(json.dumps(compression.stats()))


rng = np.random.default_rng(0)  # the same weights on every rank
weights = [tf.Variable(rng.standard_normal([16, 100]), dtype=tf.float32) for _ in range(4)]
compression = ScaleCom(weights, ratio=0.01, beta=0.5, min_numel=10)


@tf.function
def bypassing_step(scale):
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(tf.gather(w, [0, 3]) if i == 1 else w * w * scale)
                   for i, w in enumerate(weights))
    return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, weights)


bypassing_step(tf.constant(float(rank + 1)))
state(compression, "first")
try:
    bypassing_step(tf.constant(float(rank + 3)))
    record["bypass/error"] = np.array("")
except tf.errors.InvalidArgumentError as error:
    record["bypass/error"] = np.array(error.message)
state(compression, "refused")
record["bypass/after"] = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum, name="after").numpy()

small = [tf.Variable(tf.zeros([3000])), tf.Variable(tf.zeros([10]))]
fp16_values = ScaleCom(small, ratio=0.01, min_numel=100, value_dtype="float16")


@tf.function
def grouped_step():
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(w * w) for w in small)
    return hvd.DistributedGradientTape(tape, compression=fp16_values, groups=1).gradient(loss, small)


try:
    grouped_step()
    record["groups/error"] = np.array("")
except (ValueError, TypeError) as error:
    record["groups/error"] = np.array(f"{type(error).__name__}: {error}")

listed = [tf.Variable(rng.standard_normal(shape), dtype=tf.float32, name=f"listed{i}")  # (Horovod
          for i, shape in enumerate([(40, 30), (5,), (30, 10), (10,)])]  # matches groups by name)
listed_compression = ScaleCom(listed, ratio=0.05, min_numel=100)


def listed_step(groups):
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(w * w) for w in listed)
    return hvd.DistributedGradientTape(tape, compression=listed_compression, groups=groups).gradient(
        loss, listed)


for label, groups in (("swapped", [listed[2:], listed[:2]]), ("partial", [[listed[0], listed[2]]])):
    for mode in ("eager", "function"):
        try:
            (tf.function(lambda: listed_step(groups)) if mode == "function" else lambda: listed_step(groups))()
            record[f"groups_order/{label}/{mode}/error"] = np.array("")
        except ValueError as error:
            record[f"groups_order/{label}/{mode}/error"] = np.array(f"{type(error).__name__}: {error}")
record["groups_order/refused_steps"] = np.array([int(s.numpy()) for s in listed_compression.steps])
grads = tf.function(lambda: listed_step([listed[:2], listed[2:]]))()
record["groups_order/in_order_steps"] = np.array([int(s.numpy()) for s in listed_compression.steps])
record["groups_order/weight"], record["groups_order/grad"] = listed[0].numpy(), grads[0].numpy()

for mode in ("eager", "function"):  # a tape that sums, a ScaleCom that averages: refused in warm-up
    mismatched_weights = [tf.Variable(tf.ones([3000]) * (i + 1)) for i in range(2)]
    averaging = ScaleCom(mismatched_weights, ratio=0.01, min_numel=100, warmup_steps=1)

    def summing_step():
        with tf.GradientTape() as tape:
            loss = sum(tf.reduce_sum(w * w) for w in mismatched_weights)
        return hvd.DistributedGradientTape(tape, compression=averaging, op=hvd.Sum).gradient(
            loss, mismatched_weights)

    try:
        (tf.function(summing_step) if mode == "function" else summing_step)()
        record[f"op/{mode}/error"] = np.array("")
    except tf.errors.InvalidArgumentError as error:
        record[f"op/{mode}/error"] = np.array(error.message)

xla_weights = [tf.Variable(tf.ones([3000]) * (i + 1)) for i in range(2)]
xla_compression = ScaleCom(xla_weights, ratio=0.01, min_numel=100)


@tf.function(jit_compile=True)
def xla_step():
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(w * w) for w in xla_weights)
    grads = hvd.DistributedGradientTape(tape, compression=xla_compression).gradient(loss, xla_weights)
    for w, g in zip(xla_weights, grads):
        w.assign_sub(0.1 * g)


try:
    xla_step()
    record["xla/error"] = np.array("")
except Exception as error:  # (before: XLA's InvalidArgumentError naming ScaleCom's Timestamp op)
    record["xla/error"] = np.array(f"{type(error).__name__}: {error}")
record["xla/steps"] = np.array([int(s.numpy()) for s in xla_compression.steps])
record["xla/moved"] = np.array(any(bool(np.any(w.numpy() != (i + 1))) for i, w in enumerate(xla_weights)))

import keras  # noqa: E402

from hvd_scalecom.tensorflow import DistributedOptimizer, make_train_step  # noqa: E402

x = tf.constant(np.random.default_rng(rank).standard_normal([16, 48]), tf.float32)
y = tf.constant(np.arange(16) % 10, tf.int32)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
for how in ("step", "fit"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((48,)), keras.layers.Dense(64, activation="tanh"),
                              keras.layers.Dense(10)])
    frozen_compression = ScaleCom(model.trainable_variables, ratio=0.05, beta=0.5, min_numel=600)
    if how == "step":
        train_step = make_train_step(model, keras.optimizers.SGD(0.1), loss_fn, frozen_compression)
        train_step(x, y)
        frozen = model.layers[0]
    else:
        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), frozen_compression),
                      loss=loss_fn, jit_compile=False)
        model.fit(x, y, batch_size=16, verbose=0, shuffle=False)
        frozen = model.layers[1]
    frozen.trainable = False
    before = [w.numpy() for w in model.weights]
    try:
        if how == "step":
            train_step(x, y)
        else:  # (before: the first step went through, the next one was refused naming None gradients)
            model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), frozen_compression),
                          loss=loss_fn, jit_compile=False)
            model.fit(x, y, batch_size=8, verbose=0, shuffle=False)
        record[f"frozen/{how}/error"] = np.array("")
    except Exception as error:
        record[f"frozen/{how}/error"] = np.array(f"{type(error).__name__}: {error}")
    record[f"frozen/{how}/moved"] = np.array([bool(np.any(w.numpy() != b)) for w, b in zip(model.weights, before)])
    record[f"frozen/{how}/steps"] = np.array([int(s.numpy()) for s in frozen_compression.steps])



class Unused(keras.Model):
    """Three Dense layers of one shape; the middle one takes no part in the loss (None gradients)."""

    def __init__(self):
        super().__init__()
        self.first, self.unused, self.last = (keras.layers.Dense(40) for _ in range(3))

    def call(self, inputs):
        return self.last(self.first(inputs))


for how in ("step", "fit"):
    keras.utils.set_random_seed(0)
    model = Unused()
    model(x[:, :40])
    model.unused.build((None, 40))
    unused_compression = ScaleCom(model.trainable_variables, ratio=0.05, beta=0.5, min_numel=30)
    before = [w.numpy() for w in model.weights]
    try:  # (before: the step went through, the last layer's gradients compressed with the unused
        # layer's memories, and the next step was refused blaming a sparse or None gradient)
        if how == "step":
            make_train_step(model, keras.optimizers.SGD(0.1), "mse", unused_compression)(x[:, :40], x[:, 8:])
        else:
            model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.1), unused_compression),
                          loss="mse", jit_compile=False)
            model.fit(x[:, :40], x[:, 8:], batch_size=16, verbose=0, shuffle=False)
        record[f"unused/{how}/error"] = np.array("")
    except Exception as error:
        record[f"unused/{how}/error"] = np.array(f"{type(error).__name__}: {error}")
    record[f"unused/{how}/moved"] = np.array([bool(np.any(w.numpy() != b)) for w, b in zip(model.weights, before)])
    record[f"unused/{how}/steps"] = np.array([int(s.numpy()) for s in unused_compression.steps])

np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
hvd.allreduce(tf.constant(0.0), name="worker_done")
print(f"rank {rank} done", flush=True)
