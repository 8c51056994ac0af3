"""The interface every simulated scheme implements, and what they share.

A scheme sees one step of all ``n`` workers at once: for every parameter an ``(n, numel)`` tensor whose
row i is worker i's flat gradient. It returns, per parameter, the flat update every worker applies,
a :class:`~hvd_scalecom.traffic.StepRecord` of the collectives it would issue, and diagnostics.
Its state (residue memories and the like) is per worker, one row each, in ``state[name][key]``.

``kind`` says what the update is:

* ``"gradient"``: the aggregated gradient, handed to the caller's optimizer (every synchronous scheme);
* ``"model"``: the change of the shared model; the scheme runs the workers' local optimizer itself,
  holds a model copy per worker (local SGD: Qsparse-local-SGD), and gives the shared model itself
  (``shared_params()``), which the caller's copy takes at every step.
"""

import dataclasses

import torch

from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.torch import clt_k
from hvd_scalecom.traffic import StepRecord

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter: its position in ``named_parameters``, name, shape, entry count and dtype."""

    index: int
    name: str
    shape: tuple
    numel: int
    dtype: torch.dtype


def mean_over_workers(values):
    """The allreduce-average of rows: summed in at least fp32, divided by n, back in the wire dtype.
    Horovod sums in the wire dtype before it divides, so a sum beyond fp16's range is Inf there: so
    is it here (the sum's rounding is otherwise modelled as one, at the end)."""
    wide = values.to(clt_k.memory_dtype(values.dtype))
    summed = wide.sum(dim=0)
    if wide.dtype != values.dtype:
        narrow = summed.to(values.dtype)
        summed = torch.where(torch.isinf(narrow), narrow.to(wide.dtype), summed)
    return (summed / values.shape[0]).to(values.dtype)


def public(diagnostics):
    """Diagnostics without the running totals schemes keep under ``_``-prefixed keys."""
    return {k: v for k, v in diagnostics.items() if not k.startswith("_")}


class Scheme:
    """Base class: per-tensor dispatch between a dense allreduce and the scheme's compression.

    ``config`` (a :class:`hvd_scalecom.config.ScaleComConfig`) supplies what all sparsifiers share:
    ``k = num_selected(numel)``, which tensors are compressed at which step (``min_numel``,
    ``warmup_steps``) and the index and value dtypes on the wire. Subclasses implement
    :meth:`compress` (and :meth:`compresses` to exclude tensors by shape), or override :meth:`step`.
    """

    name = "scheme"
    kind = "gradient"

    def __init__(self, config=None):
        self.config = config or ScaleComConfig()
        self.diagnose = True
        self.specs = None
        self.n = None
        self.state = {}

    # -- binding and per-step dispatch ----------------------------------------------------------------

    def bind(self, specs, n, params):
        """Attach to ``n`` workers of the parameters ``specs`` (initial values ``params``)."""
        self.specs = list(specs)
        self.n = int(n)
        self.state = {s.name: {} for s in self.specs}

    def compresses(self, spec):
        """Whether this scheme compresses a tensor of this shape at all (warm-up aside)."""
        return True

    def is_compressed(self, spec, t):
        return self.compresses(spec) and self.config.is_compressed(spec.numel, t)

    def step(self, grads, t):
        """One synchronous step: ``grads[j]`` is ``(n, numel_j)``; returns ``(updates, record, diagnostics)``.

        ``updates[j]`` is the flat ``(numel_j,)`` aggregated gradient every worker applies.
        """
        record = StepRecord(t, self.n)
        diagnostics = {}
        updates = []
        for spec, G in zip(self.specs, grads):
            record.baseline(spec.numel, G.dtype)
            if self.is_compressed(spec, t):
                updates.append(self.compress(spec, G, t, record, diagnostics))
            else:
                record.dense(spec.name, spec.numel, G.dtype)
                updates.append(mean_over_workers(G))  # (fp16: a sum beyond its range is Inf, as on Horovod)
        diagnostics.update(self.residue_diagnostics())
        return updates, record, public(diagnostics)

    def compress(self, spec, G, t, record, diagnostics):
        raise NotImplementedError

    # -- shared pieces ---------------------------------------------------------------------------------

    def memory(self, spec, G, key="memory"):
        """Worker rows of a residue memory ``m_i`` (zeros at first use; fp32 at least, as clt_k keeps it)."""
        entry = self.state[spec.name]
        if key not in entry:
            entry[key] = torch.zeros(self.n, spec.numel, dtype=clt_k.memory_dtype(G.dtype), device=G.device)
        return entry[key]

    def sent_dtype(self, G):
        """Dtype the selected values travel in: ``config.value_dtype`` or the gradient's."""
        return TORCH_DTYPES.get(self.config.value_dtype) or G.dtype

    def index_dtype(self, numel):
        return self.config.index_dtype_for(numel)

    def residue_keys(self):
        """State keys holding residue (error-feedback) memory, for :meth:`residue_diagnostics`."""
        return ("memory",)

    def residue_diagnostics(self):
        """``residue_norms`` (n,): each worker's ``||m_i||_2`` over all tensors; ``residue_norm``: mean."""
        squares = None
        for entry in self.state.values():
            for key in self.residue_keys():
                if key in entry:
                    s = torch.linalg.vector_norm(entry[key].reshape(self.n, -1), dim=1).double() ** 2
                    squares = s if squares is None else squares + s
        if squares is None:
            return {}
        norms = squares.sqrt()
        return {"residue_norms": norms, "residue_norm": float(norms.mean())}

    # -- state -----------------------------------------------------------------------------------------

    def describe(self):
        """Constructor arguments that define the scheme (stored with its state)."""
        return {"config": self.config.as_dict()}

    def state_dict(self):
        return {"scheme": self.name, "n": self.n, "describe": self.describe(),
                "state": {name: {k: v.detach().clone() for k, v in entry.items()}
                          for name, entry in self.state.items()},
                "extra": self.extra_state()}

    def load_state_dict(self, saved):
        """Restore :meth:`state_dict`'s output; checks everything before changing anything."""
        if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
            raise ValueError(f"scheme state must be a dict returned by {type(self).__name__}.state_dict()")
        if saved.get("scheme") != self.name:
            raise ValueError(f"state is of scheme {saved.get('scheme')!r}, this is {self.name!r}")
        if saved.get("n") != self.n:
            raise ValueError(f"state was saved for {saved.get('n')} workers, this scheme has {self.n}")
        if saved.get("describe") != self.describe():
            raise ValueError(f"state was saved with {saved.get('describe')}, this scheme has "
                             f"{self.describe()}")
        if set(saved["state"]) != set(self.state):
            raise ValueError(f"state names {sorted(saved['state'])} differ from the parameters "
                             f"{sorted(self.state)}")
        for spec in self.specs:
            entry = saved["state"][spec.name]
            if not isinstance(entry, dict):
                raise TypeError(f"state of {spec.name!r} must be a dict, got {type(entry).__name__}")
            shapes = self.state_shapes(spec)
            missing = sorted(set(self.state[spec.name]) - set(entry) - set(self.made_later()))
            if missing:
                raise ValueError(f"state of {spec.name!r} lacks {', '.join(missing)}")
            for key, value in entry.items():
                if key not in shapes:
                    raise ValueError(f"state of {spec.name!r} has {key!r}, which {self.name} does not keep "
                                     f"(it keeps {', '.join(sorted(shapes))})")
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"state {key} of {spec.name!r} must be a tensor, got {type(value).__name__}")
                if value.shape != shapes[key]:
                    raise ValueError(f"state {key} of {spec.name!r} has shape {tuple(value.shape)}, "
                                     f"expected {tuple(shapes[key])}")
                if self.state_dtype(spec, key) is not None and not value.dtype.is_floating_point:
                    raise TypeError(f"state {key} of {spec.name!r} must be a floating-point tensor, "
                                    f"got {value.dtype}")
                self.check_state(spec, key, value)
        state = {spec.name: {k: v.detach().to(self.state_dtype(spec, k) or v.dtype, copy=True,
                                              memory_format=torch.contiguous_format)  # (steps view them)
                             for k, v in saved["state"][spec.name].items()}
                 for spec in self.specs}
        self.load_extra_state(saved.get("extra", {}))  # may raise: before anything else changes
        self.state = state

    def memory_keys(self):
        """State keys of per-worker memories (one row of the parameter's size per worker), made at
        their first use by :meth:`memory`."""
        return (*self.residue_keys(), "memory", "momentum")

    def state_shapes(self, spec):
        """``{key: shape}`` of every state tensor this scheme may keep for ``spec``: by default its
        memories."""
        return {key: (self.n, spec.numel) for key in self.memory_keys()}

    def state_dtype(self, spec, key):
        """The dtype state ``key`` of ``spec`` is kept in (a saved one is cast to it), or None where
        :meth:`check_state` alone checks it (e.g. indices): by default the memories' fp32 at least."""
        return clt_k.memory_dtype(spec.dtype)

    def check_state(self, spec, key, value):
        """ValueError if ``value`` (of the right shape) cannot be state ``key`` of ``spec``."""

    def made_later(self):
        """State keys made during steps (absent from a state saved before them); the others are made
        by :meth:`bind` and every saved state holds them."""
        return self.memory_keys()

    def extra_state(self):
        return {}

    def load_extra_state(self, extra):
        pass
