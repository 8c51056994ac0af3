"""Framework-neutral checks of a ``state_dict()`` before a compressor loads it, so that a bad state is
refused before anything changes (ScaleCom in both frontends, Sketched SGD)."""

import math
import numbers

import numpy as np


def checked_params(state, scheme, config, names, what="parameters"):
    """``state["params"]`` after checking the layout, the configuration (``config``: this object's
    ``as_dict()``), the entry names against ``names``, and each entry's ``step`` (an int >= 0)."""
    if not isinstance(state, dict) or "params" not in state or "config" not in state:
        raise ValueError(f"state must be a dict returned by {scheme}.state_dict()")
    if state["config"] != config:
        raise ValueError(f"state was saved with config {state['config']}, this {scheme} has {config}")
    params, expected = state["params"], set(names)
    got = set(params) if isinstance(params, dict) else set()
    if not isinstance(params, dict) or got != expected:
        raise ValueError(f"state does not match the {what}: missing {sorted(expected - got)}, "
                         f"unexpected {sorted(got - expected)}")
    for name, entry in params.items():
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state step of {name!r} must be an int >= 0, got {step!r}")
    return params


def check_size(name, key, value, numel, what="parameter"):
    """ValueError unless ``value`` (a tensor or array) has ``numel`` entries."""
    shape = getattr(value, "shape", None)
    size = math.prod(shape) if shape is not None else int(np.size(value))
    if size != numel:
        raise ValueError(f"state {key} of {name!r} has {size} entries, the {what} {numel}")
