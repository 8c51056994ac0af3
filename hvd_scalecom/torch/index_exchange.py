"""When each rank posts its part of a leader's index exchange, for which step, and who waits.

CLT-k (Chen et al., NeurIPS 2020, Algorithm 1, step 2) has every rank use the top-k indices ``I`` of
one rank, the step's leader. :class:`IndexExchange` moves them through Horovod for the PyTorch
ScaleCom so that no order of gradient hooks can deadlock.
"""

from typing import NamedTuple, Optional

import horovod.torch as hvd
import torch

from hvd_scalecom.torch.collectives import wait

MODES = ("allgather", "broadcast")


class Posted(NamedTuple):
    """This rank's part of one exchange, posted before the tensor's own hook."""

    step: int  # the step whose indices it carries
    handle: object  # Horovod's handle of this rank's part; None where restored from a state
    indices: Optional[torch.Tensor]  # this rank's own indices (a pipelined leader's), else None


class _Exchanges:
    """What :class:`IndexExchange` keeps for one parameter."""

    __slots__ = ("posted", "expected", "excluded", "ahead_for")

    def __init__(self):
        self.posted = None  # a Posted, or None
        self.expected = None  # the step whose exchange every rank posted ahead of the hook
        self.excluded = False  # seen reduced without compress(): never posted ahead again
        self.ahead_for = None  # pipelined: the step whose indices were selected (or restored) ahead


