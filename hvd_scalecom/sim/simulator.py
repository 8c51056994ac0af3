"""n synchronous workers of one compression scheme in one process.

The caller computes every worker's gradient (at :meth:`Simulator.worker_params`, e.g. on its own data
shard) and hands them to :meth:`Simulator.step`; the simulator stacks them into one ``(n, numel)``
tensor per parameter, lets the scheme compress, "communicate" and update its per-worker state, and
returns the update every worker applies with the step's traffic and diagnostics.
"""

import dataclasses
import numbers

import torch

from hvd_scalecom.config import check_int
from hvd_scalecom.sim.base import Scheme, TensorSpec
from hvd_scalecom.torch.parameters import named_parameter_list
from hvd_scalecom.traffic import ITEMSIZE, StepRecord, dtype_name

_SUMMED = ("index_bytes", "value_bytes", "dense_bytes", "payload_bytes", "sent_index_bytes",
           "sent_value_bytes", "sent_dense_bytes", "sent_bytes", "uncompressed_bytes",
           "uncompressed_sent_bytes")
_DTYPES = "float16, bfloat16, float32 or float64"  # the floating-point dtypes the byte counts know


def _supported(dtype):
    return dtype.is_floating_point and dtype_name(dtype) in ITEMSIZE


def _check_device(device):
    """``device`` as a ``torch.device`` (None stays None); TypeError or ValueError naming ``device``
    for one torch cannot parse or this machine does not have (torch's own error names neither)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, a device string or index, or None, got {device!r}")
    try:
        checked = torch.device(device)
        torch.empty(0, device=checked)
    except (RuntimeError, AssertionError, ValueError) as err:
        raise ValueError(f"device {device!r} cannot be used here: {err}") from None
    return checked


def _check_gradient_dtype(spec, g, source=""):
    """TypeError unless ``g`` has its parameter's dtype, as Horovod reduces it (another would keep the
    memory, and count the bytes, in that dtype); ``source`` (" from worker i") goes into the message."""
    if g.dtype != spec.dtype:
        expected = _DTYPES if not _supported(g.dtype) else f"the parameter's dtype, {spec.dtype}"
        raise TypeError(f"gradient of {spec.name!r}{source} is {g.dtype}, expected {expected}")


@dataclasses.dataclass
class StepResult:
    """One simulated step.

    update: one tensor per parameter (its shape). For ``kind == "gradient"`` the aggregated gradient
        every worker's optimizer applies; for ``kind == "model"`` the change of the shared model.
    traffic: the step's collectives and bytes (:class:`hvd_scalecom.traffic.StepRecord`).
    diagnostics: scheme-specific figures, e.g. ``residue_norm``, ``overlap`` (ScaleCom).
    model: for ``kind == "model"``, the shared model after the step (one tensor per parameter, in
        the scheme's dtype: fp32 at least); None otherwise.
    names: the parameters' names (for error messages); None where unknown.
    """

    update: list
    traffic: StepRecord
    diagnostics: dict
    kind: str
    model: list = None
    names: list = None

    def apply_to(self, params, optimizer=None):
        """Apply the update to ``params`` (the caller's single copy of the model).

        Gradient kind: sets each ``p.grad`` to the update and runs ``optimizer.step()`` if one is given.
        Model kind: sets each parameter to the shared model (the workers' optimizer ran inside the
        scheme), rounded to the parameter's dtype as each worker's copy is: with fp16 or bf16
        parameters, adding the rounded changes step after step would drift away from it.
        Every parameter's shape is checked before any is changed.
        """
        params = list(params)
        if len(params) != len(self.update):
            raise ValueError(f"got {len(params)} parameters for {len(self.update)} updates")
        for j, (p, u) in enumerate(zip(params, self.update)):
            label = f"parameter {j}" + (f" ({self.names[j]!r})" if self.names else "")
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"{label} must be a tensor, got {type(p).__name__}")
            if p.shape != u.shape:
                raise ValueError(f"{label} has shape {tuple(p.shape)}, its update {tuple(u.shape)}")
        with torch.no_grad():
            for j, (p, u) in enumerate(zip(params, self.update)):
                if self.kind == "model":
                    p.copy_(self.model[j].view(p.shape))
                else:
                    p.grad = u.to(p.dtype).clone()
        if optimizer is not None and self.kind == "gradient":
            optimizer.step()


class Simulator:
    """Simulate ``n_workers`` synchronous workers running ``scheme`` on the parameters of a model.

    named_parameters: ``model.named_parameters()``; the simulator keeps references to the tensors
        (gradient schemes evaluate workers at the caller's current weights; model schemes copy them
        once into per-worker local models). Every one must require grad: a frozen parameter (or a
        buffer) is one ``hvd.DistributedOptimizer`` never reduces, so pass only those trained
        (``[(n, p) for n, p in model.named_parameters() if p.requires_grad]``, and
        ``names=sim.names`` to :func:`per_worker_gradients`); a ValueError names one that does not.
    diagnostics: whether schemes compute the optional diagnostics (ScaleCom's overlap, Sketched SGD's
        recall); residue norms are always reported.
    device: where a local-SGD scheme (``QsparseLocalSGD``) keeps its per-worker and shared models
        (default: the parameters' device); gradient schemes keep their state where the gradients
        are. A ``torch.device``, a device string or index, checked here (a ValueError names a device
        this machine does not have).

    Example::

        sim = Simulator(ScaleCom(ratio=0.01, beta=0.1), 64, model.named_parameters())
        for inputs, targets in shards:                     # (n, batch, ...): worker i's in row i
            grads = per_worker_gradients(model, loss_fn, sim.worker_params(), inputs, targets)
            result = sim.step_stacked(grads)
            result.apply_to(model.parameters(), optimizer)
            print(result.traffic.sent_bytes(), result.diagnostics["overlap"])
    """

    def __init__(self, scheme, n_workers, named_parameters, *, diagnostics=True, device=None):
        if not isinstance(scheme, Scheme):
            raise TypeError(f"scheme must be a hvd_scalecom.sim Scheme, got {type(scheme).__name__}")
        if scheme.specs is not None:  # (its state, the workers' memories, belongs to that Simulator)
            raise ValueError(f"scheme is already simulated by another Simulator: make a new "
                             f"{type(scheme).__name__} for each Simulator")
        n_workers = check_int(n_workers, "n_workers", 1)  # (a Python int: NumPy's would go into state_dict())
        pairs = named_parameter_list(named_parameters, "Simulator")
        for name, p in pairs:
            if p.dtype.is_floating_point and not _supported(p.dtype):
                raise TypeError(f"parameter {name!r} is {p.dtype}; the simulator takes {_DTYPES}")
            if not p.requires_grad:
                raise ValueError(f"parameter {name!r} does not require grad (frozen, or not a parameter): "
                                 f"hvd.DistributedOptimizer never reduces it, so the simulator would count "
                                 f"bytes for it and update it; pass only the parameters that are trained, "
                                 f"[(n, p) for n, p in model.named_parameters() if p.requires_grad], and "
                                 f"names=sim.names to per_worker_gradients")
        device = _check_device(device)
        self.names = [name for name, _ in pairs]
        self.params = [p for _, p in pairs]
        self.specs = [TensorSpec(i, name, tuple(p.shape), p.numel(), p.dtype)
                      for i, (name, p) in enumerate(pairs)]
        if not isinstance(diagnostics, bool):
            raise TypeError(f"diagnostics must be True or False, got {diagnostics!r}")
        self.n = n_workers
        self.scheme = scheme
        self.device = device
        scheme.diagnose = diagnostics
        scheme.bind(self.specs, n_workers, [p.detach().to(device) if device else p.detach()
                                            for p in self.params])
        self.step_count = 0
        self.history = []

    @property
    def kind(self):
        return self.scheme.kind

    def worker_params(self):
        """Per parameter, ``(n, *shape)``: the weights at which each worker takes its gradient.

        The same weights on every worker for gradient schemes (an expanded view of the caller's
        parameters, no copy); each worker's local model for local-SGD schemes.
        """
        if self.scheme.kind == "model":
            return self.scheme.worker_params()
        return [p.detach().unsqueeze(0).expand(self.n, *p.shape) for p in self.params]

    def step(self, grads_per_worker):
        """One step from ``n`` lists of gradients (one tensor or ``None`` per parameter, in order).

        ``None`` counts as zeros, as Horovod's ``DistributedOptimizer`` reduces zeros for a parameter
        without a gradient; not with a local optimizer's momentum (``QsparseLocalSGD``), which would
        skip that parameter on Horovod and move it here (a ValueError)."""
        if len(grads_per_worker) != self.n:
            raise ValueError(f"expected gradients of {self.n} workers, got {len(grads_per_worker)}")
        skips_missing = self.scheme.kind == "model" and getattr(self.scheme, "momentum", 0.0) != 0.0
        stacked = []
        for j, spec in enumerate(self.specs):
            rows = []
            for i, grads in enumerate(grads_per_worker):
                if len(grads) != len(self.specs):
                    raise ValueError(f"worker {i} gave {len(grads)} gradients for "
                                     f"{len(self.specs)} parameters")
                g = grads[j]
                if g is None:
                    if skips_missing:
                        raise ValueError(f"worker {i} gave no gradient of {spec.name!r}: a local optimizer "
                                         f"with momentum skips such a parameter on Horovod, which a zero "
                                         f"gradient does not model; give every parameter a gradient")
                    g = torch.zeros(spec.shape, dtype=spec.dtype, device=self._device_of(grads))
                elif not isinstance(g, torch.Tensor):
                    raise TypeError(f"gradient of {spec.name!r} from worker {i} must be a tensor or None, "
                                    f"got {type(g).__name__}")
                elif tuple(g.shape) != spec.shape:
                    raise ValueError(f"gradient of {spec.name!r} from worker {i} has shape {tuple(g.shape)}, "
                                     f"expected {spec.shape}")
                else:
                    _check_gradient_dtype(spec, g, f" from worker {i}")
                rows.append(g.detach())
            stacked.append(torch.stack(rows))
        return self.step_stacked(stacked)

    def step_stacked(self, grads):
        """One step from one ``(n, *shape)`` tensor per parameter (row i: worker i's gradient)."""
        if len(grads) != len(self.specs):
            raise ValueError(f"expected {len(self.specs)} stacked gradients, got {len(grads)}")
        flat = []
        for spec, g in zip(self.specs, grads):
            if not isinstance(g, torch.Tensor):
                raise TypeError(f"gradient of {spec.name!r} must be a tensor, got {type(g).__name__}")
            if tuple(g.shape) != (self.n, *spec.shape):
                raise ValueError(f"gradient of {spec.name!r} has shape {tuple(g.shape)}, expected "
                                 f"{(self.n, *spec.shape)}")
            _check_gradient_dtype(spec, g)
            flat.append(g.detach().reshape(self.n, spec.numel))
        with torch.no_grad():
            updates, record, diagnostics = self.scheme.step(flat, self.step_count)
        update = [u.view(spec.shape) for u, spec in zip(updates, self.specs)]
        entry = record.as_dict()
        entry.update({k: v for k, v in diagnostics.items() if isinstance(v, (int, float, bool))})
        self.history.append(entry)
        self.step_count += 1
        model = None
        if self.scheme.kind == "model":  # (a copy: the scheme's x_last changes at later steps)
            model = [shared.clone() for shared in self.scheme.shared_params()]
        return StepResult(update, record, diagnostics, self.scheme.kind, model, list(self.names))

    def totals(self):
        """Byte counts summed over all steps so far (per worker), and the overall ``ratio``."""
        out = {key: sum(h[key] for h in self.history) for key in _SUMMED}
        out["steps"] = len(self.history)
        out["ratio"] = out["uncompressed_sent_bytes"] / out["sent_bytes"] if out["sent_bytes"] else 1.0
        return out

    def state_dict(self):
        """Everything needed to continue: step counter, history, and the scheme's per-worker state."""
        return {"step": self.step_count, "n": self.n, "names": list(self.names),
                "history": [dict(h) for h in self.history], "scheme": self.scheme.state_dict()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict`'s output; checks everything before changing anything."""
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict returned by Simulator.state_dict(), got "
                             f"{type(state).__name__}")
        if state.get("n") != self.n or state.get("names") != self.names:
            raise ValueError("state was saved for other workers or parameters")
        step = check_int(state.get("step"), "state step", 0)
        history = state.get("history")
        if not (isinstance(history, list) and all(isinstance(h, dict) for h in history)):
            raise TypeError(f"state history must be a list of dicts, got {type(history).__name__}")
        for i, h in enumerate(history):
            bad = [key for key in _SUMMED if not isinstance(h.get(key), numbers.Real) or isinstance(h[key], bool)]
            if bad:
                raise ValueError(f"state history entry {i} lacks numbers for {', '.join(bad)}")
        self.scheme.load_state_dict(state.get("scheme"))
        self.step_count = step
        self.history = [dict(h) for h in history]

    def _device_of(self, grads):
        for g in grads:
            if g is not None:
                return g.device
        return self.device
