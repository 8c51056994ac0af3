"""One rank of a small ScaleCom training run on hvd.DistributedGradientTape under horovodrun.

argv: JSON options, output directory. Writes ``rank<R>.npz`` with, per step t and variable name,
``raw/<t>/<name>`` (this rank's own gradient, from a plain tape), ``applied/<t>/<name>`` (the
reduced gradient the update applied), ``final/<name>`` (weights), the compressor's ``stats`` and,
with ``checkpoint_at``, a tf.train.Checkpoint per rank. With ``tensorboard``, each rank writes
``stats()`` to TensorBoard events in ``tb<R>`` after every step (``log_stats``; the ``LogStats``
callback during ``model.fit``, at the optimizer's iteration count) and records it as
``tb_stats/<logged step>``. ``mode``: ``"function"`` (the step is a tf.function), ``"eager"``, or
``"keras"`` (a Keras 3 model trained by ``make_train_step``, eagerly from step ``eager_from``, by
``model.fit`` with ``DistributedOptimizer`` from step ``fit_from``: one ``fit`` call per step, or,
with ``steps_per_execution``, one for all the steps left, whose weights after each step the model
keeps; ``loss_scale``: the fit optimizer is a ``LossScaleOptimizer`` of that initial scale,
``policy``: the Keras dtype policy). ``health``: the health check's options (``check_every``, ...);
``designed``: ``{"low_until": T}``, gradients made to order (tf_model.designed_batch) instead of the
MLP's; ``record_stats``: ``stats/<t>`` after every step and the warnings each ``stats()`` gave, as
``warnings/<t>``; ``reload_at``: after that many steps, a new ScaleCom loads the state_dict() and
trains on.
"""

import json
import os
import sys
import warnings

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from tf_model import batch, designed_batch, designed_loss, loss_of

from hvd_scalecom.tensorflow import ScaleCom, log_stats

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # TF started by an earlier run in this process (tests/jobs.py): TF_NUM_INTRAOP_THREADS=1 holds
    pass
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
process_set = hvd.ProcessSet(opts["process_set"]) if opts.get("process_set") else None
hvd.init(process_sets=[process_set] if process_set else None)
rank = hvd.rank()
member = process_set is None or rank in process_set.ranks  # ranks outside the set: see below
set_kwargs = {"process_set": process_set} if process_set else {}
OP = hvd.Sum if opts.get("op") == "sum" else hvd.Average  # given to the tape and to ScaleCom
NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
HIDDEN = opts.get("hidden", 64)
SHAPES = [(48, HIDDEN), (HIDDEN,), (HIDDEN, 10), (10,)]  # 3072, 64, 640, 10 entries by default
LR = opts.get("lr", 0.1)
mode = opts.get("mode", "function")
writer = tf.summary.create_file_writer(os.path.join(out_dir, f"tb{rank}")) if opts.get("tensorboard") \
    else None


def make_compression(variables):
    return ScaleCom(variables, ratio=opts.get("ratio", 0.05), beta=opts.get("beta", 0.5),
                    warmup_steps=opts.get("warmup_steps", 0), min_numel=opts.get("min_numel", 600),
                    leader=opts.get("leader", "cyclic"), selection=opts.get("selection", "exact"),
                    value_dtype=opts.get("value_dtype"), index_dtype=opts.get("index_dtype", "int32"),
                    index_exchange=opts.get("index_exchange", "broadcast"),
                    pipelined=opts.get("pipelined", False), op=OP, **opts.get("health", {}), **set_kwargs)


if opts.get("designed"):  # gradients made to order (the loss is linear in the weights)
    def batch(t, rank):
        return designed_batch(t, rank, hvd.size(), opts["designed"]["low_until"], SHAPES, opts.get("ratio", 0.05))

    def loss_of(weights, x, y):
        return designed_loss(weights, x)


