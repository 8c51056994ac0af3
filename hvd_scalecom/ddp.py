"""ScaleCom as a communication hook of PyTorch's ``DistributedDataParallel``.

    from hvd_scalecom.ddp import ScaleComState, scalecom_hook
    state = ScaleComState(process_group=None, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024,
                          named_parameters=model.named_parameters())
    ddp_model.register_comm_hook(state, scalecom_hook)

The equations are those of the Horovod compressor (Chen et al., NeurIPS 2020, Algorithm 1), from
the same functions (:mod:`hvd_scalecom.torch.clt_k`). Per parameter of a bucket with at least
``min_numel`` entries, at synchronised backward pass ``t >= warmup_steps`` (``t`` counts every pass
DDP reduces, warm-up included; passes under ``no_sync()`` are not reduced and not counted):

1. ``p_i = m_i + g_i``; the leader ``j = t mod n`` (``"staggered"``: ``(t + parameter index) mod
   n``) selects ``I = top_k(|p_j|)``, ``k = max(1, ceil(ratio * numel))``;
2. the indices of *all* the bucket's compressed parameters travel in one collective: a broadcast
   from the leader of their concatenation (``"staggered"``: an allreduce-sum of it, to which each
   rank gives the indices it leads and zeros elsewhere: several leaders, one collective);
3. every rank's ``p_i[I]`` of all those parameters, followed by the bucket's dense parameters (fewer
   than ``min_numel`` entries, or every parameter while ``t < warmup_steps``), travel in one
   allreduce (two where ``value_dtype`` differs from the gradients' dtype: values, then dense),
   summed and divided by ``n``;
4. ``m_i <- (1 - beta) m_i + beta (p_i - scatter(I, p_i[I]))`` (skipped, on every rank alike, for a
   parameter whose reduced values are not finite), and the bucket's buffer receives
   ``scatter(I, mean_i p_i[I])`` for each compressed parameter and the averages of the dense ones.

With ``check_every`` (:mod:`hvd_scalecom.health`), at a check step each compressed parameter sends
``p_i`` densely in step 3 in place of ``p_i[I]`` (its update and memory those of the plain step) and
every rank measures ``I`` against the top-k of the reduced ``P``; with ``fallback="dense"`` a
parameter whose checks stay low sends ``p_i`` densely without indices (update ``P``, ``m_i <- (1 -
beta) m_i``) until they recover (:class:`hvd_scalecom.ddp_bucket.BucketStep`).

The hook returns at once: the collectives run while the backward pass goes on. Collectives of one
process group must be issued in the same order on every rank, and a Gloo future completes on one
of the process group's threads at a time no other rank shares; so a step's collectives are issued
through one :class:`hvd_scalecom.ddp_bucket.Issuer`, always in the order (bucket 0's indices,
bucket 0's values, bucket 1's indices, ...), whichever thread gets there first.
"""

import hashlib
import threading

import torch
import torch.distributed as dist

from hvd_scalecom.agreement import DTYPES_HINT, STEPS_HINT, check_gathered, dtype_names, encode, shapes_digest
from hvd_scalecom.config import INDEX_DTYPES, VALUE_DTYPES, ScaleComConfig, check_dtype_name
from hvd_scalecom.ddp_bucket import TORCH_DTYPES, BucketStep
from hvd_scalecom.health import HealthCheck, HealthMonitor
from hvd_scalecom.state_checks import checked_params
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.saved_state import as_memory_of, check_state_entry
from hvd_scalecom.traffic import TrafficMeter

__all__ = ["ScaleComState", "scalecom_hook"]


