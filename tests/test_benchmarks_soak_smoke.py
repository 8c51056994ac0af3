"""The soak benchmark in its --smoke mode (-np 2, 20 steps) and the benchmark runner's --list: nothing
may rot. The soak's figures are checked against the records they come from, recomputed here."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


def run_module(*args, timeout=600):
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def expected_sent_bytes(ratio=0.01, min_numel=1024):
    """Payload of one compressed step of the examples' MLP: k int32 indices and k fp32 values per
    large tensor, small tensors dense."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from pytorch_scalecom import make_model

    sent = 0
    for p in make_model().parameters():
        n = p.numel()
        sent += 8 * math.ceil(ratio * n) if n >= min_numel else 4 * n
    return sent, 4 * sum(p.numel() for p in make_model().parameters())


def test_soak_smoke(tmp_path):
    out = run_module("benchmarks.soak", "--smoke", "--out-dir", str(tmp_path))
    assert "soak: RSS" in out
    result = json.loads((tmp_path / "soak.json").read_text())
    assert (result["np"], result["steps"], result["every"], result["warmup"]) == (2, 20, 5, 2)
    assert result["command"] == "python -m benchmarks.soak --smoke"
    assert all(isinstance(result[k], bool) for k in ("rss_flat", "residue_bounded", "trained"))
    assert result["options"]["lr"] == 0.0125 and result["options"]["beta"] == 0.5
    assert len(result["records"]) == len(result["ranks"]) == 2
    sent, dense = expected_sent_bytes()
    for records, summary in zip(result["records"], result["ranks"]):
        steps = [r["step"] for r in records]
        assert steps == [0, 5, 10, 15, 20]
        rss = np.array([r["rss_bytes"] for r in records]) / MB
        assert ((rss > 50) & (rss < 16_000)).all()
        # figures against the records: RSS after warm-up is the record at step 5
        assert summary["warm_step"] == 5
        assert summary["rss_warm_mb"] == pytest.approx(rss[1])
        assert summary["rss_end_mb"] == pytest.approx(rss[-1])
        assert summary["rss_growth_mb"] == pytest.approx(rss[-1] - rss[1])
        assert summary["rss_growth_pct"] == pytest.approx(100 * (rss[-1] - rss[1]) / rss[1])
        x, y = np.array(steps[2:], dtype=float), rss[2:]  # second half: steps 10, 15, 20
        slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
        assert summary["rss_slope_mb_per_1000_steps"] == pytest.approx(1000 * slope, abs=1e-9)
        norms = [r["residue_norm"] for r in records]
        assert norms[0] == 0.0 and all(0 < v < 1e3 for v in norms[1:])
        assert summary["residue_norm_max"] == pytest.approx(max(norms))
        assert summary["residue_norm_final"] == pytest.approx(norms[-1])
        assert summary["residue_norm_quarter_ratio"] == pytest.approx(norms[4] / norms[3])
        losses = [r["loss"] for r in records[1:]]
        assert all(0 < v < 5 for v in losses) and losses[-1] < math.log(10)
        for r in records[1:]:
            assert r["stats"]["sent_bytes"] == sent and r["stats"]["uncompressed_bytes"] == dense
            assert r["stats"]["step"] == r["step"] - 1 and r["python_objects"] > 1000
    text = (tmp_path / "soak.md").read_text()
    assert "`python -m benchmarks.soak --smoke`" in text and "## Verdict" in text
    assert (tmp_path / "soak.png").stat().st_size > 1000
    (tmp_path / "soak.md").unlink()
    run_module("benchmarks.soak", "--smoke", "--report-only", "--out-dir", str(tmp_path))
    assert (tmp_path / "soak.md").read_text() == text


def test_soak_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.soak", "--steps", "10", "--warmup", "10"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--warmup" in proc.stderr


def test_run_all_list():
    out = run_module("benchmarks.run_all", "--list", timeout=120)
    for name in ("kernels", "slow_link", "scalecom_options", "convergence", "soak"):
        assert f"-m benchmarks.{name}" in out
    only = run_module("benchmarks.run_all", "--list", "--only", "soak", "kernels", timeout=120)
    assert [line.split()[0] for line in only.splitlines() if line.strip()] == ["kernels", "soak"]
