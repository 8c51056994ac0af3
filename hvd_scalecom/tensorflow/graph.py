"""Small graph helpers of the TensorFlow ScaleCom: the graph a tensor was traced in, and wall-time
stamps inside a step."""

import tensorflow as tf


def graph_of(tensor):
    """The graph ``tensor`` was traced in; ``None`` eagerly."""
    return None if tf.executing_eagerly() else tensor.graph


def stamp(tensor, *after):
    """``(time, tensor)``: the wall time (float64 seconds) once ``tensor`` (and ``after``) exist, and
    ``tensor`` again, gated on that time so that whatever uses it starts later.

    ``after`` goes through ``tf.identity``: inside a cond branch a control dependency on a tensor of
    the enclosing graph is dropped when TF inlines the branch, a data capture is not."""
    with tf.control_dependencies([tensor, *(tf.identity(a) for a in after)]):
        now = tf.timestamp()
    with tf.control_dependencies([now]):
        return now, tf.identity(tensor)
