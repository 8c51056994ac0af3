"""One Horovod worker of ``benchmarks.overhead``: the same model trained under several schemes in one
job, the schemes taking turns step by step, on PyTorch or TensorFlow; rank 0 prints ``RESULT {json}``.

    python benchmarks/_overhead_worker.py SPEC_JSON

SPEC_JSON holds ``framework`` (``torch`` or ``tensorflow``), ``model``, ``size`` (see
``benchmarks.models``), ``batch``, ``warmup``, ``steps`` and ``jobs``: ``[[NAME, KWARGS], ...]`` with
NAME ``dense``, ``fp16`` or ``scalecom`` (KWARGS its constructor's). Every job gets a copy of the
model (the same weights), its own optimizer and its own compression, and one more copy, stepped with
no communication at all, is the floor. A round runs one step of each (the floor included) in an
order that rotates from round to round, so that a slow spell of the shared machine falls on all of
them alike; each step starts after a barrier and its time is the slowest rank's.
"""

import copy
import json
import statistics
import sys
import time

import torch

from benchmarks.models import build_keras_model, build_model, make_batch, numpy_batch, task_loss

FLOOR = "floor"


def torch_steps(spec, jobs):
    """``({name: step()}, barrier(), slowest(seconds), stats)`` on PyTorch: one ``hvd.DistributedOptimizer``
    per job over its own copy of the model."""
    import horovod.torch as hvd

    from hvd_scalecom.torch import ScaleCom

    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    name, size = spec["model"], spec["size"]
    model = build_model(name, size)
    x, y = make_batch(name, size, spec["batch"], torch.Generator().manual_seed(1000 + hvd.rank()))
    steps, stats = {}, {}

    def make_step(net, optimizer):
        def step():
            optimizer.zero_grad()
            task_loss(net(x), y).backward()
            optimizer.step()
        return step

    for label, (scheme, kwargs) in jobs.items():
        net = copy.deepcopy(model)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        if scheme != FLOOR:
            named = [(f"{label}.{n}", p) for n, p in net.named_parameters()]
            compression = {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(scheme)
            if scheme == "scalecom":
                compression = stats[label] = ScaleCom(named, **kwargs)
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=named, compression=compression)
        steps[label] = make_step(net, optimizer)

    def slowest(seconds):
        return float(hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), op=hvd.Max, name="overhead.slowest"))

    return steps, lambda: hvd.allreduce(torch.zeros(1), name="overhead.barrier"), slowest, stats, hvd


def tensorflow_steps(spec, jobs):
    """The same on TensorFlow: one ``hvd_scalecom.tensorflow.make_train_step`` per job over its own
    Keras 3 copy of the model; the floor a plain ``tf.GradientTape`` step in a ``tf.function``."""
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from hvd_scalecom.tensorflow import ScaleCom, make_train_step

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    keras.utils.set_random_seed(0)
    name, size = spec["model"], spec["size"]
    model = build_keras_model(name, size)
    x, y = numpy_batch(name, make_batch(name, size, spec["batch"], torch.Generator().manual_seed(1000 + hvd.rank())))
    x, y = tf.constant(x), tf.constant(y)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    steps, stats = {}, {}
    for label, (scheme, kwargs) in jobs.items():
        net = keras.models.clone_model(model)
        net.set_weights(model.get_weights())
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        if scheme == FLOOR:
            optimizer.build(net.trainable_variables)

            @tf.function
            def local_step(inputs, targets, net=net, optimizer=optimizer):
                with tf.GradientTape() as tape:
                    value = loss(targets, net(inputs, training=True))
                optimizer.apply(tape.gradient(value, net.trainable_variables), net.trainable_variables)
                return value

            steps[label] = lambda step=local_step: float(step(x, y))
            continue
        compression = {"dense": hvd.Compression.none, "fp16": hvd.Compression.fp16}.get(scheme)
        if scheme == "scalecom":
            compression = stats[label] = ScaleCom(net.trainable_variables, **kwargs)
        train = make_train_step(net, optimizer, loss, compression)
        steps[label] = lambda step=train: float(step(x, y))  # (float: waits for the step)

    def slowest(seconds):
        return float(hvd.allreduce(tf.constant([seconds], tf.float64), op=hvd.Max, name="overhead.slowest")[0])

    return steps, lambda: hvd.allreduce(tf.zeros(1), name="overhead.barrier").numpy(), slowest, stats, hvd


def main(spec):
    jobs = {FLOOR: (FLOOR, {})}
    for name, kwargs in spec["jobs"]:
        label = name if not kwargs else f"{name}:{json.dumps(kwargs, sort_keys=True)}"
        jobs[label] = (name, kwargs)
    build = torch_steps if spec["framework"] == "torch" else tensorflow_steps
    steps, barrier, slowest, stats, hvd = build(spec, jobs)
    labels = list(jobs)
    seconds = {label: [] for label in labels}
    compress = {label: [] for label in stats}
    for round_ in range(spec["warmup"] + spec["steps"]):
        for turn in range(len(labels)):
            label = labels[(round_ + turn) % len(labels)]
            barrier()
            start = time.perf_counter()
            steps[label]()
            elapsed = slowest(time.perf_counter() - start)
            if round_ >= spec["warmup"]:
                seconds[label].append(elapsed)
                if label in stats and spec["framework"] == "torch":
                    s = stats[label].stats()
                    compress[label].append((s["compress_seconds"], s["index_wait_seconds"]))
    if hvd.rank() != 0:
        return
    dense = seconds.get("dense")
    rows = []
    for label in labels:
        row = {"label": label, "scheme": jobs[label][0], "kwargs": jobs[label][1],
               "median_step_seconds": statistics.median(seconds[label]), "step_seconds": seconds[label]}
        if dense:  # (a ratio round by round cancels much of the drift of a shared machine)
            row["vs_dense"] = statistics.median(s / d for s, d in zip(seconds[label], dense))
        row["vs_floor"] = statistics.median(s / f for s, f in zip(seconds[label], seconds[FLOOR]))
        if compress.get(label):
            row["compress_seconds"] = statistics.median(c for c, _ in compress[label])
            row["index_wait_seconds"] = statistics.median(w for _, w in compress[label])
        rows.append(row)
    print("RESULT " + json.dumps({"framework": spec["framework"], "model": spec["model"], "workers": hvd.size(),
                                  "rows": rows}), flush=True)


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
