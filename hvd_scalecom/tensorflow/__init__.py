"""TensorFlow 2 frontend: ``from hvd_scalecom.tensorflow import ScaleCom``.

``ScaleCom`` is a compression for ``hvd.DistributedGradientTape``; ``make_train_step`` (a custom
loop) and ``DistributedOptimizer`` with ``BroadcastInitialState`` (``model.fit``) train a Keras 3
model with it; ``log_stats`` (or the Keras callback ``LogStats``) writes ``ScaleCom.stats()`` to
TensorBoard. All are imported on first use (and Horovod with them), so that the equations in
:mod:`hvd_scalecom.tensorflow.clt_k` can be used without Horovod.
"""

__all__ = ["ScaleCom", "log_stats", "make_train_step", "gradient_sources", "DistributedOptimizer",
           "BroadcastInitialState", "LogStats"]


def log_stats(writer, compression, step):
    """Write ``compression.stats()`` as ``scalecom/...`` scalars (:func:`hvd_scalecom.monitor.
    stats_scalars`) at ``step`` to a ``tf.summary`` writer (``None``: the default writer).
    Call it eagerly, between steps."""
    import contextlib

    import tensorflow as tf

    from hvd_scalecom.monitor import stats_scalars
    scalars = stats_scalars(compression.stats())
    with writer.as_default() if writer is not None else contextlib.nullcontext():
        for tag, value in scalars.items():
            tf.summary.scalar(tag, value, step=step)


def __getattr__(name):
    if name == "ScaleCom":
        from hvd_scalecom.tensorflow.scalecom import ScaleCom
        return ScaleCom
    if name in __all__:
        from hvd_scalecom.tensorflow import keras as keras_helpers
        return getattr(keras_helpers, name)
    raise AttributeError(f"module 'hvd_scalecom.tensorflow' has no attribute {name!r}")
