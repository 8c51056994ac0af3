"""Training a Keras 3 model with ScaleCom and ``hvd.DistributedGradientTape``.

Keras 3 variables have no ``ref()``, so ``hvd.DistributedGradientTape(tape).gradient(loss,
model.trainable_variables)`` fails (Horovod issue #4290), and ``horovod.tensorflow.keras`` does not
work with Keras 3 at all. Taking gradients with respect to the TensorFlow variables underneath
(:func:`gradient_sources`) and applying them to the Keras variables works; :func:`make_train_step`
packages that::

    hvd.init()
    model = keras.Sequential([...]); model.build((None, 64))
    compression = ScaleCom(model.trainable_variables, ratio=0.01, beta=0.5)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = make_train_step(model, keras.optimizers.SGD(0.05), loss_fn,
                           compression)   # also broadcasts rank 0's weights and optimizer state
    for x, y in batches:
        loss = step(x, y)
"""

import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from hvd_scalecom.config import check_int
from hvd_scalecom.tensorflow.scalecom import ScaleCom

__all__ = ["gradient_sources", "make_train_step", "DistributedOptimizer", "BroadcastInitialState",
           "LogStats"]


def gradient_sources(variables):
    """The ``tf.Variable`` under each Keras 3 variable (``tf.Variable``s pass through): what to give
    ``DistributedGradientTape.gradient`` as ``sources``."""
    sources = []
    for index, v in enumerate(variables):
        if isinstance(v, tf.Variable):
            sources.append(v)
        elif isinstance(v, keras.Variable) and isinstance(v.value, tf.Variable):
            sources.append(v.value)
        else:
            raise TypeError(f"variables[{index}] is a {type(v).__name__}, expected a Keras variable "
                            f"of the TensorFlow backend or a tf.Variable")
    return sources


