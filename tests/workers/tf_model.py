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


def designed_batch(t, rank, size, low_until, shapes, ratio=0.05):
    """Gradients made to order (the loss :func:`designed_loss` has them as its gradients), for the
    health check: small noise shared by every rank plus, per tensor, k shared entries; before step
    ``low_until`` each rank also has k large entries of its own (disjoint between ranks), so that the
    leader's top-k misses much of the mean's (captured well below 0.9), from then on only the shared
    entries stand out (captured 1)."""
    grads = []
    for i, shape in enumerate(shapes):
        numel = int(np.prod(shape))
        k = max(1, int(np.ceil(ratio * numel)))
        shared = np.random.RandomState(100 * t + i)
        g = 0.01 * shared.randn(numel)
        order = shared.permutation(numel)
        if t < low_until:
            g[order[:k]] += 0.8
            own = np.random.RandomState(100 * t + 10 * i + rank + 7)
            g[order[(rank + 1) * k:(rank + 2) * k]] += own.uniform(1, 2, k) * own.choice([-1, 1], k)
        else:
            g[order[:k]] += 3.0
        grads.append(tf.constant(g.reshape(shape).astype(np.float32)))
    assert (size + 1) * max(1, int(np.ceil(ratio * int(np.prod(shapes[0]))))) <= int(np.prod(shapes[0]))
    return tuple(grads), tf.zeros([1], tf.int32)


def designed_loss(weights, x):
    """``sum_i <w_i, x_i>``: its gradients are ``x``."""
    return tf.add_n([tf.reduce_sum(w * c) for w, c in zip(weights, x)])
