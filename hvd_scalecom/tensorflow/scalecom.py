"""ScaleCom (CLT-k) as a ``horovod.tensorflow`` compression for ``hvd.DistributedGradientTape`` (TF2).

Chen et al., NeurIPS 2020, Algorithm 1; the equations are in :mod:`hvd_scalecom.tensorflow.clt_k`.
Per variable and step ``t``, with leader ``config.leader_rank(t, size, index)``:

1. ``compress(g)`` (core): on the leader, ``p = m + g`` and its top-k indices ``I``;
2. (Horovod) ``I`` reaches every rank (:mod:`hvd_scalecom.tensorflow.index_exchange`);
3. (core) every rank returns ``p[I]`` (k values);
4. (Horovod) the tape allreduces them with its own op, pre/postscale and process set;
5. ``decompress`` (core): the reduced values scattered into zeros of the gradient's shape, and the
   low-pass memory update unless a reduced value is not finite.

Horovod calls ``compress`` inside a ``tf.function``, so Python here runs at trace time only: what
changes per step (memory, step counter, tallies) is a ``tf.Variable`` updated by graph ops, and
decisions that depend on the step are graph conditionals with static shapes on every branch.
Gradients are matched to variables by position (:mod:`hvd_scalecom.tensorflow.gradient_matching`).
"""

import itertools
import math

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor
from tensorflow.python.ops import control_flow_util

from hvd_scalecom import agreement
from hvd_scalecom.config import HOROVOD_VALUE_DTYPES, INDEX_DTYPES, ScaleComConfig, check_dtype_name
from hvd_scalecom.health import HealthCheck
from hvd_scalecom.tensorflow import clt_k
from hvd_scalecom.tensorflow.gradient_matching import GradientMatching
from hvd_scalecom.tensorflow.graph import graph_of, stamp
from hvd_scalecom.tensorflow.health import HealthGraph, SlotHealth
from hvd_scalecom.tensorflow.index_exchange import MODES as INDEX_EXCHANGES
from hvd_scalecom.tensorflow.index_exchange import IndexExchangeGraph
from hvd_scalecom.tensorflow.saved_state import TIMING_STEPS, SavedConfiguration, StateAndStatistics
from hvd_scalecom.tensorflow.variables import dtype_text, variable_specs

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
        self.health = None  # with check_every: the health check's state (tensorflow.health.SlotHealth)


