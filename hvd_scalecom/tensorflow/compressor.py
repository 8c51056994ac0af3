"""ScaleCom as a ``horovod.tensorflow`` compression for ``hvd.DistributedGradientTape`` (TF2).

Per variable and step (see :mod:`hvd_scalecom.tensorflow.clt_k` for the equations):

1. ``compress(g)`` reads the variable's step counter t, forms ``p = m + g`` on the leader
   (``t mod size``, or ``(t + variable index) mod size`` when staggered), selects its top-k indices
   and hands them to every rank; every rank returns ``p[I]`` (k values).
2. Horovod allreduces those k values with the tape's own op (``Average``), pre/postscale and process set.
3. ``decompress`` scatters the reduced values into zeros of the gradient's shape and updates the
   residue memory, unless a reduced value is not finite (the memory is then kept as it was).

Horovod calls ``compress`` inside a cached ``tf.function`` (or inside the user's), so Python here
runs at trace time only. Everything that changes per step is a ``tf.Variable`` created in the
constructor and updated by graph ops: the residue memory, the step counter, byte and time tallies.
Decisions that depend on the step are graph conditionals with static shapes on every branch:

* the leader: a runtime ``tf.cond`` computes the top-k on the leader (a placeholder elsewhere), then
  ``tf.switch_case`` picks one of ``size`` ``HorovodBroadcast`` ops, one per possible root
  (``root_rank`` is a static attribute; Horovod wants it as a global rank). With
  ``index_exchange="allreduce"`` the leader contributes its indices and the others zeros to an integer
  Sum-allreduce instead, with a count of leaders appended (same result; one op, twice the index
  bytes on the wire); with ``"allgather"`` the leader contributes its k indices and the others none
  to an allgather (same result; one op whatever the number of ranks, a broadcast's bytes, and
  Horovod fuses allgathers that are ready together, as it fuses allreduces, but never broadcasts).
  Ranks whose step counters differ (by other than a multiple of the number of ranks) disagree on the
  leader: the broadcasts' roots then differ (an error from Horovod), and the allreduce's count or the
  allgather's length shows other than one leader (the same error on every rank).
* the graph is the same on every rank, and ScaleCom's own collectives use ``ignore_name_scope``:
  Horovod keys collectives by node names, which carry counters of the functions TF inlines.
* pipelined (``pipelined=True``): the leader of step t + 1 selects its top-k from this step's
  ``p = m + g`` and shares them in this step; they wait in a variable for step t + 1. The values of
  step t depend only on indices already there, so the exchange for t + 1 overlaps the values'
  allreduce instead of preceding it. A step finds no indices waiting (the first compressed step, a
  state restored without them) and exchanges fresh ones instead.
* warm-up: the tensor Horovod reduces is always the k-sized value vector. During warm-up steps
  ScaleCom reduces the whole gradient itself (``hvd.allreduce`` with its ``op``, ``Average`` by
  default) and Horovod's allreduce carries k zeros; ``decompress`` returns the dense result.

Which variable a gradient belongs to: Horovod's tape reduces the gradients in the order of the
``sources`` given to ``gradient()``. ScaleCom assigns the n-th gradient compressed in one traced graph
(one ``gradient()`` call) to the n-th variable it was built with, restarting at the first variable in a
new graph or after the last one, and checks that the shape matches. So: take gradients with respect
to exactly the variables given to ScaleCom, in that order, each with a gradient (no ``None``, no
``register_local_source``, ``groups`` as an int or as lists that take the variables in that order,
since Horovod reduces group by group, and with ``value_dtype`` only where every variable of a group
is compressed; ``sparse_as_dense=True`` for embeddings). Gradients out of order are refused where
their shapes differ from their variables' (a ValueError naming ``groups``, before anything changes);
among variables of one shape the memories follow the positions.
"""

import contextlib
import itertools
import json
import math
import weakref

import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
from horovod.tensorflow.compression import Compressor
from tensorflow.python.ops import control_flow_util
from tensorflow.python.trackable.base import Trackable

from hvd_scalecom import agreement
from hvd_scalecom.config import (HOROVOD_VALUE_DTYPES, INDEX_DTYPES, ScaleComConfig, check_dtype_name,
                                 check_kept_step)
from hvd_scalecom.state import check_next_indices, check_saved_shape, check_size, checked_params
from hvd_scalecom.tensorflow import clt_k
from hvd_scalecom.traffic import StepTraffic

INDEX_EXCHANGES = ("broadcast", "allreduce", "allgather")
TIMING_STEPS = 8  # steps whose compute and wait times stats() can report per step
_instances = itertools.count()


class _Slot:
    """What ScaleCom keeps for one variable: static facts plus its (untracked) tally variables."""

    def __init__(self, index, name, shape, dtype, config):
        self.index = index
        self.name = name
        self.shape = shape
        self.dtype = dtype  # the variable's dtype; gradients are expected in it
        self.grad_dtype = dtype  # the gradient's dtype, as last traced
        self.numel = math.prod(shape)
        self.k = config.num_selected(self.numel)
        self.compressible = config.compresses(self.numel)
        self.memory = None  # residue memory m_i (flat), for compressible variables only
        self.step = None  # steps this variable has been reduced in (t), int64
        self.tally = None  # [dense steps, compressed steps] reduced by this process, int64
        self.nonfinite = None  # compressed steps whose memory update a non-finite reduction skipped
        self.timing = None  # [TIMING_STEPS + 1, 2] seconds (compute, index wait); last row: totals
        self.next_indices = None  # pipelined: the indices selected for step ahead_step
        self.ahead_step = None  # pipelined: the step next_indices are for (-1: none), int64
        self.fresh = None  # pipelined: [fresh index exchanges, the step of the last one (-1: none)]


