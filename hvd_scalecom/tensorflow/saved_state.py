"""The TensorFlow ScaleCom's state and statistics: ``stats()``, ``state_dict()``/``load_state_dict()``,
and the configuration a ``tf.train.Checkpoint`` saves with the memories."""

import json
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.trackable.base import Trackable

from hvd_scalecom.config import check_kept_step
from hvd_scalecom.state_checks import check_next_indices, check_saved_shape, check_size, checked_params
from hvd_scalecom.traffic import StepTraffic, index_exchange_bytes, scalecom_tensor_traffic

TIMING_STEPS = 8  # steps whose compute and wait times stats() can report per step


class StateAndStatistics:
    """``stats``, ``state_dict`` and ``load_state_dict`` of :class:`~hvd_scalecom.tensorflow.ScaleCom`
    (a base class of it)."""

    def stats(self, step=None):
        """Payload bytes and compute time of ``step`` on this rank (default: the last complete step).
        The last ``TIMING_STEPS`` (8) steps are kept; an earlier one asked for is a ValueError
        (``total`` counts every step; the default step never is one).

        Returns a dict with ``step``, ``index_bytes``, ``value_bytes``, ``dense_bytes``, ``sent_bytes``,
        ``uncompressed_bytes``, ``ratio`` (uncompressed / sent), ``compress_seconds``,
        ``index_wait_seconds``, ``tensors`` and ``nonfinite_skips`` (tensor-steps whose memory update
        a non-finite reduction skipped, since this object was built), and ``total``: the same since this
        object was built
        (or last loaded by ``load_state_dict``; a ``tf.train.Checkpoint`` restore brings back the saved
        run's tallies with its steps). Bytes follow from the configuration and the step counters; during warm-up
        ``dense_bytes`` also counts the k zero values Horovod's allreduce carries. With ``check_every``,
        ``health`` is :meth:`hvd_scalecom.health.HealthMonitor.summary` (a check step sends ``p``
        densely as its ``value_bytes``; a fallback step as ``dense_bytes``, with no index bytes), and
        this rank 0 of the process set warns once when a variable's checks stay low.
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
                total.add(self._step_traffic(slot, None, dense=True).scaled(dense_steps))
            if compressed_steps:
                total.add(self._step_traffic(slot, None, dense=False).scaled(compressed_steps))
                total.index_bytes += fresh_count * self._index_bytes(slot)
            total.compress_seconds += float(timing[TIMING_STEPS, 0])
            total.index_wait_seconds += float(timing[TIMING_STEPS, 1])
        health = self._health_stats(this_step, total, step) if self.health.enabled else None
        out = this_step.as_dict()
        out["step"] = step
        out["nonfinite_skips"] = sum(int(s.nonfinite.numpy()) for s in self._slots)
        out["total"] = total.as_dict()
        if health is not None:
            out["health"] = health
        return out

    def _index_bytes(self, slot):
        """One exchange's index payload: k indices (the allreduce's also its count of leaders)."""
        return index_exchange_bytes(slot.k, self.config.index_dtype_for(slot.numel),
                                    with_count=self.index_exchange == "allreduce")

    def _step_traffic(self, slot, step, dense=None):
        if dense is None:
            dense = not self.config.is_compressed(slot.numel, step)
        return scalecom_tensor_traffic(slot.numel, slot.k, slot.compressible, slot.grad_dtype, self._value_dtype,
                                       self._index_bytes(slot), warmup=dense)

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
        state = {"config": self.config.as_dict(), "params": params}
        if self.health.enabled:
            state["health"] = self._health_state()
        return state

    def load_state_dict(self, state):
        """Restore what :meth:`state_dict` returned; checks everything before changing anything.

        A memory of ``None`` for a compressible variable (a state saved before its first compressed
        step by the PyTorch frontend) restores zeros. With ``check_every``, the health check's state
        (``"health"``) is restored too; a state without one starts it afresh.
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
        health = self._checked_health_state(state) if self.health.enabled else None
        for name in params:
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
        if health is not None:
            self._load_health(health)
        self._forget_step()

    def _forget_step(self):
        """After a restore: the next gradient begins a step, and eager steps are taken again."""
        self._cursor_graph = None
        self._cursor = 0
        self._stalled = None
        self._in_flight.clear()


class SavedConfiguration(Trackable):
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
