"""One Horovod worker of ``benchmarks.slow_link --framework tensorflow``: the Keras 3 twin of
``_slow_link_worker.py``, trained through ``hvd_scalecom.tensorflow.make_train_step`` (Horovod's
``DistributedGradientTape``), with the same spec, counters, floor and ``RESULT`` line.

    python benchmarks/_slow_link_tf_worker.py SPEC_JSON

Schemes: ``COMPRESSORS`` (dense, Horovod's fp16 and ScaleCom). The model is
``benchmarks.models.build_keras_model`` (the torch model's shape), the batch the torch worker's,
in NHWC; the floor is a clone of the model with its own optimizer, stepped by a plain
``tf.GradientTape`` in a ``tf.function``.
"""

import json
import sys

import keras
import tensorflow as tf
import torch

from benchmarks._slow_link_worker import measure
from benchmarks.models import build_keras_model, make_batch, numpy_batch


def _scalecom(hvd, model, kwargs):
    from hvd_scalecom.tensorflow import ScaleCom
    return ScaleCom(model.trainable_variables, **kwargs)


COMPRESSORS = {"dense": lambda hvd, model, kwargs: hvd.Compression.none,
               "fp16": lambda hvd, model, kwargs: hvd.Compression.fp16,
               "scalecom": _scalecom}


def main(spec):
    import horovod.tensorflow as hvd

    from hvd_scalecom.tensorflow import make_train_step

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    keras.utils.set_random_seed(0)
    name, size, widths = spec.get("model", "mlp"), spec.get("size", "full"), spec.get("widths")
    model = build_keras_model(name, size, widths)
    x, y = numpy_batch(name, make_batch(name, size, spec["batch"], torch.Generator().manual_seed(1000 + hvd.rank()),
                                        widths))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    local_model = keras.models.clone_model(model)
    local_model.set_weights(model.get_weights())
    local_optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    local_optimizer.build(local_model.trainable_variables)
    compression = COMPRESSORS[spec["compressor"]](hvd, model, spec.get("kwargs", {}))
    # (broadcasts rank 0's weights and optimizer state, then reduces through DistributedGradientTape)
    step = make_train_step(model, keras.optimizers.SGD(0.01, momentum=0.9), loss, compression)

    @tf.function
    def local_step(inputs, targets):
        with tf.GradientTape() as tape:
            value = loss(targets, local_model(inputs, training=True))
        local_optimizer.apply(tape.gradient(value, local_model.trainable_variables), local_model.trainable_variables)

    def train_step():
        float(step(x, y))  # (waits for the step)

    measure(spec, hvd, train_step, lambda: local_step(x, y),
            lambda tag: hvd.allreduce(tf.zeros(1), name=f"slow_link.barrier.{tag}").numpy(), compression, False,
            sum(int(tf.size(v)) for v in model.trainable_variables))


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
