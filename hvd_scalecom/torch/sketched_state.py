"""Sketched SGD's saved state (``SketchedSGD.state_dict()``): per parameter name its step counter,
shape, momentum ``u`` and (sketched tensors) error accumulation ``v``; and the checks a saved state
passes before :meth:`SketchedSGD.load_state_dict` changes anything."""

import torch

from hvd_scalecom.state_checks import check_loss_scale, checked_params
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.loss_scale import restored_loss_scale
from hvd_scalecom.torch.saved_state import as_memory_of, check_state_entry


def saved_params(names, params, offset, steps, u, v, dense_u):
    """``{name: entry}`` of the state: ``u`` and ``v`` (the sketched vector, None before the first step)
    cut into the sketched parameters' slices (``offset``: parameter index -> start), ``dense_u`` the
    other parameters' momenta by index."""
    saved = {}
    for i, name in enumerate(names):
        entry = {"step": steps[i], "shape": list(params[i].shape), "momentum": None}
        if i in offset:
            entry["error"] = None
            if u is not None:
                part = slice(offset[i], offset[i] + params[i].numel())
                entry["momentum"] = u[part].clone()
                entry["error"] = v[part].clone()
        elif i in dense_u:
            entry["momentum"] = dense_u[i].clone()
        saved[name] = entry
    return saved


def restored_state(state, config, names, params, sketched, dtype, loss_scaler):
    """What ``state`` restores, checked whole first: ``(steps, dense_u, u, v, scale)``. ``sketched``: the
    indices of the sketched parameters, in the vector's order; ``dtype``: the vector's."""
    saved = checked_params(state, "SketchedSGD", config.as_dict(), names)
    scale = check_loss_scale(state.get("scale"), "state scale")
    is_sketched = set(sketched)
    for i, name in enumerate(names):
        check_state_entry(name, saved[name], params[i].shape,
                          ("momentum", "error") if i in is_sketched else ("momentum",), step=False,
                          dtype=dtype if i in is_sketched else clt_k.memory_dtype(params[i].dtype))
    sketched_state = [saved[names[i]].get("momentum") is not None for i in sketched]
    if any(sketched_state) and not all(sketched_state):
        raise ValueError("state holds the momentum of some sketched tensors but not of others")
    for i, name in enumerate(names):
        entry = saved[name]
        if i in is_sketched and (entry.get("momentum") is None) != (entry.get("error") is None):
            raise ValueError(f"state of {name!r} has momentum or error but not both")
    sketched_steps = {names[i]: int(saved[names[i]]["step"]) for i in sketched}
    if len(set(sketched_steps.values())) > 1:  # (they move in lockstep: one sketch a step)
        raise ValueError(f"state steps of the sketched tensors differ, {sketched_steps}: they are reduced "
                         f"together every step, so a state saves one step for all of them (were "
                         f"entries taken from states of different steps?)")
    steps = [int(saved[name]["step"]) for name in names]
    # every tensor as the first step makes it: fp32 at least, on the parameter's device
    dense_u = {i: as_memory_of(saved[n]["momentum"], params[i]) for i, n in enumerate(names)
               if i not in is_sketched and saved[n].get("momentum") is not None}
    u = v = None
    if sketched and all(sketched_state):
        device = params[sketched[0]].device
        entries = [saved[names[i]] for i in sketched]
        u = torch.cat([e["momentum"].reshape(-1).to(dtype) for e in entries]).to(device)
        v = torch.cat([e["error"].reshape(-1).to(dtype) for e in entries]).to(device)
    scale = restored_loss_scale([u, v, *dense_u.values()], scale, loss_scaler)
    return steps, dense_u, u, v, scale