class ScaleCom(tf.Module, Compressor):
    """CLT-k with a low-pass-filtered residue memory (Chen et al., NeurIPS 2020, Algorithm 1).

    Args:
        variables: the variables gradients are taken for, in the order given to ``gradient()``
            (``model.trainable_variables``; Keras 3 variables or ``tf.Variable``).
        ratio: fraction of entries sent per tensor, ``k = max(1, ceil(ratio * numel))``.
        beta: low-pass filter of the residue memory, in (0, 1]; 1 is classic error feedback.
        warmup_steps: steps (counted from 0) reduced densely first.
        min_numel: variables with fewer entries are always reduced densely.
        leader: ``"cyclic"`` (``t mod size``) or ``"staggered"`` (``(t + variable index) mod size``).
        selection: ``"threshold"`` (default) or ``"exact"`` top-k: the same indices (see
            ``clt_k.select_top_k``), "threshold" found faster on large tensors.
        value_dtype: dtype the selected values travel in, ``tf.float16`` or ``tf.float32`` (default:
            the gradient's dtype; not bfloat16, for which Horovod's TensorFlow allreduce has no kernel).
            With the tape's ``groups=``, Horovod reduces a group in one op of one dtype, so a group
            may not mix compressed variables with ones below ``min_numel`` (a ValueError at the first
            step).
        index_dtype: ``tf.int32`` (default; int64 for tensors of 2**31 entries or more) or ``tf.int64``.
        process_set: the Horovod process set the tape reduces over (default: all ranks). On ranks
            outside it, Horovod's tape returns their own gradients and ScaleCom's state stays as it was.
        index_exchange: ``"broadcast"`` (default), ``"allreduce"`` or ``"allgather"``: how the
            leader's indices travel (see the module's doc).
        pipelined: use indices the leader selected one step earlier, so that their exchange overlaps
            the values' allreduce (see ``ScaleComConfig``); off by default: exact ScaleCom.
        op: the op the tape or optimizer reduces with, ``hvd.Average`` (default) or ``hvd.Sum``:
            ScaleCom reduces warm-up steps densely itself, with this op.

    Create it eagerly (outside ``tf.function``), before the first step. ``tf.train.Checkpoint``
    tracks the residue memories and step counters (``compression=scalecom``), and the configuration,
    which a restore checks first.

    At its first ``compress`` (the first step, traced or eager) every rank compares its arguments
    and the number, order, shapes and dtypes of its variables with every other rank's, and all
    raise the same ValueError if they differ (names are not compared: Keras may number layers
    differently on different ranks, and gradients are matched to variables by position).
    """

    def __init__(self, variables, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024, *,
                 leader="cyclic", selection="threshold", value_dtype=None, index_dtype=tf.int32,
                 process_set=None, index_exchange="broadcast", pipelined=False, op=hvd.Average):
        config = ScaleComConfig(
            ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=min_numel, leader=leader,
            selection=selection,
            value_dtype=check_dtype_name(_dtype_text(value_dtype), "value_dtype", HOROVOD_VALUE_DTYPES),
            index_dtype=check_dtype_name(_dtype_text(index_dtype), "index_dtype", INDEX_DTYPES),
            pipelined=pipelined)
        if process_set is None:
            process_set = hvd.global_process_set
        elif not isinstance(process_set, hvd.ProcessSet):
            raise TypeError(f"process_set must be a horovod.tensorflow.ProcessSet or None, "
                            f"got {type(process_set).__name__}")
        if index_exchange not in INDEX_EXCHANGES:
            raise ValueError(f"index_exchange must be one of {INDEX_EXCHANGES}, got {index_exchange!r}")
        if isinstance(op, bool) or op not in (hvd.Average, hvd.Sum):
            raise ValueError(f"op must be hvd.Average or hvd.Sum (the op the tape or optimizer reduces "
                             f"with), got {op!r}")
        specs = _variable_specs(variables)
        if not tf.executing_eagerly():
            raise RuntimeError("create ScaleCom eagerly, outside tf.function: its state lives in "
                               "tf.Variables that must exist before the first traced step")
        super().__init__(name="scalecom")
        self.config = config
        self.index_exchange = index_exchange
        self.op = op
        self._process_set = process_set
        self._value_dtype = None if config.value_dtype is None else tf.as_dtype(config.value_dtype)
        self._prefix = f"scalecom{next(_instances)}"  # Horovod op names, the same on every rank
        slots = []
        for index, (name, shape, dtype) in enumerate(specs):
            slot = _Slot(index, name, shape, dtype, config)
            if slot.compressible:
                slot.memory = tf.Variable(tf.zeros([slot.numel], clt_k.memory_dtype(dtype)),
                                          trainable=False, name=f"memory_{index}")
                if config.pipelined:
                    slot.next_indices = tf.Variable(
                        tf.zeros([slot.k], config.index_dtype_for(slot.numel)), trainable=False,
                        name=f"next_indices_{index}")
                    slot.ahead_step = tf.Variable(-1, dtype=tf.int64, trainable=False,
                                                  name=f"ahead_step_{index}")
                    # fresh exchanges (first compressed step, or none waiting): count, and the last one
                    slot.fresh = tf.Variable([0, -1], dtype=tf.int64, trainable=False, name=f"fresh_{index}")
            slot.step = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"step_{index}")
            slot.tally = tf.Variable([0, 0], dtype=tf.int64, trainable=False, name=f"tally_{index}")
            slot.nonfinite = tf.Variable(0, dtype=tf.int64, trainable=False, name=f"nonfinite_{index}")
            slot.timing = tf.Variable(tf.zeros([TIMING_STEPS + 1, 2], tf.float64), trainable=False,
                                      name=f"timing_{index}")
            slots.append(slot)
        self._slots = tuple(slots)
        self._by_name = {s.name: s for s in slots}
        # What tf.train.Checkpoint saves: the configuration, checked first at a restore (its name sorts
        # before the variables', which a restore into another configuration then leaves unchanged),
        # memories of compressible variables, every step counter, the statistics' tallies (a restore
        # then rolls them back with the steps).
        self.configuration = _SavedConfiguration(
            {**config.as_dict(), "variables": [[s.dtype.name, list(s.shape)] for s in slots]}, self._forget_step)
        self.memories = [s.memory for s in slots if s.compressible]
        self.steps = [s.step for s in slots]
        self.statistics = [v for s in slots for v in (s.tally, s.nonfinite, s.timing)]
        if config.pipelined:  # and the indices already chosen for the next step
            self.pipeline = [v for s in slots if s.compressible for v in (s.next_indices, s.ahead_step)]
            self.statistics += [s.fresh for s in slots if s.compressible]
        self._cursor_graph = None  # (weak reference to) the graph the last gradient was traced in
        self._cursor = 0
        self._taking = 0  # the variable whose gradient compress takes (or took last)
        self._stalled = None  # why eager steps are refused (one was refused part-way), or None
        self._step_checked = None  # variable #0's step counter, once every variable was found stepped
        self._in_flight = []  # (slot, wire dtype) compressed since the last decompress: one group's
        self._agreed = False  # configurations compared across ranks (at the first compress)

    def __repr__(self):
        return (f"ScaleCom({len(self._slots)} variables, {self.config}, "
                f"index_exchange={self.index_exchange!r}, op={'Sum' if self.op == hvd.Sum else 'Average'})")

    # -- Horovod's compression interface ----------------------------------------------------------

    def compress(self, tensor):
        if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
            # (before anything moves: XLA would refuse the step only when compiling it, naming one of
            # ScaleCom's ops it has no kernel for, as it would Horovod's)
            raise ValueError(
                "ScaleCom cannot run under XLA: the step is compiled with jit_compile=True "
                "(tf.function(jit_compile=True), or Keras compile(), whose jit_compile='auto' means True "
                "on a GPU), and neither Horovod's collectives nor ScaleCom's ops have XLA kernels. "
                "Use jit_compile=False.")
        try:
            return self._compress_next(tensor)
        except Exception as error:
            self._refused(_graph_of(tensor), error)
            raise

    def _compress_next(self, tensor):
        graph = _graph_of(tensor)  # (the gradients' graph; ensure_shape's would be Horovod's cond branch)
        try:
            slot = self._slot_of(tensor)
            if not tensor.shape.is_fully_defined():
                tensor = tf.ensure_shape(tensor, slot.shape)
        finally:  # a rank whose variables differ learns it with all the others, not alone
            if not self._agreed:
                self._check_agreement()
        slot.grad_dtype = tensor.dtype
        self._check_one_dtype_per_group(slot, tensor.dtype)
        if slot.index == 0:
            self._step_checked = self._check_every_variable_stepped(graph)
        checked = [] if self._step_checked is None else [tf.identity(self._step_checked)]  # (a capture)
        with tf.name_scope(f"{self._prefix}_{slot.index}"), tf.control_dependencies(checked):
            if not slot.compressible:
                slot.step.assign_add(1)
                slot.tally.assign_add([1, 0])
                return tensor, None
            return self._compress(slot, tensor)

    def decompress(self, tensor, ctx):
        self._in_flight.clear()
        if ctx is None:
            return tensor
        slot, t, indices, dense, in_warmup, grad, memory_at_indices, exact = ctx
        with tf.name_scope(f"{self._prefix}_{slot.index}_decompress"):
            start, tensor = _stamp(tensor)
            self._update_memory(slot, tensor, in_warmup, grad, indices, memory_at_indices, exact)

            def sparse():
                return clt_k.scatter_dense(tensor, indices, slot.shape, slot.grad_dtype)

            if in_warmup is None:
                out = sparse()
            else:
                out = tf.cond(in_warmup, lambda: self._checked_dense(tensor, dense, slot), sparse)
            row = tf.cast(t % TIMING_STEPS, tf.int32)
            end, out = _stamp(out, start)
            seconds = end - start
            slot.timing.scatter_nd_add([[row, 0], [TIMING_STEPS, 0]], tf.stack([seconds, seconds]))
            return out

    def _update_memory(self, slot, reduced, in_warmup, grad, indices, memory_at_indices, exact):
        """The low-pass memory update of a compressed step, skipped (and counted) when the reduced
        values are not finite: then some rank's gradient was, and every rank sees it alike."""
        finite = tf.reduce_all(tf.math.is_finite(reduced))
        compressed = tf.constant(True) if in_warmup is None else tf.logical_not(in_warmup)
        sent_dtype = self._value_dtype or grad.dtype

        def update():
            with tf.control_dependencies([clt_k.filter_memory(
                    slot.memory, grad, indices, memory_at_indices, exact, self.config.beta,
                    sent_dtype)]):
                return tf.constant(0, tf.int64)

        def skip():
            return tf.cast(compressed, tf.int64)  # warm-up steps update nothing and count nothing

        skipped = tf.cond(tf.logical_and(compressed, finite), update, skip)
        slot.nonfinite.assign_add(skipped)

    # -- the graph of one compressed step ---------------------------------------------------------

    def _compress(self, slot, tensor):
        # (on a rank outside the process set Horovod traces this in a tf.cond branch that never runs)
        size = self._process_set.size()
        rank = self._process_set.rank() if self._process_set.included() else -1
        start, tensor = _stamp(tensor)
        t = slot.step.read_value()
        slot.step.assign_add(1)
        offset = slot.index if self.config.leader == "staggered" else 0
        leader = tf.cast((t + offset) % size, tf.int32)
        sent_dtype = self._value_dtype or tensor.dtype
        index_dtype = tf.as_dtype(self.config.index_dtype_for(slot.numel))
        row = tf.cast(t % TIMING_STEPS, tf.int32)

        def compressed():
            # A non-finite gradient anywhere on this rank makes every value it sends NaN, so that all
            # ranks see a non-finite reduction and skip the memory update (in decompress); a leader
            # then selects from its memory (clt_k.selection_source). Read once for both.
            finite = tf.reduce_all(tf.math.is_finite(tensor))  # (a sum could overflow: entry by entry)
            indices, wait_from = self._indices_for_step(slot, tensor, finite, t, leader, rank, size,
                                                        index_dtype, start)
            received, indices = _stamp(indices)
            selected = []
            if self.config.pipelined:
                selected = [self._select_ahead(slot, tensor, finite, t, rank, size, index_dtype)]
            memory_at_indices, exact = clt_k.take(slot.memory, tensor, indices)  # m_i[I], p_i[I]
            values = tf.where(finite, tf.cast(exact, sent_dtype), tf.constant(float("nan"), sent_dtype))
            # The memory is updated once the leader has read p for its selection ahead.
            with tf.control_dependencies(selected):
                memory_at_indices = tf.identity(memory_at_indices)
            end, values = _stamp(values, received)
            self._record(slot, row, (wait_from - start) + (end - received), received - wait_from,
                         compressed=True)
            return values, tf.zeros([0], tensor.dtype), indices, memory_at_indices, exact

        if self.config.warmup_steps == 0:
            values, _, indices, memory_at_indices, exact = compressed()
            return values, (slot, t, indices, None, None, tensor, memory_at_indices, exact)

        def warmup():
            """Dense reduction (``op``) by ScaleCom itself; Horovod's allreduce carries k ones, which
            tell ``decompress`` which op Horovod reduced with (1 averaged, the ranks' count summed)."""
            dense = hvd.allreduce(tensor, op=self.op, name=f"{self._prefix}_dense_{slot.index}",
                                  ignore_name_scope=True, process_set=self._process_set)
            end, dense = _stamp(dense, start)
            self._record(slot, row, end - start, tf.constant(0.0, tf.float64), compressed=False)
            unused = tf.zeros([slot.k], slot.memory.dtype)
            return (tf.ones([slot.k], sent_dtype), tf.reshape(dense, [-1]),
                    tf.zeros([slot.k], index_dtype), unused, unused)

        in_warmup = t < self.config.warmup_steps
        values, dense, indices, memory_at_indices, exact = tf.cond(in_warmup, warmup, compressed)
        values = tf.ensure_shape(values, [slot.k])
        return values, (slot, t, indices, dense, in_warmup, tensor, memory_at_indices, exact)

    def _checked_dense(self, reduced_ones, dense, slot):
        """A warm-up step's gradient, ``dense`` (reduced by ScaleCom with ``op``), once the k ones that
        Horovod reduced show that the tape reduces with the same op: a tape summing while ScaleCom
        averages (or the reverse) would apply warm-up steps ``size`` times off."""
        size = self._process_set.size()
        averaged = self.op != hvd.Sum
        reduced = tf.cast(reduced_ones[0], tf.float32)
        check = tf.debugging.Assert(
            tf.less(tf.abs(reduced - (1.0 if averaged else float(size))), 0.5),
            [f"ScaleCom was built with op={'Average' if averaged else 'Sum'} but Horovod reduced its "
             f"tensors with the other op: give ScaleCom the op of hvd.DistributedGradientTape "
             f"(op=hvd.Sum to both, or neither). Horovod's reduction of ones:", reduced])
        with tf.control_dependencies([check]):
            return tf.reshape(dense, slot.shape)

    def _indices_for_step(self, slot, tensor, finite, t, leader, rank, size, index_dtype, start):
        """The indices of step ``t`` on every rank, and when this rank started waiting for them:
        those selected a step ago when pipelined and there, else the leader's fresh top-k."""

        def exchange():
            return self._exchange_indices(slot, tensor, finite, leader, rank, size, index_dtype, start,
                                          f"{self._prefix}_indices_{slot.index}")

        if not self.config.pipelined:
            return exchange()

        def fresh():  # counted: this step also shares the next one's indices (two exchanges)
            with tf.control_dependencies([slot.fresh.assign(tf.stack([slot.fresh[0] + 1, t]))]):
                return exchange()

        def waiting():
            indices = slot.next_indices.read_value()
            wait_from, indices = _stamp(indices, start)
            return indices, wait_from

        indices, wait_from = tf.cond(tf.equal(slot.ahead_step, t), waiting, fresh)
        return tf.ensure_shape(indices, [slot.k]), wait_from

    def _select_ahead(self, slot, tensor, finite, t, rank, size, index_dtype):
        """Pipelined: the leader of step ``t + 1`` selects from this step's ``p`` and shares its
        indices now; every rank keeps them for step ``t + 1``. Returns this rank's selection (the
        exchange and the store run as side effects of the step)."""
        offset = slot.index if self.config.leader == "staggered" else 0
        leader = tf.cast((t + 1 + offset) % size, tf.int32)
        mine = self._leader_choice(slot, tensor, finite, leader, rank, index_dtype)
        indices = self._share(slot, mine, leader, rank, size, index_dtype,
                              f"{self._prefix}_ahead_{slot.index}")
        with tf.control_dependencies([slot.next_indices.assign(indices)]):
            slot.ahead_step.assign(t + 1)
        return mine

    def _exchange_indices(self, slot, tensor, finite, leader, rank, size, index_dtype, start, name):
        """The leader's top-k indices of ``p = m + g`` on every rank, and when this rank started
        waiting for them (no earlier than ``start``).

        The graph is the same on every rank (the leader test is a runtime ``tf.cond``): Horovod keys
        collectives by node names, which carry counters of the functions TF inlines before them.
        """
        mine = self._leader_choice(slot, tensor, finite, leader, rank, index_dtype)
        wait_from, mine = _stamp(mine, start)
        return self._share(slot, mine, leader, rank, size, index_dtype, name), wait_from

    def _leader_choice(self, slot, tensor, finite, leader, rank, index_dtype):
        """The top-k indices of ``p = m + g`` on the leader (of ``m`` where ``g`` is not finite:
        ``finite``, the test of ``g``: :func:`clt_k.selection_source`); a placeholder elsewhere."""

        def leader_top_k():
            p = clt_k.selection_source(slot.memory, tensor, finite)
            return clt_k.select_top_k(p, slot.k, self.config.selection, index_dtype)

        def not_leader():
            # Ignored by the collective, but must not be a constant: Grappler would fold a
            # (stateless) Horovod op with constant input at optimisation time, and block there.
            return tf.fill([slot.k], tf.cast(leader, index_dtype))

        return tf.cond(tf.equal(leader, rank), leader_top_k, not_leader)

    def _share(self, slot, mine, leader, rank, size, index_dtype, name):
        """``mine`` of the ``leader`` on every rank (a broadcast, a Sum-allreduce or an allgather)."""
        leading = tf.cast(tf.equal(leader, rank), index_dtype)
        if self.index_exchange == "allgather":  # the leader's k, nothing from the others
            indices = hvd.allgather(mine[:leading * slot.k], name=name, ignore_name_scope=True,
                                    process_set=self._process_set)
            leaders = tf.shape(indices, out_type=tf.int64)[0] // slot.k
            return self._one_leader(slot, leaders, tf.concat([indices, tf.zeros([slot.k], index_dtype)], 0)[:slot.k])
        if self.index_exchange == "allreduce":  # the leader's indices and a 1, zeros from the others
            summed = hvd.allreduce(tf.concat([mine * leading, [leading]], 0), op=hvd.Sum,
                                   name=name, ignore_name_scope=True, process_set=self._process_set)
            return self._one_leader(slot, tf.cast(summed[slot.k], tf.int64), summed[:slot.k])

        global_ranks = self._process_set.ranks  # Horovod takes the root as a global rank

        def from_root(root):
            def branch():
                return hvd.broadcast(mine, root_rank=global_ranks[root] if global_ranks else root,
                                     name=name, ignore_name_scope=True, process_set=self._process_set)
            return branch

        return tf.ensure_shape(tf.switch_case(leader, [from_root(r) for r in range(size)]), [slot.k])

    @staticmethod
    def _one_leader(slot, leaders, indices):
        """``indices`` once the exchange shows that one rank led (``leaders``, counted by the exchange,
        is the same on every rank, so every rank fails alike): ranks whose step counters differ
        disagree on the leader, and their indices would be summed or missing."""
        check = tf.debugging.Assert(tf.equal(leaders, 1), [
            f"ScaleCom: the index exchange of {slot.name} found this many leaders of the step, not one:",
            leaders, "the step counters of the ranks differ (restore every rank from a state of the same step)"])
        with tf.control_dependencies([check]):  # (an allgather's are padded to at least k)
            return tf.ensure_shape(indices, [slot.k])

    def _record(self, slot, row, compute_seconds, wait_seconds, compressed):
        seconds = tf.stack([compute_seconds, wait_seconds])
        slot.timing.scatter_nd_update([[row]], [seconds])
        slot.timing.scatter_nd_add([[TIMING_STEPS]], [seconds])
        slot.tally.assign_add([0, 1] if compressed else [1, 0])

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
        graph = _graph_of(tensor)
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

    def _check_agreement(self):
        """Compare this rank's configuration and variables with every other rank's, once.

        Runs at the first ``compress`` (the first step), eagerly even while Horovod's reduction is
        being traced: ``tf.init_scope`` lifts the two allgathers (summary sizes, then summaries) out
        of the graph, so they run once, before any collective of the step, and never become part
        of the traced step. Every rank traces its first step alike, so every rank gets there.
        """
        if not hvd.is_initialized():
            return  # compress() called outside a Horovod job (nothing to agree with)
        if not self._process_set.included():
            return  # (a rank outside the process set: Horovod's tape returns its own gradients there)
        self._agreed = True
        summary = {**self.config.as_dict(), "index_exchange": self.index_exchange, "op": int(self.op),
                   "variables": len(self._slots), "collective_prefix": self._prefix,
                   "variable_digest": agreement.digest([[s.dtype.name, list(s.shape)]
                                                        for s in self._slots])}
        with tf.init_scope():
            summary["steps"] = sorted({int(s.step.numpy()) for s in self._slots})  # (eager here: as restored)
            local = tf.constant(np.frombuffer(agreement.encode(summary), np.uint8))
            sizes = hvd.allgather(tf.constant([int(local.shape[0])], tf.int32),
                                  name="scalecom_agreement_sizes", ignore_name_scope=True,
                                  process_set=self._process_set)
            gathered = hvd.allgather(local, name="scalecom_agreement", ignore_name_scope=True,
                                     process_set=self._process_set)
            chunks = np.split(gathered.numpy(), np.cumsum(sizes.numpy())[:-1])
        agreement.check_gathered("ScaleCom", [c.tobytes() for c in chunks], {
            "collective_prefix": "(the n-th ScaleCom a process builds names its collectives scalecom<n>: "
                                 "build the same ScaleCom objects, in the same order, on every rank.)",
            "variable_digest": "(variable_digest covers the number, order, shapes and dtypes of the "
                               "variables ScaleCom was built with.)",
            "steps": agreement.STEPS_HINT})

    # -- checks for helpers -----------------------------------------------------------------------

    def check_variables(self, variables):
        """Raise ``ValueError`` unless ``variables`` match, in count and shapes, those ScaleCom has."""
        specs = _variable_specs(variables)
        if len(specs) != len(self._slots):
            raise ValueError(f"ScaleCom was built for {len(self._slots)} variables, got {len(specs)}")
        for slot, (name, shape, _) in zip(self._slots, specs):
            if shape != slot.shape:
                raise ValueError(f"variable #{slot.index} {name!r} has shape {shape}, ScaleCom was "
                                 f"built for {slot.name!r} of shape {slot.shape}")

    # -- state and statistics ---------------------------------------------------------------------

    def stats(self, step=None):
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step).
        The last ``TIMING_STEPS`` (8) steps are kept; an earlier one asked for is a ValueError
        (``total`` counts every step; the default step never is one).

        Returns a dict with ``step``, ``index_bytes``, ``value_bytes``, ``dense_bytes``, ``sent_bytes``,
        ``uncompressed_bytes``, ``ratio`` (uncompressed / sent), ``compress_seconds``,
        ``index_wait_seconds``, ``tensors`` and ``nonfinite_skips`` (tensor-steps whose memory update
        a non-finite reduction skipped, since this object was built), and ``total``: the same since this object was built
        (or last loaded by ``load_state_dict``; a ``tf.train.Checkpoint`` restore brings back the saved
        run's tallies with its steps). Bytes follow from the configuration and the step counters; during warm-up
        ``dense_bytes`` also counts the k zero values Horovod's allreduce carries.
        """
        done = [int(s.step.numpy()) for s in self._slots]
        tallies = [s.tally.numpy() for s in self._slots]  # (dense, compressed) steps counted
        if step is None:
            reduced = [d for d in done if d > 0]
            step = min(reduced) - 1 if reduced else 0
        else:  # the newest step this object counted (since built or loaded), as PyTorch's TrafficMeter
            counted = [d - 1 for tally, d in zip(tallies, done) if tally.any()]
            step = check_kept_step(step, max(counted, default=None), TIMING_STEPS)
        this_step, total = StepTraffic(), StepTraffic()
        for slot, reduced_through, tally in zip(self._slots, done, tallies):
            dense_steps, compressed_steps = (int(x) for x in tally)
            timing = slot.timing.numpy()
            first = reduced_through - dense_steps - compressed_steps
            fresh_count, last_fresh = (int(x) for x in slot.fresh.numpy()) if slot.fresh is not None else (0, -1)
            if first <= step < reduced_through:
                this_step.add(self._step_traffic(slot, step))
                if step == last_fresh:  # pipelined: its own indices and the next step's
                    this_step.index_bytes += self._index_bytes(slot)
                if step >= reduced_through - TIMING_STEPS:
                    compute, wait = timing[step % TIMING_STEPS]
                    this_step.compress_seconds += float(compute)
                    this_step.index_wait_seconds += float(wait)
            if dense_steps:
                total.add(_scaled(self._step_traffic(slot, None, dense=True), dense_steps))
            if compressed_steps:
                total.add(_scaled(self._step_traffic(slot, None, dense=False), compressed_steps))
                total.index_bytes += fresh_count * self._index_bytes(slot)
            total.compress_seconds += float(timing[TIMING_STEPS, 0])
            total.index_wait_seconds += float(timing[TIMING_STEPS, 1])
        out = this_step.as_dict()
        out["step"] = step
        out["nonfinite_skips"] = sum(int(s.nonfinite.numpy()) for s in self._slots)
        out["total"] = total.as_dict()
        return out

    def _index_bytes(self, slot):
        """One exchange's index payload: k indices (the allreduce's also its count of leaders)."""
        return (slot.k + (self.index_exchange == "allreduce")) * self.config.index_itemsize(slot.numel)

    def _step_traffic(self, slot, step, dense=None):
        itemsize = slot.grad_dtype.size
        full = slot.numel * itemsize
        if dense is None:
            dense = not self.config.is_compressed(slot.numel, step)
        if not slot.compressible:
            return StepTraffic(dense_bytes=full, uncompressed_bytes=full, tensors=1)
        value_bytes = slot.k * (self._value_dtype or slot.grad_dtype).size
        if dense:  # warm-up: ScaleCom's dense average plus Horovod's k placeholder values
            return StepTraffic(dense_bytes=full + value_bytes, uncompressed_bytes=full, tensors=1)
        return StepTraffic(index_bytes=self._index_bytes(slot),
                           value_bytes=value_bytes, uncompressed_bytes=full, tensors=1)

    def state_dict(self):
        """Residue memories (NumPy), step counters and (pipelined) the indices already chosen for
        the next step, as ``next_indices: (step, indices)``, by variable name, and the configuration."""
        params = {}
        for s in self._slots:
            step = int(s.step.numpy())
            entry = {"step": step, "shape": list(s.shape),
                     "memory": None if s.memory is None else s.memory.numpy().copy()}
            if s.ahead_step is not None and int(s.ahead_step.numpy()) == step:
                entry["next_indices"] = (step, s.next_indices.numpy().copy())
            params[s.name] = entry
        return {"config": self.config.as_dict(), "params": params}

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned; checks everything before changing anything.

        A memory of ``None`` for a compressible variable (a state saved before its first compressed
        step by the PyTorch frontend) restores zeros.
        """
        params = checked_params(state, "ScaleCom", self.config.as_dict(), self._by_name, "variables")
        steps = {name: int(entry["step"]) for name, entry in params.items()}
        if len(set(steps.values())) > 1:  # (every step here reduces every variable)
            raise ValueError(f"state steps differ between variables, {steps}: this ScaleCom steps every "
                             f"variable together")
        memories, ahead = {}, {}
        for name, entry in params.items():
            slot = self._by_name[name]
            check_saved_shape(name, entry, slot.shape, "variable")
            memory = entry.get("memory")
            if memory is not None:
                memory = np.asarray(memory)
                if not slot.compressible:
                    raise ValueError(f"state has a memory for {name!r}, which has {slot.numel} "
                                     f"entries (< min_numel) and is never compressed")
                if memory.dtype.kind != "f":
                    raise TypeError(f"state memory of {name!r} must hold floating-point numbers, "
                                    f"got dtype {memory.dtype}")
                check_size(name, "memory", memory, slot.numel, "variable")
                with np.errstate(over="ignore"):  # (a value beyond the dtype's range is refused next)
                    memory = memory.reshape(-1).astype(slot.memory.dtype.as_numpy_dtype)
                if not np.isfinite(memory).all():  # (a memory never absorbs one: none could heal)
                    raise ValueError(f"state memory of {name!r} holds non-finite entries")
            memories[name] = memory
            if "next_indices" in entry:
                ahead[name] = check_next_indices(name, entry["next_indices"], slot.k, slot.numel,
                                                 self.config.pipelined and slot.compressible, steps[name])
        for name, entry in params.items():
            slot = self._by_name[name]
            slot.step.assign(steps[name])
            slot.tally.assign([0, 0])
            slot.timing.assign(tf.zeros_like(slot.timing))
            if slot.fresh is not None:
                slot.fresh.assign([0, -1])
            if slot.memory is not None:
                memory = memories[name]
                slot.memory.assign(np.zeros(slot.numel, slot.memory.dtype.as_numpy_dtype) if memory is None
                                   else memory)
            if slot.ahead_step is not None:
                step, indices = ahead.get(name, (-1, None))
                if indices is not None:
                    slot.next_indices.assign(indices.astype(slot.next_indices.dtype.as_numpy_dtype))
                slot.ahead_step.assign(step)
        self._forget_step()

    def _forget_step(self):
        """After a restore: the next gradient begins a step, and eager steps are taken again."""
        self._cursor_graph = None
        self._cursor = 0
        self._stalled = None
        self._in_flight.clear()


