"""The soak benchmark in its --smoke mode (-np 2, 20 steps; torch and TensorFlow), its verdicts on
synthetic records, and the benchmark runner's --list: nothing may rot. The soak's figures are checked
against the records they come from, recomputed here."""

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
    from benchmarks.soak import summarize_rank, verdict
    ranks = [summarize_rank(records, result["steps"], result["warmup"]) for records in result["records"]]
    assert (result["rss_flat"], result["residue_bounded"], result["trained"]) == verdict(ranks)  # from its records
    assert result["ranks"] == ranks
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


def test_soak_smoke_tensorflow(tmp_path):
    run_module("benchmarks.soak", "--smoke", "--framework", "tensorflow", "--out-dir", str(tmp_path))
    result = json.loads((tmp_path / "soak_tensorflow.json").read_text())
    assert result["framework_version"].startswith("TensorFlow") and result["np"] == 2
    sent, dense = expected_sent_bytes()  # the Keras twin has the same layers
    for records in result["records"]:
        assert [r["step"] for r in records] == [0, 5, 10, 15, 20]
        assert records[0]["residue_norm"] == 0.0 and all(0 < r["residue_norm"] < 1e3 for r in records[1:])
        for r in records[1:]:
            assert r["stats"]["sent_bytes"] == sent and r["stats"]["uncompressed_bytes"] == dense
    assert "# Soak: 20 steps of ScaleCom (TensorFlow)" in (tmp_path / "soak_tensorflow.md").read_text()


@pytest.mark.parametrize("arguments, code, message", [
    (["--steps", "10", "--warmup", "10"], 2, "--warmup"),
    # the example's options, checked before horovodrun (each rank's traceback), or refused where the
    # soak does not use them (ignored)
    (["--ratio", "0"], 2, "argument --ratio: must be a number > 0 and <= 1, got 0"),
    (["--epochs", "3"], 1, "soak: --epochs is an option of the example that the soak does not use"),
])
def test_soak_rejects_bad_arguments(arguments, code, message, request):
    got, stdout, stderr = soak_outcomes(request)[tuple(arguments)]
    assert got == code and message in stderr, stderr[-2000:]
    assert "horovodrun" not in stdout + stderr


_SOAK_OUTCOMES = {}


def soak_outcomes(request):
    """``{arguments: (exit code, stdout, stderr)}`` of ``python -m benchmarks.soak`` given each argument
    list of test_soak_rejects_bad_arguments selected in the session, all in one Python process."""
    from shared_python import each_argv

    if not _SOAK_OUTCOMES:
        lists = [item.callspec.params["arguments"] for item in request.session.items
                 if getattr(item, "originalname", None) == "test_soak_rejects_bad_arguments"]
        _SOAK_OUTCOMES.update(each_argv("-m benchmarks.soak", lists, cwd=ROOT))
    return _SOAK_OUTCOMES


def test_soak_worker_uses_the_examples_pipelined_and_lr_scaling(monkeypatch):
    """Both trainers build ScaleCom from scalecom_kwargs (the TensorFlow one ignored --pipelined), and
    the torch one scales the learning rate as the example does (it ignored --lr-scaling sqrt)."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from pytorch_scalecom import parse_args

    from benchmarks._soak_worker import learning_rate, scalecom_kwargs

    args = parse_args(["--pipelined", "--lr", "0.0125", "--lr-scaling", "sqrt"])
    assert scalecom_kwargs(args)["pipelined"] is True
    assert learning_rate(args, 4) == 0.025 and learning_rate(parse_args(["--lr", "0.0125"]), 4) == 0.05


def test_run_all_list():
    from shared_python import each_argv

    runs = each_argv("-m benchmarks.run_all", [["--list"], ["--list", "--only", "soak", "kernels"]], cwd=ROOT)
    for code, _, stderr in runs.values():
        assert code == 0, stderr
    out = runs[("--list",)][1]
    for command in ("-m benchmarks.kernels --environments default 'without AVX-512'",
                    "-m benchmarks.sketch_kernels", "-m benchmarks.per_tensor", "-m benchmarks.overhead",
                    "-m benchmarks.gpu_kernels --rounds 200",
                    "-m benchmarks.slow_link", "-m benchmarks.scale --dense",
                    "-m benchmarks.scalecom_options",
                    "-m benchmarks.convergence", "-m benchmarks.frontends --dense",
                    "-m benchmarks.tf_index_exchange", "-m benchmarks.soak --steps 6000",
                    "-m benchmarks.soak --framework tensorflow --steps 6000"):
        assert command in out, command
    only = runs[("--list", "--only", "soak", "kernels")][1]
    assert [line.split()[0] for line in only.splitlines() if line.strip()] == ["kernels", "soak"]


def synthetic_records(steps=2000, every=20, rss_mb=400.0, leak_bytes_per_step=0, norm_base=1.0,
                      norm_growth=0.0, loss_end=0.1):
    """Records as the worker writes them: RSS with a given leak, a residue norm ``5 (norm_base +
    norm_growth * step / 1000)``, a loss going from 2.3 to ``loss_end``."""
    records = []
    for step in range(0, steps + 1, every):
        records.append({
            "step": step, "seconds": step / 10, "python_objects": 1000,
            "rss_bytes": int(rss_mb * MB + leak_bytes_per_step * step),
            "residue_norm": 5.0 * (norm_base + norm_growth * step / 1000),
            "loss": None if step == 0 else 2.3 + (loss_end - 2.3) * step / steps,
            "stats": {"sent_bytes": 10, "uncompressed_bytes": 100, "total": {"ratio": 10.0}}})
    return records


def test_soak_verdict_on_synthetic_records():
    from benchmarks.soak import summarize_rank, verdict

    clean = summarize_rank(synthetic_records(), 2000, 200)
    assert clean["rss_growth_mb"] == 0 and clean["rss_slope_mb_per_1000_steps"] == pytest.approx(0, abs=1e-9)
    assert clean["residue_norm_quarter_ratio"] == pytest.approx(1.0)
    assert verdict([clean]) == (True, True, True)
    # 2 KiB per step: 2,000 KiB per 1,000 steps, 3.5 MiB from step 200 to 2,000 (under 2 % of 400 MB)
    leak = summarize_rank(synthetic_records(leak_bytes_per_step=2048), 2000, 200)
    assert leak["rss_slope_mb_per_1000_steps"] == pytest.approx(2048 * 1000 / MB)
    assert leak["rss_growth_mb"] == pytest.approx(2048 * 1800 / MB)
    assert verdict([clean, leak]) == (False, True, True)
    # residue norms growing linearly: quarter means over steps 1520..2000 and 1020..1500
    for base, growth, bounded in ((1.0, 0.1, True), (1.0, 1.0, False), (0.0, 1.0, False)):
        summary = summarize_rank(synthetic_records(norm_base=base, norm_growth=growth), 2000, 200)
        last = np.mean([base + growth * s / 1000 for s in range(1520, 2001, 20)])
        prev = np.mean([base + growth * s / 1000 for s in range(1020, 1501, 20)])
        assert summary["residue_norm_quarter_ratio"] == pytest.approx(last / prev)
        assert verdict([summary])[1] is bounded
    assert verdict([summarize_rank(synthetic_records(loss_end=3.0), 2000, 200)])[2] is False
