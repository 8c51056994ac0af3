"""Residue state kept in the units of loss-scaled gradients (``torch.amp.GradScaler``): checking the
scaler, rescaling when its scale changes, and restoring a saved state into another scale."""


def check_loss_scaler(loss_scaler):
    """``loss_scaler`` if None or has ``get_scale()`` (``torch.amp.GradScaler``); TypeError naming it else."""
    if loss_scaler is not None and (isinstance(loss_scaler, type)
                                    or not callable(getattr(loss_scaler, "get_scale", None))):
        raise TypeError(f"loss_scaler must be an object with a get_scale() method (a torch.amp.GradScaler), "
                        f"got {loss_scaler.__name__ if isinstance(loss_scaler, type) else type(loss_scaler).__name__}"
                        f"{' (a class: pass an instance)' if isinstance(loss_scaler, type) else ''}")
    return loss_scaler


def follow_loss_scale(buffers, scale, loss_scaler):
    """The loss scale ``buffers`` (state kept in the units of the scaled gradients, None entries
    skipped) are in once rescaled from ``scale`` to ``loss_scaler``'s current one (None without one)."""
    if loss_scaler is None:
        return None
    current = float(loss_scaler.get_scale())
    if scale is not None and current != scale:
        for buffer in buffers:
            if buffer is not None:
                buffer.mul_(current / scale)
    return current


def restored_loss_scale(buffers, saved, loss_scaler):
    """The loss scale restored ``buffers`` (saved in loss scale ``saved``, None: unscaled) are in: without
    a ``loss_scaler`` they are divided by ``saved`` (None); with one, unscaled ones count as scale 1 and
    are rescaled at the next step by :func:`follow_loss_scale`."""
    buffers = [b for b in buffers if b is not None]
    if loss_scaler is None and saved is not None:
        for buffer in buffers:
            buffer.div_(saved)
        return None
    if loss_scaler is not None and saved is None and buffers:
        return 1.0
    return saved
