"""stats() to TensorBoard: tags and values written are the ones read back."""

import numpy as np
import pytest
import torch

from hvd_scalecom.monitor import stats_scalars


def sample_stats():
    return {"step": 4, "index_bytes": 400, "value_bytes": 400, "dense_bytes": 296, "sent_bytes": 1096,
            "uncompressed_bytes": 15144, "ratio": 15144 / 1096, "compress_seconds": 0.002,
            "index_wait_seconds": 0.0005, "tensors": 4, "nonfinite_skips": 1,
            "total": {"ratio": 9.5}}


def test_stats_scalars():
    s = stats_scalars(sample_stats())
    assert s["scalecom/sent_bytes"] == 1096.0
    assert s["scalecom/ratio"] == pytest.approx(15144 / 1096)
    assert s["scalecom/compress_ms"] == pytest.approx(2.0)
    assert s["scalecom/index_wait_ms"] == pytest.approx(0.5)
    assert s["scalecom/ratio_over_run"] == 9.5
    assert s["scalecom/nonfinite_skips"] == 1.0
    assert "scalecom/step" not in s and "scalecom/tensors" not in s
    assert not any("health" in tag for tag in s)


def test_stats_scalars_of_the_health_check():
    health = {"checks": 6, "dense_steps": 2, "dense_tensors": 1, "overlap": 0.25, "captured": 0.5,
              "selected_share": 0.2, "topk_share": 0.4, "by_tensor": {"w": {"overlap": 0.25}}}
    s = stats_scalars({**sample_stats(), "health": health})
    assert s["scalecom/health_overlap"] == 0.25 and s["scalecom/health_captured"] == 0.5
    assert s["scalecom/health_selected_share"] == 0.2 and s["scalecom/health_topk_share"] == 0.4
    assert s["scalecom/health_dense_tensors"] == 1.0 and s["scalecom/health_checks"] == 6.0
    assert not any("by_tensor" in tag or tag.endswith("dense_steps") for tag in s)


def test_log_stats_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    from hvd_scalecom.torch import log_stats

    class Fixed:
        def stats(self):
            return sample_stats()

    writer = SummaryWriter(str(tmp_path))
    log_stats(writer, Fixed(), 7)
    writer.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    [point] = events.Scalars("scalecom/value_bytes")
    assert (point.step, point.value) == (7, 400.0)
    assert set(stats_scalars(sample_stats())) <= set(events.Tags()["scalars"])


def test_residue_norm_of_torch_scalecom():
    from hvd_scalecom.monitor import residue_norm
    from hvd_scalecom.torch import ScaleCom

    model = torch.nn.Sequential(torch.nn.Linear(40, 50), torch.nn.Linear(50, 3))
    compression = ScaleCom(model.named_parameters(), ratio=0.1, min_numel=100)
    assert residue_norm(compression) == 0.0  # no memory before the first compressed step
    state = compression.state_dict()
    gen = torch.Generator().manual_seed(3)
    memories = {"0.weight": torch.randn(2000, generator=gen), "1.weight": torch.randn(150, generator=gen)}
    for name, memory in memories.items():
        state["params"][name]["memory"] = memory
    compression.load_state_dict(state)
    expected = np.sqrt(sum(np.sum(m.numpy().astype(np.float64) ** 2) for m in memories.values()))
    assert residue_norm(compression) == pytest.approx(expected, rel=1e-12)
    # With a loss_scaler the memories are kept in the scale's units: the norm is of unscaled ones.
    scaled = ScaleCom(model.named_parameters(), ratio=0.1, min_numel=100, loss_scaler=torch.amp.GradScaler("cpu"))
    for name, memory in memories.items():
        state["params"][name].update(memory=memory * 1024, scale=1024.0)
    scaled.load_state_dict(state)
    assert scaled.state_dict()["params"]["0.weight"]["scale"] == 1024.0
    assert residue_norm(scaled) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(TypeError, match="compression"):
        residue_norm(object())
    from hvd_scalecom.torch import SketchedSGD  # its state holds momentum and error, no memory

    with pytest.raises(TypeError, match="compression must be a ScaleCom .* got SketchedSGD"):
        residue_norm(SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=100))
