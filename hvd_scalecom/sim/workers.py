"""Every simulated worker's gradient in one vectorised call, for training loops that drive the simulator."""

import torch
from torch.func import functional_call, grad, vmap


def per_worker_gradients(model, loss_fn, worker_params, inputs, targets):
    """Per parameter, the ``(n, *shape)`` gradients of ``n`` workers, each on its own batch.

    worker_params: ``Simulator.worker_params()`` (one ``(n, *shape)`` tensor per parameter, in
        ``model.named_parameters()`` order).
    inputs, targets: ``(n, batch, ...)``, worker i's batch in row i.
    loss_fn: ``loss_fn(model_output, targets) -> scalar``.
    Buffers are the model's own, shared by all workers and read only: a model that updates them in
    its forward pass (batch norm in training mode) is refused; call ``model.eval()`` first.
    """
    if model.training and any(isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats
                              for m in model.modules()):
        raise ValueError("per_worker_gradients: the model's batch norm layers update their running "
                         "statistics in training mode, which the workers cannot share; call model.eval()")
    names = [name for name, _ in model.named_parameters()]
    buffers = dict(model.named_buffers())

    def loss_of(params, x, y):
        state = dict(zip(names, params))
        state.update(buffers)
        return loss_fn(functional_call(model, state, (x,)), y)

    with torch.enable_grad():
        grads = vmap(grad(loss_of), in_dims=(0, 0, 0))(tuple(worker_params), inputs, targets)
    return list(grads)
