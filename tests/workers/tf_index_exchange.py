"""Compare ScaleCom's two ways of handing the leader's indices to every rank (TensorFlow frontend):
``index_exchange="broadcast"`` (tf.switch_case over one HorovodBroadcast per root) and
``"allreduce"`` (integer Sum-allreduce, non-leaders contribute zeros).

Not a test: run it by hand, preferably in a network namespace of its own so that the loopback byte
counters see this job only::

    ip netns add scbench && ip netns exec scbench ip link set lo up
    ip netns exec scbench horovodrun -np 2 -H localhost:2 --gloo python \\
        tests/workers/tf_index_exchange.py '{"layers": [[1024, 1024]], "steps": 60}' /tmp/out

Both options train the same model in the same job, in alternating blocks of ``steps`` steps. Rank 0
prints per option: median step time (the slowest rank's), loopback bytes sent per step by all ranks
together (``/sys/class/net/lo/statistics/tx_bytes``), and the index payload per step.
"""

import json
import os
import sys
import time

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvd_scalecom.tensorflow import ScaleCom

try:
    tf.config.threading.set_intra_op_parallelism_threads(1)
except RuntimeError:  # TF started by an earlier run in this process (tests/jobs.py): TF_NUM_INTRAOP_THREADS=1 holds
    pass
opts = json.loads(sys.argv[1])
out_dir = sys.argv[2]
hvd.init()
rank, size = hvd.rank(), hvd.size()
layers = [tuple(s) for s in opts.get("layers", [[1024, 1024]])]
steps, blocks = opts.get("steps", 60), opts.get("blocks", 2)
ratio = opts.get("ratio", 0.01)

tf.random.set_seed(0)
weights = [tf.Variable(tf.random.normal(s, stddev=0.05)) for s in layers]
hvd.broadcast_variables(weights, root_rank=0)
data = tf.random.stateless_normal([32, layers[0][0]], seed=[rank, 0])


def make_step(compression):
    @tf.function
    def step():
        with tf.GradientTape() as tape:
            h = data
            for w in weights:
                h = tf.tanh(tf.matmul(h, w))
            loss = tf.reduce_mean(h * h)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        for w, g in zip(weights, tape.gradient(loss, weights)):
            w.assign_sub(0.01 * g)
    return step


options = {name: make_step(ScaleCom(weights, ratio=ratio, beta=0.5, min_numel=1, index_exchange=name))
           for name in ("broadcast", "allreduce")}


def lo_tx_bytes():
    with open("/sys/class/net/lo/statistics/tx_bytes") as f:
        return int(f.read())


def barrier(name):
    hvd.allreduce(tf.constant(0.0), name=name)


for step in options.values():  # trace and warm up outside the measured blocks
    for _ in range(3):
        step()
seconds = {name: [] for name in options}
tx = {name: 0 for name in options}
for block in range(blocks):
    for name, step in options.items():
        barrier(f"before.{block}.{name}")
        sent_before = lo_tx_bytes()
        for _ in range(steps):
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
        barrier(f"after.{block}.{name}")
        tx[name] += lo_tx_bytes() - sent_before

slowest = {name: hvd.allreduce(tf.constant(np.median(s)), op=hvd.Max, name=f"median.{name}").numpy()
           for name, s in seconds.items()}
k_total = sum(max(1, int(np.ceil(ratio * np.prod(s)))) for s in layers)
result = {"size": size, "layers": layers, "k_total": k_total, "index_payload_bytes": 4 * k_total,
          "median_step_ms": {n: 1000 * float(v) for n, v in slowest.items()},
          "lo_tx_bytes_per_step": {n: tx[n] / (steps * blocks) for n in options}}
if rank == 0:
    print("result " + json.dumps(result), flush=True)
    with open(os.path.join(out_dir, "index_exchange.json"), "w") as f:
        json.dump(result, f)