class _SavedConfiguration(Trackable):
    """ScaleCom's configuration and variables' dtypes and shapes in a ``tf.train.Checkpoint``: a
    restore into a ScaleCom built otherwise raises ValueError (as ``load_state_dict`` does), where
    memories would otherwise go, matched by position, to other variables or into other equations."""

    def __init__(self, summary, on_restore):
        self.summary = summary
        self._on_restore = weakref.WeakMethod(on_restore)  # (not a reference cycle through ScaleCom)

    def _serialize_to_tensors(self):
        return {"json": tf.constant(json.dumps(self.summary, sort_keys=True))}

    def _restore_from_tensors(self, restored_tensors):
        saved = json.loads(restored_tensors["json"].numpy().decode())
        if saved != self.summary:
            differ = {key: (saved.get(key), self.summary.get(key))
                      for key in sorted(set(saved) | set(self.summary)) if saved.get(key) != self.summary.get(key)}
            raise ValueError("ScaleCom: the checkpoint was saved by a ScaleCom built otherwise; restore it "
                             "into one built alike (saved, this one): " +
                             ", ".join(f"{key} {was!r}, {now!r}" for key, (was, now) in differ.items()))
        on_restore = self._on_restore()
        if on_restore is not None:
            on_restore()
        return tf.no_op()