class ScaleCom(IndexExchangeGraph, HealthGraph, GradientMatching, StateAndStatistics, tf.Module, Compressor):
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
            leader's indices travel (:mod:`hvd_scalecom.tensorflow.index_exchange`).
        pipelined: use indices the leader selected one step earlier, so that their exchange overlaps
            the values' allreduce (see ``ScaleComConfig``); off by default: exact ScaleCom.
        op: the op the tape or optimizer reduces with, ``hvd.Average`` (default) or ``hvd.Sum``:
            ScaleCom reduces warm-up steps densely itself, with this op.
        check_every, fallback, min_captured, patience: the health check (:mod:`hvd_scalecom.health`,
            off by default): one compressed step in ``check_every`` of each variable sends ``p`` densely
            and measures how much of the global top-k's energy the leader's indices carried
            (``stats()["health"]``); ``fallback="dense"`` sends a variable densely after ``patience``
            checks in a row below ``min_captured``, until ``patience`` checks reach it again (not with
            ``pipelined``).

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
                 process_set=None, index_exchange="broadcast", pipelined=False, op=hvd.Average,
                 check_every=None, fallback=None, min_captured=0.5, patience=2):
        config = ScaleComConfig(
            ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=min_numel, leader=leader,
            selection=selection,
            value_dtype=check_dtype_name(dtype_text(value_dtype), "value_dtype", HOROVOD_VALUE_DTYPES),
            index_dtype=check_dtype_name(dtype_text(index_dtype), "index_dtype", INDEX_DTYPES),
            pipelined=pipelined)
        health = HealthCheck(check_every=check_every, fallback=fallback, min_captured=min_captured,
                             patience=patience)
        if health.fallback is not None and config.pipelined:
            raise ValueError(f"fallback={health.fallback!r} does not go with pipelined=True: the fallback decides "
                             f"at a step's end, after a pipelined step has shared the next step's indices")
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
        specs = variable_specs(variables)
        if not tf.executing_eagerly():
            raise RuntimeError("create ScaleCom eagerly, outside tf.function: its state lives in "
                               "tf.Variables that must exist before the first traced step")
        super().__init__(name="scalecom")
        self.config = config
        self.health = health
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
            if health.enabled and slot.compressible:
                slot.health = SlotHealth(index, TIMING_STEPS)
            slots.append(slot)
        self._slots = tuple(slots)
        self._by_name = {s.name: s for s in slots}
        # What tf.train.Checkpoint saves: the configuration, checked first at a restore (its name sorts
        # before the variables', which a restore into another configuration then leaves unchanged),
        # memories of compressible variables, every step counter, the statistics' tallies (a restore
        # then rolls them back with the steps).
        self.configuration = SavedConfiguration(
            {**config.as_dict(), "variables": [[s.dtype.name, list(s.shape)] for s in slots]}, self._forget_step)
        self.memories = [s.memory for s in slots if s.compressible]
        self.steps = [s.step for s in slots]
        self.statistics = [v for s in slots for v in (s.tally, s.nonfinite, s.timing)]
        if config.pipelined:  # and the indices already chosen for the next step
            self.pipeline = [v for s in slots if s.compressible for v in (s.next_indices, s.ahead_step)]
            self.statistics += [s.fresh for s in slots if s.compressible]
        if health.enabled:  # the checks' results and the fallback's decisions (with their tallies)
            self.health_state = [v for s in slots if s.health is not None for v in s.health.variables()]
        self._cursor_graph = None  # (weak reference to) the graph the last gradient was traced in
        self._cursor = 0
        self._taking = 0  # the variable whose gradient compress takes (or took last)
        self._stalled = None  # why eager steps are refused (one was refused part-way), or None
        self._step_checked = None  # variable #0's step counter, once every variable was found stepped
        self._in_flight = []  # (slot, wire dtype) compressed since the last decompress: one group's
        self._agreed = False  # configurations compared across ranks (at the first compress)
        self._health_warned = False  # the health check's warning was given (rank 0)

    def __repr__(self):
        health = f", {self.health}" if self.health.enabled else ""
        return (f"ScaleCom({len(self._slots)} variables, {self.config}, "
                f"index_exchange={self.index_exchange!r}, op={'Sum' if self.op == hvd.Sum else 'Average'}{health})")

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
            self._refused(graph_of(tensor), error)
            raise

    def _compress_next(self, tensor):
        graph = graph_of(tensor)  # (the gradients' graph; ensure_shape's would be Horovod's cond branch)
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
        slot, t, indices, dense, in_warmup, grad, memory_at_indices, exact, modes = ctx
        with tf.name_scope(f"{self._prefix}_{slot.index}_decompress"):
            start, tensor = stamp(tensor)
            self._update_memory(slot, t, tensor, in_warmup, grad, indices, memory_at_indices, exact, modes)

            def scatter(values):
                return clt_k.scatter_dense(values, indices, slot.shape, slot.grad_dtype)

            def sparse():
                if modes is None:
                    return scatter(tensor)
                return self._health_output(slot, tensor, indices, *modes, scatter)

            if in_warmup is None:
                out = sparse()
            else:
                out = tf.cond(in_warmup, lambda: self._checked_dense(tensor, dense, slot), sparse)
            row = tf.cast(t % TIMING_STEPS, tf.int32)
            end, out = stamp(out, start)
            seconds = end - start
            slot.timing.scatter_nd_add([[row, 0], [TIMING_STEPS, 0]], tf.stack([seconds, seconds]))
            return out

    def _update_memory(self, slot, t, reduced, in_warmup, grad, indices, memory_at_indices, exact, modes):
        """The low-pass memory update of a compressed step, skipped (and counted) when the reduced
        values are not finite: then some rank's gradient was, and every rank sees it alike. With the
        health check (``modes``: is it a check, is the variable sent densely), a fallback step leaves
        ``m = 0`` (everything owed was sent), and a check's measures are recorded."""
        finite = tf.reduce_all(tf.math.is_finite(reduced))
        compressed = tf.constant(True) if in_warmup is None else tf.logical_not(in_warmup)
        sent_dtype = self._value_dtype or grad.dtype

        def filtered():
            with tf.control_dependencies([clt_k.filter_memory(
                    slot.memory, grad, indices, memory_at_indices, exact, self.config.beta,
                    sent_dtype)]):
                return tf.constant(0, tf.int64)

        def decayed():
            with tf.control_dependencies([slot.memory.assign(tf.zeros_like(slot.memory))]):
                return tf.constant(0, tf.int64)

        def update():
            if modes is None or self.health.fallback is None:
                return filtered()
            return tf.cond(modes[1], decayed, filtered)

        def skip():
            return tf.cast(compressed, tf.int64)  # warm-up steps update nothing and count nothing

        skipped = tf.cond(tf.logical_and(compressed, finite), update, skip)
        slot.nonfinite.assign_add(skipped)
        if modes is not None:
            self._health_record(slot, t, reduced, indices, compressed, *modes)

    # -- the graph of one compressed step ---------------------------------------------------------

    def _compress(self, slot, tensor):
        # (on a rank outside the process set Horovod traces this in a tf.cond branch that never runs)
        size = self._process_set.size()
        rank = self._process_set.rank() if self._process_set.included() else -1
        start, tensor = stamp(tensor)
        t = slot.step.read_value()
        slot.step.assign_add(1)
        leader = tf.cast(self.config.leader_rank(t, size, slot.index), tf.int32)
        sent_dtype = self._value_dtype or tensor.dtype
        index_dtype = tf.as_dtype(self.config.index_dtype_for(slot.numel))
        row = tf.cast(t % TIMING_STEPS, tf.int32)
        modes = self._health_modes(slot, t) if slot.health is not None else None  # (is_check, falling_back)

        def compressed():
            # A non-finite gradient anywhere on this rank makes every value it sends NaN, so that all
            # ranks see a non-finite reduction and skip the memory update (in decompress); a leader
            # then selects from its memory (clt_k.selection_source). Read once for both.
            finite = tf.reduce_all(tf.math.is_finite(tensor))  # (a sum could overflow: entry by entry)
            def exchange():
                return self._indices_for_step(slot, tensor, finite, t, leader, rank, size, index_dtype, start)

            indices, wait_from = exchange() if modes is None else self._health_indices(
                slot, *modes, exchange, index_dtype, start)
            received, indices = stamp(indices)
            selected = []
            if self.config.pipelined:
                selected = [self._select_ahead(slot, tensor, finite, t, rank, size, index_dtype)]
            memory_at_indices, exact = clt_k.take(slot.memory, tensor, indices)  # m_i[I], p_i[I]
            values = tf.where(finite, tf.cast(exact, sent_dtype), tf.constant(float("nan"), sent_dtype))
            if modes is not None:  # p densely in a check or fallback step
                values = self._health_values(slot, tensor, finite, values, *modes, sent_dtype)
            # The memory is updated once the leader has read p for its selection ahead.
            with tf.control_dependencies(selected):
                memory_at_indices = tf.identity(memory_at_indices)
            end, values = stamp(values, received)
            self._record(slot, row, (wait_from - start) + (end - received), received - wait_from,
                         compressed=True)
            return values, tf.zeros([0], tensor.dtype), indices, memory_at_indices, exact

        if self.config.warmup_steps == 0:
            values, _, indices, memory_at_indices, exact = compressed()
            return values, (slot, t, indices, None, None, tensor, memory_at_indices, exact, modes)

        def warmup():
            """Dense reduction (``op``) by ScaleCom itself; Horovod's allreduce carries k ones, which
            tell ``decompress`` which op Horovod reduced with (1 averaged, the ranks' count summed)."""
            dense = hvd.allreduce(tensor, op=self.op, name=f"{self._prefix}_dense_{slot.index}",
                                  ignore_name_scope=True, process_set=self._process_set)
            end, dense = stamp(dense, start)
            self._record(slot, row, end - start, tf.constant(0.0, tf.float64), compressed=False)
            unused = tf.zeros([slot.k], slot.memory.dtype)
            return (tf.ones([slot.k], sent_dtype), tf.reshape(dense, [-1]),
                    tf.zeros([slot.k], index_dtype), unused, unused)

        in_warmup = t < self.config.warmup_steps
        values, dense, indices, memory_at_indices, exact = tf.cond(in_warmup, warmup, compressed)
        values = tf.ensure_shape(values, [slot.k] if modes is None else [None])
        return values, (slot, t, indices, dense, in_warmup, tensor, memory_at_indices, exact, modes)

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

    def _record(self, slot, row, compute_seconds, wait_seconds, compressed):
        seconds = tf.stack([compute_seconds, wait_seconds])
        slot.timing.scatter_nd_update([[row]], [seconds])
        slot.timing.scatter_nd_add([[TIMING_STEPS]], [seconds])
        slot.tally.assign_add([0, 1] if compressed else [1, 0])

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
        summary = {**self.config.as_dict(), "health": self.health.as_dict(),
                   "index_exchange": self.index_exchange, "op": int(self.op),
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
