"""Framework-neutral monitoring: ``stats()`` of any hvd_scalecom compressor as named scalars, for
TensorBoard (``hvd_scalecom.torch.log_stats``, ``hvd_scalecom.tensorflow.log_stats``) or any logger,
and the norm of a compressor's residue memories (for soak runs and logs)."""

import math

import numpy as np

_PER_STEP = ("sent_bytes", "index_bytes", "value_bytes", "dense_bytes", "uncompressed_bytes", "ratio")


def stats_scalars(stats, prefix="scalecom"):
    """``{tag: float}`` from a ``stats()`` dict: this step's bytes and ratio, compute and wait times in
    milliseconds, the run's overall ratio, non-finite skips where the compressor counts them, and the
    health check's figures where it runs (``stats()["health"]``)."""
    out = {f"{prefix}/{key}": float(stats[key]) for key in _PER_STEP if key in stats}
    for key in ("compress_seconds", "index_wait_seconds"):
        if key in stats:
            out[f"{prefix}/{key.replace('_seconds', '_ms')}"] = 1e3 * float(stats[key])
    total = stats.get("total") or {}
    if "ratio" in total:
        out[f"{prefix}/ratio_over_run"] = float(total["ratio"])
    if "nonfinite_skips" in stats:
        out[f"{prefix}/nonfinite_skips"] = float(stats["nonfinite_skips"])
    health = stats.get("health") or {}
    for key in ("overlap", "captured", "selected_share", "topk_share", "dense_tensors", "checks"):
        if key in health:
            out[f"{prefix}/health_{key}"] = float(health[key])
    return out


def residue_norm(compression):
    """``||m||_2`` over all residue memories of a ScaleCom (torch or TensorFlow) on this rank, from
    its ``state_dict()``, in the units of unscaled gradients (a memory kept in a ``loss_scaler``'s
    units is divided by its scale); 0.0 before the first compressed step. Call it between steps."""
    state = getattr(compression, "state_dict", None)
    if not callable(state):
        raise TypeError(f"compression must have a state_dict() (a ScaleCom), "
                        f"got {type(compression).__name__}")
    saved = state()
    if not (isinstance(saved, dict) and isinstance(saved.get("params"), dict)
            and all(isinstance(e, dict) and "memory" in e for e in saved["params"].values())):
        raise TypeError(f"compression must be a ScaleCom (its state_dict() holds params, each with "
                        f"a memory), got {type(compression).__name__}")
    total = 0.0
    for entry in saved["params"].values():
        memory = entry.get("memory")
        if memory is None:
            continue
        if hasattr(memory, "detach"):  # a torch tensor, possibly on a GPU
            memory = memory.detach().cpu()
        memory = np.asarray(memory, dtype=np.float64)
        if entry.get("scale") is not None:
            memory = memory / entry["scale"]
        total += float(np.sum(np.square(memory)))
    return math.sqrt(total)