def _graph_of(tensor):
    """The graph ``tensor`` was traced in; ``None`` eagerly."""
    return None if tf.executing_eagerly() else tensor.graph


def _scaled(traffic, times):
    traffic.index_bytes *= times
    traffic.value_bytes *= times
    traffic.dense_bytes *= times
    traffic.uncompressed_bytes *= times
    traffic.tensors *= times
    return traffic


def _stamp(tensor, *after):
    """``(time, tensor)``: the wall time (float64 seconds) once ``tensor`` (and ``after``) exist, and
    ``tensor`` again, gated on that time so that whatever uses it starts later.

    ``after`` goes through ``tf.identity``: inside a cond branch a control dependency on a tensor of
    the enclosing graph is dropped when TF inlines the branch, a data capture is not."""
    with tf.control_dependencies([tensor, *(tf.identity(a) for a in after)]):
        now = tf.timestamp()
    with tf.control_dependencies([now]):
        return now, tf.identity(tensor)


def _dtype_text(dtype):
    """tf/np dtypes as the names ``check_dtype_name`` expects; anything else unchanged."""
    if isinstance(dtype, tf.DType):
        return dtype.name
    if isinstance(dtype, type) and issubclass(dtype, np.generic) or isinstance(dtype, np.dtype):
        return np.dtype(dtype).name
    return dtype