def make_train_step(model, optimizer, loss, compression=None, *, root_rank=0, jit=True,
                    **tape_options):
    """A function ``step(x, y, sample_weight=None) -> loss`` training ``model`` on this rank's batch.

    Each call computes this rank's loss (plus ``model.losses``), reduces the gradients of
    ``optimizer.scale_loss(loss)`` (as Keras's own train step: the scale of ``loss_scale_factor=`` or
    of a ``LossScaleOptimizer``, which the optimizer divides out again; ScaleCom's memories are kept
    in scaled units, not rescaled when a dynamic scale changes) through
    ``hvd.DistributedGradientTape(..., compression=compression, **tape_options)``, applies them with
    ``optimizer`` and returns the unscaled loss. Before returning, ``make_train_step`` builds the
    optimizer and broadcasts the model's and the optimizer's variables from ``root_rank``, so every
    rank starts alike.

    Args:
        model: a built Keras 3 model (TensorFlow backend).
        optimizer: a Keras 3 optimizer, used for this model only.
        loss: a loss callable ``loss(y_true, y_pred)`` or a Keras loss name.
        compression: a :class:`ScaleCom` built for ``model.trainable_variables`` (or any Horovod
            compression; ``None``: dense). With ScaleCom, an optimizer with
            ``gradient_accumulation_steps`` is refused (ValueError), and so is a step where a
            variable gets a ``None`` gradient (before anything is reduced).
        jit: wrap the step in ``tf.function`` (default); ``False`` runs eagerly (Horovod then traces
            its own reduction function once).

    The step trains ``model.trainable_variables`` as they were when it was made: once they change (a
    layer frozen or unfrozen), a call raises ValueError, changing nothing; make a new step (and a
    ScaleCom for the new variables).
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if not model.built or not model.trainable_variables:
        raise ValueError("model must be built (call it once or model.build(input_shape)) and have "
                         "trainable variables")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if getattr(optimizer, "_hvd_scalecom_reduces", False):
        raise ValueError("optimizer is a DistributedOptimizer, which reduces the gradients again after the "
                         "step's own reduction (each compressed twice, every ScaleCom counter moving two "
                         "steps): pass the plain Keras optimizer to make_train_step")
    loss_fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if not callable(loss_fn):
        raise TypeError(f"loss must be a callable or a Keras loss name, got {loss!r}")
    _check_compression(compression)
    check_int(root_rank, "root_rank", 0)
    if compression is None:
        compression = hvd.Compression.none
    elif isinstance(compression, ScaleCom):
        _check_no_accumulation(optimizer)
        compression.check_variables(model.trainable_variables)
        tape_options = {"sparse_as_dense": True, **tape_options}
        _check_reduction(compression, tape_options["sparse_as_dense"], tape_options.get("op", hvd.Average),
                         tape_options.get("process_set", hvd.global_process_set))
    trainable = list(model.trainable_variables)
    sources = gradient_sources(trainable)
    if not optimizer.built:
        optimizer.build(trainable)
    hvd.broadcast_variables(gradient_sources(model.variables) + gradient_sources(optimizer.variables),
                            root_rank=root_rank)
    scale_loss = getattr(optimizer, "scale_loss", lambda loss_value: loss_value)

    def train(x, y, sample_weight=None):
        with tf.GradientTape() as tape:
            prediction = model(x, training=True)
            loss_value = _mean_loss(loss_fn, y, prediction, sample_weight)
            if model.losses:
                loss_value = loss_value + tf.add_n(model.losses)
            scaled_loss = scale_loss(loss_value)
        tape = hvd.DistributedGradientTape(tape, compression=compression, **tape_options)
        if isinstance(compression, ScaleCom):  # (checked before Horovod reduces anything)
            tape._allreduce_grads = _refusing_none(tape._allreduce_grads, trainable)
        grads = tape.gradient(scaled_loss, sources)
        optimizer.apply_gradients(zip(grads, trainable))
        return loss_value

    train = tf.function(train) if jit else train
    trainable_ids = [id(v) for v in trainable]

    def step(x, y, sample_weight=None):
        if [id(v) for v in model.trainable_variables] != trainable_ids:  # (a frozen layer would train on)
            raise ValueError(
                f"model.trainable_variables changed since make_train_step (a layer frozen or unfrozen: "
                f"{len(trainable_ids)} then, {len(model.trainable_variables)} now); the step trains those "
                f"of then, and ScaleCom matches gradients to its variables by position: make a new step "
                f"(with a ScaleCom built for model.trainable_variables)")
        return train(x, y, sample_weight)

    return step


def DistributedOptimizer(optimizer, compression=None, *, sparse_as_dense=None,
                         process_set=hvd.global_process_set):
    """A copy of the Keras 3 ``optimizer`` whose ``apply_gradients`` first reduces the gradients
    through Horovod (the same reduction ``DistributedGradientTape`` runs), for ``model.fit``::

        model.compile(optimizer=DistributedOptimizer(keras.optimizers.SGD(0.05), compression),
                      loss=..., jit_compile=False)
        model.fit(x, y, callbacks=[BroadcastInitialState()])

    Gradients must come in the order of the variables ScaleCom was built with (``fit`` passes
    ``model.trainable_weights``, which is ``model.trainable_variables``). The reduction uses
    ScaleCom's ``op`` (``hvd.Average`` for other compressions) and ``process_set``, which must be
    ScaleCom's; ``sparse_as_dense`` defaults to True with ScaleCom (else False). With ScaleCom, a step
    whose variables are not ScaleCom's (layers frozen or unfrozen since it was built, then compiled
    again) is refused with a ValueError before any gradient is reduced. ``steps_per_execution > 1``
    works (each step of an execution is reduced as alone); XLA (``jit_compile``) does not: Horovod's
    ops have no XLA kernels. With ScaleCom, an optimizer with ``gradient_accumulation_steps`` is
    refused (ValueError): every micro-batch would be compressed and exchanged; so is a step where a
    variable gets a ``None`` gradient (a layer the loss does not use), before anything is reduced. Under a
    ``mixed_float16`` policy, wrap a ``LossScaleOptimizer``, as ``compile`` would put its own around
    this optimizer and skip the reduction (refused): ScaleCom then compresses the scaled gradients.

    The copy is built from ``optimizer.get_config()`` and keeps its weight-decay exclusions
    (``exclude_from_weight_decay``, its inner optimizer's too for a ``LossScaleOptimizer``); other
    settings made on the object after construction are not carried over.

    A model compiled with it saves (``model.save``), but Keras cannot rebuild this optimizer's class
    from the file: load with ``keras.models.load_model(path, compile=False)`` and compile again with
    a new ``DistributedOptimizer`` (ScaleCom's own state: ``tf.train.Checkpoint`` or ``state_dict``).
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"optimizer must be a keras.optimizers.Optimizer, got {type(optimizer).__name__}")
    if optimizer.built:
        raise ValueError("optimizer must not be built yet: wrap it before training")
    _check_compression(compression)
    scalecom = isinstance(compression, ScaleCom)
    if sparse_as_dense is None:
        sparse_as_dense = scalecom
    if not isinstance(sparse_as_dense, bool):
        raise TypeError(f"sparse_as_dense must be True or False, got {sparse_as_dense!r}")
    op = compression.op if scalecom else hvd.Average
    if scalecom:
        _check_no_accumulation(optimizer)
        _check_reduction(compression, sparse_as_dense, op, process_set)
    reduce = hvd._make_allreduce_grads_fn(  # Horovod's own, as in DistributedGradientTape
        "DistributedOptimizer", "", "", compression or hvd.Compression.none, sparse_as_dense,
        op, 1.0, None, process_set)
    base = type(optimizer)

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars)
        if scalecom:  # (before any gradient is reduced)
            try:
                compression.check_variables(variables)
            except ValueError as error:
                raise ValueError(
                    f"DistributedOptimizer: the variables to apply gradients to are not ScaleCom's ({error}); "
                    f"ScaleCom matches gradients to its variables by position. Were layers frozen or "
                    f"unfrozen since it was built? Build a ScaleCom for model.trainable_variables and "
                    f"compile with a new DistributedOptimizer") from None
            _check_every_gradient(grads, variables)
        reduced = reduce(list(grads), None, False)
        self._hvd_reduced = True  # (while tracing: apply() below is reached from here only)
        try:
            return base.apply_gradients(self, zip(reduced, variables))
        finally:
            self._hvd_reduced = False

    def apply(self, grads, trainable_variables=None):
        if not getattr(self, "_hvd_reduced", False):
            raise RuntimeError(
                "DistributedOptimizer.apply() was called without Horovod's reduction: each rank would "
                "train alone. A custom Model.train_step must call optimizer.apply_gradients(zip(grads, "
                "variables)), not apply(); for the LossScaleOptimizer a mixed_float16 policy puts around "
                "it in compile(), put one inside instead: DistributedOptimizer(keras.optimizers."
                "LossScaleOptimizer(optimizer), compression)")
        return base.apply(self, grads, trainable_variables)

    cls = type(base.__name__, (base,), {"apply_gradients": apply_gradients, "apply": apply,
                                        "_hvd_scalecom_reduces": True,
                                        "__doc__": f"{base.__name__} reducing through Horovod."})
    distributed = cls.from_config(optimizer.get_config())
    _copy_weight_decay_exclusions(optimizer, distributed)
    return distributed


