"""One rank of a job where ranks may build ScaleCom (TF) differently, case after case.

argv: JSON options, output directory. ``opts["cases"]``: a list of ``{"label", "per_rank": {rank:
{ScaleCom argument overrides, "hidden": width, "extra_scalecom": True, "skew_steps": True or
"skew_steps_at": t}}, "eager": bool, "steps": n}``. Each case builds
new variables and a new ScaleCom and trains ``steps`` steps through ``hvd.DistributedGradientTape``
(a tf.function step unless ``eager``). Writes ``rank<R>.npz`` with ``<label>/error`` (the ValueError
or InvalidArgumentError text, empty when the case trained) and, per step t and variable name, ``<label>/raw/<t>/<name>``
(this rank's own gradient) and ``<label>/applied/<t>/<name>`` (the reduced gradient applied).
"""

import json
import os
import sys

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from tf_model import batch, loss_of

from hvd_scalecom.tensorflow import ScaleCom

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # TF started by an earlier run in this process (tests/jobs.py): TF_NUM_INTRAOP_THREADS=1 holds
    pass
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
hvd.init()
rank = hvd.rank()
NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
DEFAULTS = {"ratio": 0.05, "beta": 0.5, "min_numel": 600}


def run_case(index, case, record):
    label = case["label"]
    args = {**DEFAULTS, **case.get("per_rank", {}).get(str(rank), {})}
    hidden = args.pop("hidden", 64)
    # "extra_scalecom": this rank builds one more ScaleCom first, which renames its collectives
    # (scalecom<n>); the other ranks build theirs after the case, so that later cases agree again.
    extra = args.pop("extra_scalecom", False)
    skew = args.pop("skew_steps", False)  # this rank restores a state one step ahead before the first
    skew_at = args.pop("skew_steps_at", None)  # ... or at the top of that step (the job under way)
    extra_elsewhere = any(o.get("extra_scalecom") for o in case.get("per_rank", {}).values()) and not extra
    if extra:
        ScaleCom([tf.Variable(tf.zeros([10]))], min_numel=1)
    gen = np.random.RandomState(index)  # the same initial weights on ranks of the same shapes
    weights = [tf.Variable(0.2 * gen.randn(*s).astype(np.float32))
               for s in [(48, hidden), (hidden,), (hidden, 10), (10,)]]
    compression = ScaleCom(weights, **args)
    def skew_steps():
        state = compression.state_dict()
        for entry in state["params"].values():
            entry["step"] += 1
        compression.load_state_dict(state)

    if skew:
        skew_steps()

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(weights, x, y)
        grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, weights)
        for w, g in zip(weights, grads):
            w.assign_sub(0.1 * g)
        return grads

    if not case.get("eager"):
        step = tf.function(step)
    try:
        for t in range(case.get("steps", 1)):
            if t == skew_at:
                skew_steps()
            x, y = batch(t, rank)
            with tf.GradientTape() as tape:
                loss = loss_of(weights, x, y)
            raw = tape.gradient(loss, weights)
            applied = step(x, y)
            for name, r, a in zip(NAMES, raw, applied):
                record[f"{label}/raw/{t}/{name}"] = r.numpy()
                record[f"{label}/applied/{t}/{name}"] = a.numpy()
        record[f"{label}/error"] = np.array("")
    except (ValueError, tf.errors.InvalidArgumentError) as error:
        record[f"{label}/error"] = np.array(str(error))
    if extra_elsewhere:
        ScaleCom([tf.Variable(tf.zeros([10]))], min_numel=1)


record = {}
for index, case in enumerate(opts["cases"]):
    run_case(index, case, record)
np.savez(os.path.join(out_dir, f"rank{rank}.npz"), **record)
hvd.allreduce(tf.constant(0.0), name="worker_done")
print(f"rank {rank} done", flush=True)