class ScaleComState:
    """What :func:`scalecom_hook` keeps from step to step: the configuration, the step counter ``iter``
    (synchronised backward passes so far), each parameter's residue memory (by parameter name, kept
    in fp32 at least) and the byte counts of :meth:`stats`.

    Args:
        process_group: the group DDP reduces over (default: the default group).
        ratio, beta, warmup_steps, min_numel, leader, selection, value_dtype, index_dtype: as for the
            Horovod ``hvd_scalecom.torch.ScaleCom`` (see ``hvd_scalecom.config.ScaleComConfig``);
            ``value_dtype`` takes ``torch.bfloat16`` too (DDP's collectives carry it).
        named_parameters: ``model.named_parameters()`` (or the DDP model's): names for
            :meth:`state_dict`, errors and :meth:`stats`, and the parameter order of the
            ``"staggered"`` leader (as Horovod's). Without it parameters are named ``param0``,
            ``param1``, ... in the order the hook first meets them, and there is no ``state_dict``.
        check_every, fallback, min_captured, patience: the health check and the dense fallback, as for
            the Horovod ``ScaleCom`` (``hvd_scalecom.health.HealthCheck``; off by default). The step
            they count is ``iter``; they need ``named_parameters``.
    """

    def __init__(self, process_group=None, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024, *,
                 leader="cyclic", selection="threshold", value_dtype=None, index_dtype=torch.int32,
                 named_parameters=None, check_every=None, fallback=None, min_captured=0.5, patience=2):
        self.config = ScaleComConfig(
            ratio=ratio, beta=beta, warmup_steps=warmup_steps, min_numel=min_numel, leader=leader,
            selection=selection, value_dtype=check_dtype_name(value_dtype, "value_dtype", VALUE_DTYPES),
            index_dtype=check_dtype_name(index_dtype, "index_dtype", INDEX_DTYPES))
        self.health = HealthCheck(check_every=check_every, fallback=fallback, min_captured=min_captured,
                                  patience=patience)
        if self.health.enabled and named_parameters is None:
            raise ValueError(f"check_every={check_every} needs named_parameters (the health check keeps its "
                             f"figures and decisions by parameter name): pass model.named_parameters()")
        self.process_group = _check_group(process_group)
        self.iter = 0  # t: synchronised backward passes so far
        self.nonfinite_skips = 0  # parameter-steps whose memory update a non-finite reduction skipped
        self.traffic = TrafficMeter()
        self._value_dtype = TORCH_DTYPES.get(self.config.value_dtype)
        self._named = named_parameters is not None
        self._params = {}  # id(parameter) -> (name, index, parameter)
        if self._named:
            for index, (name, param) in enumerate(_named_parameter_list(named_parameters)):
                self._params[id(param)] = (name, index, param)
        self._memories = {}  # name -> flat residue memory
        self._health_names = [name for name, _, _ in self._params.values()]
        self._warns = None  # whether this rank warns (rank 0 of the group), known at the first step
        self._monitor = self._new_monitor()
        self._agreed = False
        self._lock = threading.Lock()  # the meter and counters, written from the hook and from callbacks
        self._issuer = None  # this step's Issuer (hvd_scalecom.ddp_bucket)

    # -- statistics and state ---------------------------------------------------------------------

    def stats(self, step=None):
        """Payload bytes handed to the process group on this rank for ``step`` (default: the last
        complete step), as the Horovod ScaleCom's ``stats()``: ``index_bytes`` (sent by a leader,
        received by the others), ``value_bytes``, ``dense_bytes``, ``sent_bytes``,
        ``uncompressed_bytes`` (what DDP's own allreduce would have handed over), ``ratio``,
        ``compress_seconds``, ``index_wait_seconds`` (0 here: nothing waits), ``tensors``,
        ``nonfinite_skips`` and ``total`` (every step so far); with ``check_every``, ``health`` (see
        ``hvd_scalecom.health.HealthMonitor.summary``). Call it between steps."""
        explicit = step is not None
        if step is None:
            step = max(self.iter - 1, 0)
        with self._lock:
            out = self.traffic.step(step, strict=explicit).as_dict()
            out["total"] = self.traffic.total.as_dict()
            if self._monitor is not None:
                out["health"] = self._monitor.summary()
        out["step"] = step
        out["nonfinite_skips"] = self.nonfinite_skips
        return out

    def state_dict(self):
        """This rank's residue memories by parameter name (each rank's differ: every rank saves its
        own), the step counter and the configuration; with ``check_every``, the health check's state
        (``health``: each parameter's streaks, latest figures and fallback). Call it between steps."""
        self._need_names("state_dict()")
        params = {}
        for name, _, param in self._params.values():
            memory = self._memories.get(name)
            params[name] = {"step": self.iter, "shape": list(param.shape),
                            "memory": None if memory is None else memory.detach().clone()}
        out = {"config": self.config.as_dict(), "step": self.iter, "nonfinite_skips": self.nonfinite_skips,
               "params": params}
        if self._monitor is not None:
            out["health"] = self._monitor.state_dict()
        return out

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned (every entry checked before anything changes).
        Every rank must load a state of the same step: the first step after compares them. A state
        without ``health`` (saved without ``check_every``) starts the health check afresh; one with it
        loaded where ``check_every`` is off leaves it unused."""
        self._need_names("load_state_dict()")
        by_name = {name: param for name, _, param in self._params.values()}
        params = checked_params(state, "ScaleComState", self.config.as_dict(), by_name)
        step = state.get("step")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state step must be an int >= 0, got {step!r}")
        memories = {}
        for name, entry in params.items():
            param = by_name[name]
            check_state_entry(name, entry, param.shape, ("memory",), dtype=clt_k.memory_dtype(param.dtype))
            if entry["step"] != step:
                raise ValueError(f"state step of {name!r} is {entry['step']}, the state's {step}")
            if entry.get("memory") is not None:
                memories[name] = as_memory_of(entry["memory"], param)
        monitor = self._new_monitor()
        if monitor is not None and state.get("health") is not None:
            monitor.load_state_dict(state["health"])
        self.iter = step
        self._monitor = monitor
        self.nonfinite_skips = int(state.get("nonfinite_skips", 0))
        self._memories = memories
        self._agreed = False  # the restored step is compared across ranks at the next step
        self._issuer = None

    def __getstate__(self):
        """Pickles without the process group (an unpickled state uses the default group), locks,
        collectives in flight or the parameters themselves: a named state unpickled in another process
        needs :meth:`bind_parameters` before its next step."""
        state = dict(self.__dict__)
        for key in ("process_group", "_lock", "_issuer"):
            del state[key]
        state["_params"] = {}  # (keyed by id(): meaningless in another process)
        return state

    def __setstate__(self, state):
        self.__dict__.update({"health": HealthCheck(), "_monitor": None, "_health_names": []}, **state)
        self._warns = None  # (rank 0 of the group it runs in: known at the next step)
        self.process_group = None
        self._lock = threading.Lock()
        self._issuer = None

    def bind_parameters(self, named_parameters):
        """Name the parameters (``model.named_parameters()``) of a state unpickled or built without
        them; their residue memories are found by these names."""
        params = {id(p): (n, i, p) for i, (n, p) in enumerate(_named_parameter_list(named_parameters))}
        names = [name for name, _, _ in params.values()]
        if self.health.enabled and names != self._health_names:
            raise ValueError("bind_parameters: named_parameters name other parameters than those the health "
                             "check was built for")
        self._named = True
        self._params = params

    # -- internals ----------------------------------------------------------------------------------

    def _new_monitor(self):
        if not self.health.enabled:
            return None
        return HealthMonitor(self.health, self._health_names, warn=bool(self._warns))

    def _bind_warning(self, rank):
        """At the first step: only rank 0 of the group warns when checks stay low (the monitor is
        rebuilt with that knowledge, keeping its state)."""
        if self._warns is None and self._monitor is not None:
            self._warns = rank == 0
            saved = self._monitor.state_dict()
            self._monitor = self._new_monitor()
            self._monitor.load_state_dict(saved)

    def _sends_dense(self, name):
        """Whether the fallback sends parameter ``name`` densely at this step."""
        return self._monitor is not None and self._monitor.sends_dense(name)

    def _count_dense_step(self, name):
        with self._lock:
            self._monitor.count_dense_step(name)

    def _record_check(self, name, t, measures):
        """A check step's measures (every rank's alike: from the reduced ``P`` and the shared ``I``)."""
        with self._lock:
            self._monitor.record(name, t, measures)

    def _need_names(self, what):
        if not self._params or not self._named:
            raise ValueError(f"ScaleComState.{what} needs the parameters' names: build it with "
                             f"named_parameters=model.named_parameters()")

    def _group(self):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("scalecom_hook needs torch.distributed initialised (init_process_group)")
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _describe(self, param):
        """``(name, index)`` of a parameter of a bucket."""
        known = self._params.get(id(param))
        if known is not None and known[2] is param:
            return known[0], known[1]
        if self._named and not self._params:
            raise ValueError("this ScaleComState was unpickled: call its bind_parameters(model.named_parameters()) "
                             "before the next step")
        if self._named:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} reduced by DDP is not among "
                             f"ScaleComState's named_parameters: give it the DDP model's parameters")
        index = len(self._params)
        self._params[id(param)] = (f"param{index}", index, param)
        return f"param{index}", index

    def _memory(self, name, grad):
        memory = self._memories.get(name)
        if memory is None:
            memory = torch.zeros(grad.numel(), dtype=clt_k.memory_dtype(grad.dtype), device=grad.device)
            self._memories[name] = memory
        elif memory.numel() != grad.numel():
            raise ValueError(f"the gradient of {name!r} has {grad.numel()} entries, its residue memory "
                             f"{memory.numel()}: the parameter changed size after training began")
        return memory

    def _check_agreement(self, group, device):
        """At the first step (and the first after load_state_dict): one allgather of a digest of this
        rank's configuration; where they differ, every rank gathers the full summaries and raises the
        same ValueError naming what differs (``hvd_scalecom.agreement``)."""
        summary = {**self.config.as_dict(), "health": self.health.as_dict(), "step": self.iter,
                   "named_parameters": self._named}
        if self._named:
            params = sorted(self._params.values(), key=lambda entry: entry[1])
            summary["parameter_digest"] = shapes_digest([(n, tuple(p.shape)) for n, _, p in params])
            summary["parameter_dtypes"] = dtype_names(p.dtype for _, _, p in params)
        encoded = encode(summary)
        digest = hashlib.sha256(encoded).digest()[:8]
        local = torch.tensor([int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")],
                             dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local, group=group)
        if any(not torch.equal(g, local) for g in gathered):
            texts = [None] * len(gathered)
            dist.all_gather_object(texts, encoded, group=group)
            check_gathered("ScaleComState", texts, {
                "parameter_digest": "(parameter_digest covers the names and shapes of named_parameters.)",
                "parameter_dtypes": DTYPES_HINT, "step": STEPS_HINT})
        self._agreed = True

    def _record(self, t, **counts):
        with self._lock:
            self.traffic.record(t, **counts)

    def _add_time(self, t, seconds, skips=0):
        with self._lock:
            self.traffic.add_time(t, seconds)
            self.nonfinite_skips += skips


def scalecom_hook(state, bucket):
    """DDP communication hook (``ddp_model.register_comm_hook(state, scalecom_hook)``): ScaleCom for
    the bucket's parameters (see the module's docstring); returns a Future of the bucket's buffer
    holding the averaged (compressed) gradients."""
    if not isinstance(state, ScaleComState):
        raise TypeError(f"scalecom_hook's state must be a ScaleComState, got {type(state).__name__}")
    try:
        return BucketStep(state, bucket).start()
    except BaseException:
        state._issuer = None
        raise


def _check_group(process_group):
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(process_group).__name__}")
    return process_group


def _named_parameter_list(named_parameters):
    usage = "named_parameters must be an iterable of (name, parameter) pairs, such as model.named_parameters()"
    if isinstance(named_parameters, (str, bytes, torch.Tensor, dict)):
        raise TypeError(usage)
    try:
        pairs = list(named_parameters)
    except TypeError:
        raise TypeError(usage) from None
    if not pairs:
        raise ValueError("named_parameters is empty")
    names = set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_parameters must hold (str, torch.Tensor) pairs, got {pair!r:.80}")
        if pair[0] in names:
            raise ValueError(f"named_parameters names {pair[0]!r} twice")
        names.add(pair[0])
    return pairs
