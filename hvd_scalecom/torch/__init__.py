"""PyTorch frontend: ``from hvd_scalecom.torch import ScaleCom``.

The compressor (and so Horovod) is imported on first use, so that the equations in
:mod:`hvd_scalecom.torch.clt_k` serve the simulator without Horovod.

Elastic Horovod: :mod:`hvd_scalecom.torch.elastic`, imported with ScaleCom, registers the state
handler that lets ``hvd.elastic.TorchState(..., compression=scalecom)`` carry ScaleCom's step
counters and residue memories across membership changes.
"""

__all__ = ["ScaleCom", "SketchedSGD", "QsparseLocalSGD", "log_stats", "elastic"]


def log_stats(writer, compression, step):
    """Write ``compression.stats()`` to a ``torch.utils.tensorboard.SummaryWriter`` (or anything with
    ``add_scalar(tag, value, step)``) as ``scalecom/...`` scalars."""
    from hvd_scalecom.monitor import stats_scalars
    for tag, value in stats_scalars(compression.stats()).items():
        writer.add_scalar(tag, value, step)


def __getattr__(name):
    if name == "ScaleCom":
        from hvd_scalecom.torch.scalecom import ScaleCom
        return ScaleCom
    if name == "SketchedSGD":
        from hvd_scalecom.torch.sketched_sgd import SketchedSGD
        return SketchedSGD
    if name == "QsparseLocalSGD":
        from hvd_scalecom.torch.qsparse_local_sgd import QsparseLocalSGD
        return QsparseLocalSGD
    if name == "elastic":
        import importlib
        return importlib.import_module("hvd_scalecom.torch.elastic")
    raise AttributeError(f"module 'hvd_scalecom.torch' has no attribute {name!r}")