class IndexExchange:
    """The index exchanges of one ScaleCom: one per compressed parameter and step.

    An exchange is one Horovod collective, ``scalecom.<name>`` (``scalecom.<name>.ahead`` for the
    indices a pipelined step shares for the next one), to which every rank of the process set posts
    exactly one part: the leader its k indices; every other rank nothing (``"allgather"``: Horovod
    fuses allgathers that are ready together) or a buffer of k to receive into (``"broadcast"``).

    Invariants, for parameter ``p`` at step ``t`` with leader ``L``:

    1. At its first ``compress`` of step ``t`` (:meth:`begin_step`) a rank other than ``L`` posts its
       part of the exchange of *every* parameter it will compress in ``t`` (its step counter is
       ``t``, it requires grad, it is not excluded, and ``skips`` does not exempt its step: the health
       check's dense fallback exchanges no indices); such a parameter is *expected* in ``t``.
    2. A rank other than ``L`` waits for ``I`` only in ``p``'s own hook (:meth:`receive`), posting
       its part there if step 1 did not. ``L`` never waits in ``compress``: it posts its part when it
       has selected (:meth:`send`) and completes it in ``decompress`` (:meth:`finish`), after every
       rank has reduced ``p``. With the cyclic leader no hook order can therefore deadlock.
    3. Pipelined: in step ``t`` every rank posts its part of step ``t + 1``'s exchange
       (:meth:`share_ahead`); step ``t + 1`` uses those indices and exchanges none of its own.
       At most one exchange per name is open at a time.
    4. ``p`` expected in ``t`` but not compressed in ``t`` (Horovod reduced it otherwise, e.g. a
       sparse gradient) left the other ranks' parts open: at the next :meth:`begin_step` ``L``
       completes it with k dummy indices, every rank synchronizes it, and ``p`` is excluded from
       step 1 from then on.
    5. :meth:`next_indices` (``state_dict``) waits only for the pipelined exchanges, to which every
       rank posted a step ago; :meth:`restore` (``load_state_dict``) keeps the exchanges invariant 4
       would complete; :meth:`forget` (``resync``, a new Horovod world) drops everything.
    """

    def __init__(self, slots, config, mode, process_set, stall):
        if mode not in MODES:
            raise ValueError(f"index_exchange must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._slots = slots  # the compressor's: index, name, param, step (read only here)
        self._of = [_Exchanges() for _ in slots]
        self._config = config
        self._process_set = process_set
        self._kwargs = {} if process_set is None else {"process_set": process_set}
        self._stall = stall
        self._posted_through = -1  # the last step begin_step posted for
        self._kept_open = []  # (slot, this rank's Posted or None) that load_state_dict kept open
        self.skips = None  # (slot, t) -> whether slot's compressed step t exchanges no indices (a fallback step)

    # -- one step ---------------------------------------------------------------------------------

    def begin_step(self, t, rank, size):
        """Invariants 1 and 4, once per step ``t`` (later calls for ``t`` do nothing)."""
        if self._posted_through == t:
            return
        self._posted_through = t
        stale = [self._complete_unused(slot, posted, rank) for slot, posted in self._kept_open]
        self._kept_open = []
        for slot, x in zip(self._slots, self._of):
            if x.expected is not None and x.expected < t and slot.step <= x.expected:
                stale.append(self._drop_stale(slot, x, rank))
            if x.excluded or slot.step != t or not slot.param.requires_grad:
                continue
            if self._config.is_compressed(slot.param.numel(), t) and not (self.skips and self.skips(slot, t)):
                x.expected = t
                self._post(slot, x, t, rank, size)
        for handle in stale:
            hvd.synchronize(handle)

    def posted_for(self, slot, t):
        """Whether this rank's part of ``slot``'s exchange of step ``t`` is posted already."""
        posted = self._of[slot.index].posted
        return posted is not None and posted.step == t

    def receive(self, slot, t, rank, size):
        """``I`` of step ``t`` once the leader's part arrives (invariant 2): this rank's own indices
        where it selected them a step ago (pipelined leader, or restored)."""
        x = self._of[slot.index]
        if x.posted is None or x.posted.step != t:
            self._post(slot, x, t, rank, size)  # not reduced when the step's posts went out
        _, handle, indices = x.posted
        x.posted = None
        received = self._check_received(self._synchronize(handle, slot), slot)
        return indices if received is None else received

    def send(self, slot, leader, indices):
        """The leader starts its part of this step's exchange (invariant 2); returns the handle for
        :meth:`finish`."""
        return self._share_async(slot, leader, indices)

    def finish(self, handle, slot):
        """Completes the leader's own part (long done: every rank has reduced the tensor)."""
        self._check_received(self._synchronize(handle, slot), slot)

    def share_ahead(self, slot, t, leader, indices):
        """Pipelined (invariant 3): posts this rank's part of step ``t``'s exchange now, ``indices``
        on the leader of ``t``, None elsewhere."""
        x = self._of[slot.index]
        x.posted = Posted(t, self._share_async(slot, leader, indices, ahead=True), indices)
        x.expected = x.ahead_for = t

    def selected_ahead_for(self, slot, t):
        """Whether ``slot``'s indices of step ``t`` were selected a step ago (or restored)."""
        return self._of[slot.index].ahead_for == t

    # -- state ------------------------------------------------------------------------------------

    def next_indices(self, slot):
        """``(t, I)`` selected ahead for ``slot``'s next step, once received, else None."""
        x = self._of[slot.index]
        if not (x.posted is not None and x.posted.step == x.ahead_for):
            return None
        t, handle, indices = x.posted
        received = self._check_received(self._synchronize(handle, slot), slot)
        indices = indices if received is None else received
        x.posted = Posted(t, None, indices)
        return t, indices

    def restore(self, ahead):
        """After a state was loaded: ``ahead`` maps each restored slot to its ``(t, I)`` or None.
        Exchanges still open for a step now over, which need their leader's part, are kept for the
        next :meth:`begin_step` to complete, and their parameters excluded (invariants 4 and 5)."""
        left_open = [(slot, x.posted) for slot, x in zip(self._slots, self._of)
                     if x.expected is not None and slot.step <= x.expected and x.ahead_for != x.expected]
        for slot, restored in ahead.items():
            x = self._of[slot.index]
            x.posted = None if restored is None else Posted(restored[0], None, restored[1])
            x.expected = x.ahead_for = None if restored is None else restored[0]
        for slot, _ in left_open:
            self._of[slot.index].excluded = True
        self._kept_open += left_open
        self._posted_through = -1

    def forget(self):
        """A new Horovod world (elastic): nothing of the old one is open."""
        for x in self._of:
            x.posted = x.expected = x.ahead_for = None
            x.excluded = False
        self._kept_open = []
        self._posted_through = -1

    # -- Horovod ------------------------------------------------------------------------------------

    def index_dtype(self, numel):
        return _TORCH_INDEX_DTYPES[self._config.index_dtype_for(numel)]

    def _share_async(self, slot, leader, indices=None, ahead=False):
        """Posts this rank's part: ``indices`` on ``leader`` (relative rank), None elsewhere."""
        name = f"scalecom.{slot.name}.ahead" if ahead else f"scalecom.{slot.name}"
        ps = self._process_set
        if self.mode == "broadcast":  # (Horovod wants the root as a global rank)
            buffer = self._dummy_indices(slot) if indices is None else indices
            return hvd.broadcast_async_(buffer, root_rank=leader if ps is None else ps.ranks[leader], name=name,
                                        **self._kwargs)
        if indices is None:
            numel = slot.param.numel()
            indices = torch.empty(0, dtype=self.index_dtype(numel), device=slot.param.device)
        return hvd.allgather_async(indices, name=name, **self._kwargs)

    def _dummy_indices(self, slot):
        numel = slot.param.numel()
        return torch.zeros(self._config.num_selected(numel), dtype=self.index_dtype(numel),
                           device=slot.param.device)

    def _post(self, slot, x, t, rank, size):
        numel = slot.param.numel()
        leader = self._config.leader_rank(t, size, slot.index)
        if leader == rank or not self._config.is_compressed(numel, t):
            return
        if x.posted is not None and x.posted.step == t:
            return  # selected a step ago (pipelined)
        x.posted = Posted(t, self._share_async(slot, leader), None)

    def _drop_stale(self, slot, x, rank):
        x.excluded = True
        x.expected = x.ahead_for = None
        posted, x.posted = x.posted, None
        return self._complete_unused(slot, posted, rank)

    def _complete_unused(self, slot, posted, rank):
        """The handle to synchronize for an exchange no step will use: this rank's ``posted`` part,
        or where it posted none (the leader), the dummy part it posts now."""
        if posted is not None:
            return posted.handle
        return self._share_async(slot, rank, self._dummy_indices(slot))

    def _check_received(self, received, slot):
        """``received`` (None, or the indices delivered), unless it does not hold k indices: then the
        ranks disagree on the step's leader (an allgather gives 0 where no rank led, 2k where two
        did), and every rank, seeing the same count, raises the same ValueError."""
        k = self._config.num_selected(slot.param.numel())
        if received is not None and received.numel() != k:
            raise ValueError(
                f"ScaleCom: the index exchange of {slot.name!r} delivered {received.numel()} indices, not "
                f"k = {k}: the ranks disagree on this step's leader, so their step counters differ (restore "
                f"every rank from a state_dict() of the same step)")
        return received

    def _synchronize(self, handle, slot):
        """The leader's indices once their exchange completes (:func:`~hvd_scalecom.torch.collectives.wait`);
        None for no ``handle`` (restored from a state: nothing in flight)."""
        if handle is None:
            return None
        return wait(handle, self._stall, "ScaleCom",
             f"the leader's indices for {slot.name!r}. A rank reduces this parameter later than the others "
             f"(e.g. it is frozen or unused on some ranks only, or ranks reduce parameters in different "
             f"orders while leader='staggered'), a rank stopped training, or a rank is still in warm-up "
             f"(its step counters differ: restore every rank from a state_dict() of the same step)"
             + (", or the ranks restored states of which only some held this parameter's next_indices "
                "(pipelined: the others use the indices chosen ahead and exchange none; restore every rank "
                "from states saved after the same step)" if self._config.pipelined else ""),
             "Set ScaleCom(timeout=...) to raise instead.")


_TORCH_INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64}