def _is_keras_variable(value):
    import sys
    keras = sys.modules.get("keras")
    return keras is not None and isinstance(value, keras.Variable)


def _variable_specs(variables):
    """[(unique name, shape tuple, tf dtype)] of ``variables``; TypeError/ValueError on bad input."""
    message = ("variables must be an iterable of tf.Variable or keras.Variable, such as "
               "model.trainable_variables")
    if variables is None or isinstance(variables, (str, bytes, tf.Tensor, tf.Variable)) \
            or _is_keras_variable(variables):
        raise TypeError(message)
    try:
        items = list(variables)
    except TypeError:
        raise TypeError(message) from None
    if not items:
        raise ValueError("variables is empty")
    specs, seen = [], set()
    for index, v in enumerate(items):
        if isinstance(v, tf.Variable):
            name = v.name[:-2] if v.name.endswith(":0") else v.name
        elif _is_keras_variable(v):
            name = v.path
        else:
            raise TypeError(f"variables[{index}] is a {type(v).__name__}; {message}")
        if id(v) in seen:
            raise ValueError(f"variables has {name!r} twice")
        seen.add(id(v))
        dtype = tf.as_dtype(v.dtype)
        if not dtype.is_floating:
            raise TypeError(f"variables[{index}] {name!r} is {dtype.name}, ScaleCom compresses "
                            f"floating-point variables")
        if dtype == tf.bfloat16:
            raise TypeError(f"variables[{index}] {name!r} is bfloat16: Horovod's TensorFlow collectives have "
                            f"no bfloat16 kernel, so its gradient cannot be reduced, with ScaleCom or without "
                            f"(a mixed_bfloat16 policy keeps variables in float32)")
        shape = tuple(v.shape)
        if any(d is None for d in shape):
            raise ValueError(f"variables[{index}] {name!r} has an unknown shape {shape}")
        specs.append((name, tuple(int(d) for d in shape), dtype))
    counts = {}
    for name, _, _ in specs:
        counts[name] = counts.get(name, 0) + 1
    # Names key state_dict(); repeated ones (unnamed tf.Variables) get their position appended.
    return [(name if counts[name] == 1 else f"{name}#{i}", shape, dtype)
            for i, (name, shape, dtype) in enumerate(specs)]
