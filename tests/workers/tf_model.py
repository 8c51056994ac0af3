"""The TensorFlow workers' shared model: a rank's batch of step t and the loss of a 48-h-10 MLP."""

import numpy as np
import tensorflow as tf


def batch(t, rank):
    """``rank``'s batch of step ``t``: the same on resumed runs."""
    gen = np.random.RandomState(10000 * t + rank)
    return (tf.constant(gen.randn(16, 48).astype(np.float32)),
            tf.constant(gen.randint(0, 10, size=16).astype(np.int32)))


def loss_of(weights, x, y):
    w1, b1, w2, b2 = weights
    logits = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
