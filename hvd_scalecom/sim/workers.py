"""Every simulated worker's gradient in one vectorised call, for training loops that drive the simulator."""

import torch
from torch.func import functional_call, grad, vmap


def per_worker_gradients(model, loss_fn, worker_params, inputs, targets, names=None):
    """Per parameter, the ``(n, *shape)`` gradients of ``n`` workers, each on its own batch.

    worker_params: ``Simulator.worker_params()`` (one ``(n, *shape)`` tensor per parameter).
    inputs, targets: ``(n, batch, ...)``, worker i's batch in row i.
    loss_fn: ``loss_fn(model_output, targets) -> scalar``.
    names: the model's parameters that ``worker_params`` hold, in order (``Simulator.names``); default:
        all of ``model.named_parameters()``. Parameters left out (say, frozen layers the Simulator was
        not given) keep the model's own values and get no gradient. ValueError where the count or a
        shape does not match, or where ``inputs`` or ``targets`` do not hold n batches.
    Buffers are shared by all workers and read only (batch norm in training mode is refused: call
    ``model.eval()``); dropout draws each worker's own mask from torch's global generator.
    """
    if model.training and any(isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
                              for m in model.modules()):
        raise ValueError("per_worker_gradients: the model's batch norm layers update their running "
                         "statistics in training mode, which the workers cannot share; call model.eval()")
    own = dict(model.named_parameters())
    names = list(own) if names is None else list(names)
    worker_params = list(worker_params)
    if len(worker_params) != len(names):
        raise ValueError(f"per_worker_gradients: {len(worker_params)} worker_params for {len(names)} parameters "
                         f"(a Simulator given only some of the model's parameters: pass names=sim.names)")
    for name, stacked in zip(names, worker_params):
        if name not in own:
            raise ValueError(f"per_worker_gradients: names holds {name!r}, which is not a parameter of the model")
        if not isinstance(stacked, torch.Tensor) or stacked.dim() < 1:
            raise TypeError(f"per_worker_gradients: worker_params of {name!r} must be a tensor of (n, *shape), "
                            f"got {type(stacked).__name__}"
                            f"{f' of shape {tuple(stacked.shape)}' if isinstance(stacked, torch.Tensor) else ''}")
        if tuple(stacked.shape[1:]) != tuple(own[name].shape):
            raise ValueError(f"per_worker_gradients: worker_params of {name!r} have shape {tuple(stacked.shape)}, "
                             f"the parameter {tuple(own[name].shape)} (expected (n, *shape), in the order of names)")
    n = {int(stacked.shape[0]) for stacked in worker_params}
    if len(n) > 1:
        raise ValueError(f"per_worker_gradients: worker_params hold {sorted(n)} workers, one number for every "
                         f"parameter expected (Simulator.worker_params())")
    for label, batches in (("inputs", inputs), ("targets", targets)):
        if not isinstance(batches, torch.Tensor) or batches.dim() < 1 or int(batches.shape[0]) not in n:
            shape = tuple(batches.shape) if isinstance(batches, torch.Tensor) else type(batches).__name__
            raise ValueError(f"per_worker_gradients: {label} must be a tensor of (n, batch, ...) with n = "
                             f"{sorted(n)[0] if n else 0}, worker_params' first dimension, got {shape}")
    buffers = dict(model.named_buffers())

    def loss_of(params, x, y):
        state = dict(zip(names, params))
        state.update(buffers)
        return loss_fn(functional_call(model, state, (x,)), y)

    with torch.enable_grad():
        per_worker = vmap(grad(loss_of), in_dims=(0, 0, 0), randomness="different")
        grads = per_worker(tuple(worker_params), inputs, targets)
    return list(grads)
