"""The leader's indices on every rank, as graph ops of the TensorFlow ScaleCom (CLT-k, Chen et al.,
NeurIPS 2020, Algorithm 1, step 2).

The graph is the same on every rank: whether this rank leads is a runtime ``tf.cond``, and the
exchange is one of (``index_exchange``):

* ``"broadcast"``: ``tf.switch_case`` picks one of ``size`` ``HorovodBroadcast`` ops, one per possible
  root (``root_rank`` is a static attribute, a global rank for Horovod);
* ``"allreduce"``: the leader's indices and a 1, zeros from the others, Sum-allreduced (twice the
  index bytes on the wire; the 1s count the leaders);
* ``"allgather"``: the leader's k indices and nothing from the others.

Ranks whose step counters differ disagree on the leader: the broadcasts' roots then differ (an error
from Horovod), and the allreduce's count or the allgather's length shows other than one leader (the
same error on every rank). ScaleCom's collectives use ``ignore_name_scope``: Horovod keys collectives
by node names, which carry counters of the functions TF inlines.
"""

import horovod.tensorflow as hvd
import tensorflow as tf

from hvd_scalecom.tensorflow import clt_k
from hvd_scalecom.tensorflow.graph import stamp

MODES = ("broadcast", "allreduce", "allgather")


class IndexExchangeGraph:
    """The index exchange of :class:`~hvd_scalecom.tensorflow.ScaleCom` (a base class of it): reads
    ``config``, ``index_exchange``, ``_prefix`` and ``_process_set``."""

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
            wait_from, indices = stamp(indices, start)
            return indices, wait_from

        indices, wait_from = tf.cond(tf.equal(slot.ahead_step, t), waiting, fresh)
        return tf.ensure_shape(indices, [slot.k]), wait_from

    def _select_ahead(self, slot, tensor, finite, t, rank, size, index_dtype):
        """Pipelined: the leader of step ``t + 1`` selects from this step's ``p`` and shares its
        indices now; every rank keeps them for step ``t + 1``. Returns this rank's selection (the
        exchange and the store run as side effects of the step)."""
        leader = tf.cast(self.config.leader_rank(t + 1, size, slot.index), tf.int32)
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
        wait_from, mine = stamp(mine, start)
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
