"""Which variable a gradient handed to the TensorFlow ScaleCom belongs to, and the checks that refuse a
step before anything changes.

Horovod's tape reduces the gradients in the order of the ``sources`` given to ``gradient()``.
ScaleCom assigns the n-th gradient compressed in one traced graph (one ``gradient()`` call) to the
n-th variable it was built with, restarting at the first variable in a new graph or after the last
one, and checks that the shape matches.
"""

import contextlib
import weakref

import tensorflow as tf

from hvd_scalecom.tensorflow.graph import graph_of
from hvd_scalecom.tensorflow.variables import variable_specs


class GradientMatching:
    """Gradient-to-variable matching of :class:`~hvd_scalecom.tensorflow.ScaleCom` (a base class of
    it): reads and moves ``_slots``, ``_cursor``, ``_cursor_graph``, ``_taking``, ``_stalled``,
    ``_in_flight``."""

    def _check_every_variable_stepped(self, graph):
        """At variable #0's gradient, before any counter of the step moves: InvalidArgumentError
        unless every other variable's counter is at least variable #0's, i.e. every variable took a
        gradient in every step before. One that never does means a gradient did not come through
        ``compress`` (Horovod sends a sparse ``IndexedSlices`` to its allgather, and ``None``
        nowhere): gradients are matched to variables by position, so those after it went to the
        wrong variables.

        Eagerly it raises at once. Traced, it returns variable #0's counter once checked, built in
        ``graph`` (the gradients' graph): Horovod compresses each gradient in a ``tf.cond`` branch
        of its own, and every variable's compress captures this tensor (a data input, which TF keeps
        when it inlines the branches), so a refused step changes no variable's state. ``None`` for a
        single variable."""
        if len(self._slots) == 1:
            return None
        with (graph.as_default() if graph is not None else contextlib.nullcontext()):
            first = self._slots[0].step.read_value()
            behind = tf.reduce_min(tf.stack([s.step.read_value() for s in self._slots[1:]]))
            check = tf.debugging.assert_greater_equal(
                behind, first, message=(
                    "ScaleCom: some variable took fewer gradients than variable #0, so a gradient did "
                    "not reach compress (a sparse IndexedSlices gradient: pass sparse_as_dense=True to "
                    "hvd.DistributedGradientTape; or a None gradient) and the gradients after it were "
                    "matched to the wrong variables"))
            if graph is None:
                return None
            with tf.control_dependencies([check]):
                return tf.identity(first)

    def _check_one_dtype_per_group(self, slot, grad_dtype):
        """ValueError when this tensor and one compressed before it, both waiting for the same op
        (Horovod's grouped allreduce: ``groups=``), would travel in different dtypes because of
        ``value_dtype``: compressed values in it, tensors below ``min_numel`` in their own."""
        wire = (self._value_dtype or grad_dtype) if slot.compressible else grad_dtype
        if self._in_flight:
            other, other_wire = self._in_flight[0]
            if other_wire != wire and other.grad_dtype == grad_dtype:
                self._in_flight.clear()
                value_dtype = self._value_dtype.name

                def how(s, dtype):
                    reason = (f"its values, value_dtype={value_dtype!r}" if s.compressible else
                              f"dense: {s.numel} entries, below min_numel={self.config.min_numel}")
                    return f"variable #{s.index} ({s.name!r}) travels as {dtype.name} ({reason})"

                raise ValueError(
                    f"ScaleCom: value_dtype={value_dtype!r} does not go with groups= (of hvd."
                    f"DistributedGradientTape or hvd.DistributedOptimizer): Horovod reduces a group in one "
                    f"op, whose tensors must share one dtype, but {how(other, other_wire)} and "
                    f"{how(slot, wire)}. Pass groups=None, value_dtype=None, or a min_numel that "
                    f"compresses every variable of a group.")
        self._in_flight.append((slot, wire))

    def _slot_of(self, tensor):
        """The variable whose gradient ``tensor`` is: the next one in the current traced graph."""
        graph = graph_of(tensor)
        previous = self._cursor_graph() if self._cursor_graph is not None else None
        if graph is not previous or self._cursor >= len(self._slots):
            self._cursor_graph = None if graph is None else weakref.ref(graph)
            self._cursor = 0
            self._in_flight.clear()
        if self._stalled is not None:
            raise RuntimeError(self._stalled)
        self._taking = self._cursor
        if isinstance(tensor, tf.IndexedSlices):
            raise TypeError("ScaleCom compresses dense gradients: pass sparse_as_dense=True to "
                            "hvd.DistributedGradientTape for embedding-like variables")
        slot = self._slots[self._cursor]
        if not tensor.dtype.is_floating:  # (before the cursor moves on)
            raise TypeError(f"ScaleCom compresses floating-point gradients; the gradient of "
                            f"{slot.name!r} is {tensor.dtype.name}")
        shape = tuple(tensor.shape) if tensor.shape.rank is not None else None
        if not tensor.shape.is_compatible_with(slot.shape):  # (e.g. a densified embedding gradient traced
            # by Horovod's own tf.function has shape (None, dim): compatible, made static in compress)
            raise ValueError(
                f"ScaleCom was built for {len(self._slots)} variables and matches gradients to them "
                f"by position: gradient #{self._cursor} of this gradient() call has shape {shape}, "
                f"but variable #{slot.index} ({slot.name!r}) has shape {slot.shape}. Take gradients "
                f"with respect to exactly the variables given to ScaleCom, in the same order, each "
                f"with a gradient (Keras 3: tape.gradient(loss, [v.value for v in "
                f"model.trainable_variables])). With groups= of hvd.DistributedGradientTape or "
                f"hvd.DistributedOptimizer given as lists of variables, Horovod reduces the gradients "
                f"group by group, then those of variables in no group: give groups as an int, or lists "
                f"that take ScaleCom's variables in their order.")
        self._cursor += 1
        return slot

    def _refused(self, graph, error):
        """After a gradient ``compress`` refused, the next one begins a step (variable #0). Traced,
        nothing of the refused step ran. Eagerly (``hvd.allreduce(g, compression=...)`` one gradient
        at a time) the variables before it were reduced already, their counters and memories moved:
        ScaleCom then refuses every step, saying so, until a state is restored."""
        refused = self._taking
        if graph is None and refused > 0 and self._stalled is None:
            self._stalled = (f"ScaleCom refused gradient #{refused} of an eager step after variables #0 to "
                             f"#{refused - 1} were reduced in it (their step counters and memories moved): restore "
                             f"a state saved before that step (load_state_dict() or a tf.train.Checkpoint) "
                             f"to go on. The refusal: {error}")
        self._cursor = 0
        self._in_flight.clear()

    def check_variables(self, variables):
        """Raise ``ValueError`` unless ``variables`` match, in count and shapes, those ScaleCom has."""
        specs = variable_specs(variables)
        if len(specs) != len(self._slots):
            raise ValueError(f"ScaleCom was built for {len(self._slots)} variables, got {len(specs)}")
        for slot, (name, shape, _) in zip(self._slots, specs):
            if shape != slot.shape:
                raise ValueError(f"variable #{slot.index} {name!r} has shape {shape}, ScaleCom was "
                                 f"built for {slot.name!r} of shape {slot.shape}")