if mode == "keras":
    import keras

    from hvd_scalecom.tensorflow import (
        BroadcastInitialState,
        DistributedOptimizer,
        LogStats,
        gradient_sources,
        make_train_step,
    )

    keras.backend.clear_session()  # (as in a new process: tests/workers/sequence.py runs several runs in one)
    keras.utils.set_random_seed(0)
    keras.mixed_precision.set_global_policy(opts.get("policy") or "float32")

    class Recorded(keras.Sequential):
        """Keeps its weights after each step of fit in ``trace``, at row ``traced`` (counted from 1)."""

        def train_step(self, data):
            logs = super().train_step(data)
            row = traced.assign_add(1)
            for kept, w in zip(trace, gradient_sources(self.trainable_variables)):
                kept.scatter_nd_update([[row]], [w.read_value()])
            return logs

    model = Recorded([keras.Input((48,)), keras.layers.Dense(HIDDEN, activation="tanh"),
                      keras.layers.Dense(10)])
    compression = make_compression(model.trainable_variables)
    trace = [tf.Variable(tf.zeros([opts.get("steps", 6) + 1, *s])) for s in SHAPES]
    traced = tf.Variable(0)
    executions = []  # the last batch of each execution of a fit

    def sgd():  # "loss_scale_factor": make_train_step and fit scale the loss, the optimizer unscales
        return keras.optimizers.SGD(LR, loss_scale_factor=opts.get("loss_scale_factor"))

    def fit_optimizer():
        if opts.get("loss_scale"):  # (the loss scaled by its dynamic scale, the gradients unscaled)
            return keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=opts["loss_scale"])
        return sgd()

    optimizer = sgd()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    train_step = make_train_step(model, optimizer, loss_fn, compression)
    # From step "eager_from" on, the same model, optimizer and ScaleCom train eagerly.
    eager_step = make_train_step(model, optimizer, loss_fn, compression, jit=False)
    weights = gradient_sources(model.trainable_variables)  # kernel, bias, kernel, bias: as NAMES
    # From step "fit_from" on, model.fit trains it, reducing through DistributedOptimizer.
    model.compile(optimizer=DistributedOptimizer(fit_optimizer(), compression), loss=loss_fn,
                  jit_compile=False, steps_per_execution=opts.get("steps_per_execution", 1))
else:
    tf.random.set_seed(0)
    weights = [tf.Variable(tf.random.normal(s, stddev=0.2), name=n.replace(".", "_"))
               for n, s in zip(NAMES, SHAPES)]
    hvd.broadcast_variables(weights, root_rank=0)
    compression = make_compression(weights)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(weights, x, y)
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=OP, **set_kwargs)
        grads = tape.gradient(loss, weights)
        # "skip_nonfinite": what a loss scaler does, skip the update when a gradient is not finite
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]) \
            if opts.get("skip_nonfinite") else tf.constant(True)
        for w, g in zip(weights, grads):
            w.assign_sub(tf.where(finite, LR * g, tf.zeros_like(g)))
        return grads

    if mode == "function":
        step = tf.function(step)
    elif mode == "v1_optimizer":  # Horovod's own optimizer wrapper, around a tf.compat.v1 optimizer
        v1_optimizer = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(LR),
                                                compression=compression, op=OP, **set_kwargs)

        def step(x, y):
            v1_optimizer.minimize(lambda: loss_of(weights, x, y), var_list=weights)


def own_gradients(x, y):
    if opts.get("policy"):  # as fit takes them: in the policy's dtypes, of the scaled loss, unscaled
        scale = opts.get("loss_scale", 1.0)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True)) * scale
        return [g / scale for g in tape.gradient(loss, weights)]
    with tf.GradientTape() as tape:
        loss = loss_of(weights, x, y)
    return tape.gradient(loss, weights)


def checkpoint_for(compression):
    return tf.train.Checkpoint(weights=weights, compression=compression)


