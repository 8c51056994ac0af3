"""Framework-neutral checks of a ``state_dict()`` before a compressor loads it, so that a bad state is
refused before anything changes (ScaleCom in both frontends, Sketched SGD)."""

import math

import numpy as np

from hvd_scalecom.config import check_int, is_real


def checked_params(state, scheme, config, names, what="parameters"):
    """``state["params"]`` after checking the layout, the configuration (``config``: this object's
    ``as_dict()``), the entry names against ``names``, and each entry's ``step`` (an int >= 0)."""
    if not isinstance(state, dict) or "params" not in state or "config" not in state:
        raise ValueError(f"state must be a dict returned by {scheme}.state_dict()")
    if state["config"] != config:
        raise ValueError(f"state was saved with config {state['config']}, this {scheme} has {config}")
    params, expected = state["params"], set(names)
    if not isinstance(params, dict):
        raise TypeError(f"state params must be a dict of the {what}' entries, got {type(params).__name__}")
    got = set(params)
    if got != expected:
        raise ValueError(f"state does not match the {what}: missing {sorted(expected - got)}, "
                         f"unexpected {sorted(got - expected)}")
    for name, entry in params.items():
        if not isinstance(entry, dict):
            raise TypeError(f"state entry of {name!r} must be a dict, got {type(entry).__name__}")
        if check_int(entry.get("step"), f"state step of {name!r}", 0) >= 2 ** 63:
            raise ValueError(f"state step of {name!r} must be below 2**63 (an int64 counter), got {entry['step']}")
    return params


def check_loss_scale(scale, what):
    """A saved loss scale: ``scale`` if a positive finite number or None; ValueError naming ``what`` else."""
    if scale is not None and not (is_real(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{what} must be a positive number or None, got {scale!r}")
    return None if scale is None else float(scale)


def check_saved_shape(name, entry, shape, what="parameter"):
    """ValueError naming ``name`` where ``entry`` (a state entry) was saved for a shape other than
    ``shape``: a memory of a transposed parameter has the same entry count. An entry saved without a
    ``shape`` (by an earlier version) loads unchecked."""
    saved = entry.get("shape")
    if saved is None:
        return
    if not (isinstance(saved, (list, tuple)) and all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
                                                     and n >= 0 for n in saved)):
        raise ValueError(f"state shape of {name!r} must be a list of sizes, got {saved!r}")
    saved = tuple(int(n) for n in saved)
    if saved != tuple(shape):
        raise ValueError(f"state of {name!r} was saved for a {what} of shape {saved}, "
                         f"this one has shape {tuple(shape)}")


def check_size(name, key, value, numel, what="parameter"):
    """ValueError unless ``value`` (a tensor or array) has ``numel`` entries."""
    shape = getattr(value, "shape", None)
    size = math.prod(shape) if shape is not None else int(np.size(value))
    if size != numel:
        raise ValueError(f"state {key} of {name!r} has {size} entries, the {what} {numel}")


def check_next_indices(name, value, k, numel, selects_ahead, entry_step=None):
    """``(step, indices)`` of a pipelined ScaleCom state entry, ``indices`` as a NumPy array of ``k``
    distinct integers in ``[0, numel)``; ValueError naming ``name`` otherwise, or where the tensor is never
    selected ahead (not ``selects_ahead``: ``pipelined=False`` or fewer than ``min_numel`` entries), or
    where ``step`` is not ``entry_step`` (the entry's step counter, if given): indices are saved for the
    step that comes next, and a rank holding some for another step would exchange fresh ones while
    the others use theirs (a hang, or different indices on different ranks)."""
    if not selects_ahead:
        raise ValueError(f"state has next_indices for {name!r}, which this ScaleCom never selects ahead "
                         f"(pipelined=False or fewer than min_numel entries)")
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"state next_indices of {name!r} must be (step, indices)")
    indices = value[1]
    if hasattr(indices, "detach") and hasattr(indices, "cpu"):  # a torch tensor, possibly on a GPU
        indices = indices.detach().cpu()
    step, indices = value[0], np.asarray(indices)
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step < 2**63:
        raise ValueError(f"state next_indices of {name!r}: step must be an int in [0, 2**63), got {step!r}")
    if (indices.shape != (k,) or indices.dtype.kind not in "iu" or not np.all((indices >= 0) & (indices < numel))
            or np.unique(indices).size != k):
        raise ValueError(f"state next_indices of {name!r} must be {k} distinct integers in [0, {numel})")
    if entry_step is not None and step != entry_step:
        raise ValueError(f"state next_indices of {name!r} are for step {step}, but its step counter is "
                         f"{entry_step}: they are saved for the next step only (was the step or the indices "
                         f"taken from another state?)")
    return int(step), indices