def _copy_weight_decay_exclusions(source, target):
    """What ``exclude_from_weight_decay()`` set on ``source`` (and on its inner optimizer), which its
    config does not hold, onto ``target``."""
    for name in ("_exclude_from_weight_decay", "_exclude_from_weight_decay_pattern"):
        if hasattr(source, name):
            value = getattr(source, name)
            setattr(target, name, set(value) if isinstance(value, set) else value)
            target._exclude_from_weight_decay_cache = {}
    inner = getattr(source, "inner_optimizer", None)
    if inner is not None and getattr(target, "inner_optimizer", None) is not None:
        _copy_weight_decay_exclusions(inner, target.inner_optimizer)


class BroadcastInitialState(keras.callbacks.Callback):
    """Broadcasts the model's and its (built) optimizer's variables from ``root_rank`` when
    ``fit`` starts training, so that every rank starts alike."""

    def __init__(self, root_rank=0):
        super().__init__()
        self.root_rank = check_int(root_rank, "root_rank", 0)

    def on_train_begin(self, logs=None):
        variables = list(self.model.variables)
        if self.model.optimizer is not None and self.model.optimizer.built:
            variables += list(self.model.optimizer.variables)
        hvd.broadcast_variables(gradient_sources(variables), root_rank=self.root_rank)