def train(first_step, steps, record, compression_used, label=""):
    global compression, step  # (replaced at "reload_at")
    for t in range(first_step, first_step + steps):
        x, y = batch(t, rank)
        poison = opts.get("poison")  # {"rank", "step"}: a NaN input makes that rank's gradients NaN
        if poison and (poison["rank"], poison["step"]) == (rank, t):
            x = tf.tensor_scatter_nd_update(x, [[0, 7]], [float("nan")])
        fit_from = opts.get("fit_from", 10**9)
        at_once = mode == "keras" and opts.get("steps_per_execution") and t >= fit_from
        if at_once and t > fit_from:  # (one fit took every step: back to the weights before step t)
            for w, kept in zip(weights, trace):
                w.assign(kept[t - fit_from])
        raw = own_gradients(x, y)
        before = [w.numpy() for w in weights]
        if mode == "v1_optimizer":
            step(x, y)
            applied = [(b - w.numpy()) / LR for b, w in zip(before, weights)]  # plain gradient descent
        elif mode != "keras":
            applied = [g.numpy() for g in step(x, y)]
            if writer is not None and not label:
                log_stats(writer, compression_used, t)
                record[f"tb_stats/{t}"] = np.array(json.dumps(compression_used.stats()))
        else:
            if at_once:
                if t == fit_from:  # every step left in one fit, steps_per_execution at a time
                    traced.assign(0)
                    for kept, w in zip(trace, weights):
                        kept[0].assign(w)
                    data = [batch(s, rank) for s in range(t, first_step + steps)]
                    ends = keras.callbacks.LambdaCallback(  # (once per execution)
                        on_train_batch_end=lambda batch, logs: executions.append(batch))
                    model.fit(tf.concat([d[0] for d in data], 0), tf.concat([d[1] for d in data], 0),
                              batch_size=16, epochs=1, shuffle=False, verbose=0,
                              callbacks=[BroadcastInitialState(), ends])
                    assert int(traced.numpy()) == len(data)
                    record["fit_executions"] = np.array(executions)
                for w, kept in zip(weights, trace):
                    w.assign(kept[t - fit_from + 1])
            elif t >= fit_from:
                callbacks = [BroadcastInitialState()] if t == fit_from else []
                if writer is not None:
                    callbacks.append(LogStats(compression_used, writer))
                model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0,
                          callbacks=callbacks)
                if writer is not None:
                    iterations = int(model.optimizer.iterations.numpy())
                    record[f"tb_stats/{iterations}"] = np.array(json.dumps(compression_used.stats()))
            else:
                (eager_step if t >= opts.get("eager_from", 10**9) else train_step)(x, y)
            applied = [(b - w.numpy()) / LR for b, w in zip(before, weights)]  # SGD, no momentum
        for name, r, a in zip(NAMES, raw, applied):
            record[f"{label}raw/{t}/{name}"] = r.numpy()
            record[f"{label}applied/{t}/{name}"] = a
        if opts.get("record_stats"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                record[f"stats/{t}"] = np.array(json.dumps(compression_used.stats()))
            record[f"warnings/{t}"] = np.array([str(w.message) for w in caught], dtype=str)
        if t + 1 == opts.get("reload_at"):  # a new ScaleCom from state_dict() trains on (retraced)
            state = compression_used.state_dict()
            record["reloaded_state"] = np.array(json.dumps(state["health"]))
            compression = compression_used = make_compression(weights)
            compression.load_state_dict(state)
            step = tf.function(step.python_function)
        if t + 1 == opts.get("checkpoint_at"):
            checkpoint_for(compression_used).write(os.path.join(out_dir, f"ckpt{rank}"))
    for name, w in zip(NAMES, weights):
        record[f"{label}final/{name}"] = w.numpy()
    record[f"{label}stats"] = np.array(json.dumps(compression_used.stats()))
    if mode == "keras" and opts.get("loss_scale"):
        record["dynamic_scale"] = np.array(float(model.optimizer.dynamic_scale.numpy()))
    record[f"{label}steps"] = np.array([int(s.numpy()) for s in compression_used.steps])


record = {}
first_step = opts.get("first_step", 0)
if not member:  # the same steps, which Horovod's tape reduces only on members: its own gradients here
    train(first_step, opts.get("steps", 6), record, compression)
    np.savez(os.path.join(out_dir, f"outsider{rank}.npz"), **record)
elif opts.get("resume_from"):
    assert mode != "keras", "resuming is exercised on the tf.Variable model"
    path = os.path.join(opts["resume_from"], f"ckpt{rank}")
    checkpoint_for(compression).read(path).assert_consumed()
    train(first_step, opts.get("steps", 6), record, compression)
    # Control: the same continuation with a fresh ScaleCom (no residue memories, steps from 0).
    forgetful = make_compression(weights)
    checkpoint_for(forgetful).read(path)  # restores the weights; then forget the compression state
    forgetful.load_state_dict(make_compression(weights).state_dict())
    compression = forgetful
    step = tf.function(step.python_function) if mode == "function" else step  # retrace with it
    train(first_step, opts.get("steps", 6), record, forgetful, label="forgetful/")
else:
    train(first_step, opts.get("steps", 6), record, compression)

if member and opts.get("state_round_trip"):
    # state_dict() -> load_state_dict() into a new object reproduces the state exactly.
    state = compression.state_dict()
    twin = make_compression(weights)
    twin.load_state_dict(state)
    again = twin.state_dict()
    assert again["config"] == state["config"]
    for name, entry in state["params"].items():
        assert again["params"][name]["step"] == entry["step"], name
        if entry["memory"] is None:
            assert again["params"][name]["memory"] is None, name
        else:
            np.testing.assert_array_equal(again["params"][name]["memory"], entry["memory"])
        assert ("next_indices" in entry) == ("next_indices" in again["params"][name]), name
        if "next_indices" in entry:
            assert again["params"][name]["next_indices"][0] == entry["next_indices"][0], name
            np.testing.assert_array_equal(again["params"][name]["next_indices"][1],
                                          entry["next_indices"][1])
    first = state["params"][compression._slots[0].name]
    record["memory/hidden.weight"] = first["memory"]
    if "next_indices" in first:
        record["next_step/hidden.weight"] = np.array(first["next_indices"][0])
        record["next_indices/hidden.weight"] = first["next_indices"][1]
    record["state_round_trip"] = np.array(True)

if writer is not None:
    writer.flush()
if member:
    record["gloo"] = np.array(hvd.gloo_enabled())  # (the controller the job runs under: --gloo or --mpi)
    np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
hvd.allreduce(tf.constant(0.0), name="worker_done")  # nobody shuts Horovod down while others train
hvd.stop_timeline()  # writes every queued timeline event (Horovod drops them at shutdown)
print(f"rank {rank} done", flush=True)
