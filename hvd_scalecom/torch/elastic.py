"""Elastic Horovod with ScaleCom: hand the compressor to Horovod's elastic state like the model and
the optimizer (importing ScaleCom imports this module, which registers ScaleComStateHandler)::

    import horovod.torch as hvd
    from hvd_scalecom.torch import ScaleCom

    compression = ScaleCom(model.named_parameters(), ratio=0.01)
    optimizer = hvd.DistributedOptimizer(optimizer, model.named_parameters(), compression=compression)
    state = hvd.elastic.TorchState(model, optimizer, compression=compression, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        while state.batch < steps:
            ...; optimizer.step(); state.batch += 1
            state.commit()  # after optimizer.step(), between steps

What happens to ScaleCom's state when workers join or leave (the policy of ``ScaleCom.resync``):

- Step counters: every rank adopts rank 0's (Horovod keeps rank 0 on a worker of the previous world,
  and syncs the model from it too), so warm-up and the leader schedule ``t mod size`` (with the new
  size) agree again; a new rank continues the job's step count instead of starting at 0.
- Residue memory: each rank keeps its own. Memories differ between ranks by design and are never
  broadcast: a joining rank starts with zeros, the memory of a rank that left is lost (as if that
  rank's unsent gradient had been dropped), the others carry theirs over unchanged.
- Index broadcasts of the old world (receives posted ahead, pipelined indices) are forgotten; the
  next step selects afresh on the leader of the new world.
- The configuration and parameter agreement check runs again at the next ``compress``, so that a
  joining rank with a different configuration fails with a clear error instead of hanging.

How Horovod drives the handler (``horovod.common.elastic.run_fn``):

- ``state.commit()`` calls :meth:`ScaleComStateHandler.save`: a local snapshot of this rank's
  ``state_dict()`` (memories, step counters, pipelined next indices).
- A collective fails (a worker died): :meth:`~ScaleComStateHandler.restore` loads the snapshot
  locally, every rank is back at the last commit; then Horovod re-initialises and calls ``sync``.
- Hosts were added (or a failure): :meth:`~ScaleComStateHandler.sync` runs ``compression.resync()``
  on every rank of the new world, before the model and optimizer are broadcast from rank 0.
- Hosts were only removed: Horovod re-initialises without ``sync`` (``skip_sync``) and no handler is
  called. Nothing needs to change then: the remaining ranks committed the same step counters, the
  commit completed any pipelined broadcast (its indices, chosen by the old world's leader, serve the
  next step on every remaining rank), and each step reads the new size from Horovod. (One corner is
  left: a gradient that ScaleCom first sees not being reduced through it in the very step before that
  commit, such as a sparse gradient without ``sparse_as_dense``, leaves a receive of the old world
  posted.)

Limits: commit between steps (after ``optimizer.step()``), as ``state_dict()`` requires; the global
process set only (a ``process_set`` given to ScaleCom is not re-created by elastic Horovod);
``stats(step)`` adds up the attempts of a step that is rolled back and run again (``stats()["total"]``
counts every attempt); the snapshot is a copy of the memories on their device, as Horovod's model
and optimizer handlers keep theirs.
"""

from horovod.torch.elastic.state import StateHandler, get_handler_registry, set_handler_registry

from hvd_scalecom.torch.scalecom import ScaleCom

__all__ = ["ScaleComStateHandler", "register"]


class ScaleComStateHandler(StateHandler):
    """Horovod ``StateHandler`` for a :class:`~hvd_scalecom.torch.ScaleCom` compressor.

    ``save()`` snapshots this rank's ``state_dict()`` (a copy: memories differ per rank and are never
    sent to other ranks), ``restore()`` loads that snapshot on this rank only, ``sync()`` calls
    ``compression.resync()`` (a collective: rank 0's step counters, own memories).
    """

    def __init__(self, compression):
        super().__init__(compression)
        self._saved_state = compression.state_dict()

    def save(self):
        self._saved_state = self.value.state_dict()  # state_dict() copies the memories

    def restore(self):
        self.value.load_state_dict(self._saved_state)

    def sync(self):
        self.value.resync()


def register():
    """Put :class:`ScaleComStateHandler` first in Horovod's torch handler registry (once), so that
    ``hvd.elastic.TorchState(..., compression=scalecom)`` uses it. Called on import of this module,
    which importing :class:`~hvd_scalecom.torch.ScaleCom` does."""
    registry = list(get_handler_registry())
    if any(handler is ScaleComStateHandler for _, handler in registry):
        return
    set_handler_registry([(ScaleCom, ScaleComStateHandler)] + registry)


register()