def _check_reduction(scalecom, sparse_as_dense, op, process_set):
    """ValueError unless Horovod reduces as ``scalecom`` expects: every gradient dense (an
    ``IndexedSlices`` goes to Horovod's allgather, never through ``compress``, and the gradients after
    it would be matched to the wrong variables), with ScaleCom's op and over its process set."""
    if sparse_as_dense is not True:
        raise ValueError("ScaleCom needs sparse_as_dense=True: a sparse gradient (an embedding's) would "
                         "bypass it, and the gradients after it would be matched to the wrong variables")
    if op != scalecom.op:
        raise ValueError(f"op {op!r} differs from ScaleCom's op {scalecom.op!r}: give ScaleCom the op the "
                         f"gradients are reduced with (its warm-up steps reduce with it)")
    if _set_id(process_set) != _set_id(scalecom._process_set):
        raise ValueError("process_set differs from ScaleCom's process_set: its indices would go to other "
                         "ranks than the values")


def _check_every_gradient(grads, variables):
    """ValueError naming the variables whose gradient is ``None`` (a layer the loss does not use), raised
    before anything is reduced: Horovod passes a ``None`` gradient by, past ScaleCom's ``compress``, and
    ScaleCom matches gradients to its variables by position, so the gradients after it would be compressed
    with other variables' residue memories (seen only at the next step where their shapes agree)."""
    missing = [f"#{i} {getattr(v, 'path', None) or v.name!r}" for i, (g, v) in enumerate(zip(grads, variables))
               if g is None]
    if missing:
        raise ValueError(
            f"ScaleCom needs a gradient for every variable it was built with, but {', '.join(missing)} "
            f"got none (a layer the loss does not use? set its trainable = False, then build ScaleCom, "
            f"and the step or DistributedOptimizer, for model.trainable_variables)")


def _refusing_none(reduce, variables):
    """``reduce`` (a ``DistributedGradientTape``'s reduction of the gradients of ``variables``, the
    Keras variables, named as Keras names them, of the tape's sources) after :func:`_check_every_gradient`."""
    def checked(grads, sources, use_generic_names=False):
        _check_every_gradient(grads, variables)
        return reduce(grads, sources, use_generic_names)
    return checked


def _check_no_accumulation(optimizer):
    """ValueError if ``optimizer`` (or a ``LossScaleOptimizer``'s inner one) accumulates gradients:
    ScaleCom would compress and exchange every micro-batch's gradient, its steps counting micro-batches."""
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        steps = getattr(candidate, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                f"optimizer has gradient_accumulation_steps={steps}, which ScaleCom does not support: "
                f"the gradients of every micro-batch would be compressed and exchanged (ScaleCom's step "
                f"counters, warm-up and leaders moving per micro-batch) and the optimizer would average "
                f"the reduced ones. Use an optimizer without gradient_accumulation_steps")


def _set_id(process_set):
    return getattr(process_set, "process_set_id", process_set)


def _check_compression(compression):
    if compression is not None and not (callable(getattr(compression, "compress", None))
                                        and callable(getattr(compression, "decompress", None))):
        raise TypeError(f"compression must be a ScaleCom, a Horovod compression (with compress and "
                        f"decompress) or None, got {compression!r}")


class LogStats(keras.callbacks.Callback):
    """Writes ``compression.stats()`` to TensorBoard (``log_stats``) after every ``every``-th batch
    of ``fit``, at the step ``model.optimizer.iterations`` (the steps applied so far)."""

    def __init__(self, compression, writer=None, every=1):
        super().__init__()
        if not callable(getattr(compression, "stats", None)):
            raise TypeError(f"compression must have a stats() method (ScaleCom), got "
                            f"{type(compression).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.compression, self.writer, self.every = compression, writer, every

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step % self.every == 0:
            from hvd_scalecom.tensorflow import log_stats
            log_stats(self.writer, self.compression, step)


def _mean_loss(loss_fn, y, prediction, sample_weight):
    """Keras ``Loss`` objects reduce themselves; loss functions return one value per sample."""
    if isinstance(loss_fn, keras.losses.Loss):
        return loss_fn(y, prediction, sample_weight=sample_weight)
    per_sample = loss_fn(y, prediction)
    if sample_weight is not None:
        per_sample = per_sample * tf.cast(sample_weight, per_sample.dtype)
    return tf.reduce_mean(per_sample)
