"""The convergence benchmark in its --smoke mode (both tasks, dense and ScaleCom, n = 4, 8 steps),
then its --report-only mode on the JSON that wrote: nothing may rot (no result is asserted)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.convergence", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_convergence_smoke(tmp_path):
    out = run("--smoke", "--out-dir", str(tmp_path))
    assert "[4/4] charlm n=4 scalecom" in out
    results = json.loads((tmp_path / "convergence.json").read_text())
    assert {(r["task"], r["scheme"], r["n"]) for r in results["runs"]} == {
        (t, s, 4) for t in ("digits", "charlm") for s in ("dense", "scalecom")}
    for r in results["runs"]:
        assert r["steps"] == 8 and len(r["residue_norm"]) == 8
        if r["scheme"] == "scalecom":
            assert r["bytes_per_step"] < r["uncompressed_bytes_per_step"] / 10
            assert any(v is not None for v in r["overlap"])
    text = (tmp_path / "convergence.md").read_text()
    assert "| dense SGD (fp32 allreduce) | reference |" in text
    assert "`python -m benchmarks.convergence --smoke`" in text
    for png in ("digits", "charlm", "overlap", "residue_norm", "tradeoff"):
        assert (tmp_path / f"convergence_{png}.png").stat().st_size > 1000
    (tmp_path / "convergence.md").unlink()
    run("--report-only", "--out-dir", str(tmp_path))
    assert (tmp_path / "convergence.md").read_text() == text


def test_a_residue_that_overflowed_is_reported_not_finite():
    """A non-finite residue norm is kept in the JSON (None means only 'not recorded'), so the tables
    say "not finite" instead of the peak and last value before the overflow."""
    from benchmarks.convergence_report import residue_stats
    from benchmarks.convergence_schemes import _rounded

    history = [None, 1.234567, 7.26e13, float("inf"), float("nan")]
    record = json.loads(json.dumps({"residue_norm": [_rounded(v) for v in history]}))
    assert record["residue_norm"][:3] == [None, 1.2346, 7.26e13]
    assert record["residue_norm"][3] == float("inf") and record["residue_norm"][4] != record["residue_norm"][4]
    assert residue_stats(record)["bounded"] is False
    finite = residue_stats({"residue_norm": [None, 1.0, 2.0, 2.0, 4.0]})
    assert finite["bounded"] is True and (finite["max"], finite["final"], finite["growth"]) == (4.0, 4.0, 2.0)


def test_every_bytes_matched_scheme_meets_scalecoms_bytes():
    """The knobs the convergence page matches (Sketched SGD's ratio, PowerSGD's rank, Qsparse's ratio)
    give bytes near ScaleCom's at n = 4 on digits: Qsparse within 1 % (it once matched 0 bytes when
    its one-step measurement stopped synchronising)."""
    from benchmarks.convergence import RECIPES, TASKS
    from benchmarks.convergence_schemes import SCHEMES, match_knob, scalecom_bytes

    recipe, model = RECIPES["digits"], TASKS["digits"]().model(0)
    target = scalecom_bytes(recipe, 4, model)
    for spec in SCHEMES:
        if spec.matched == "bytes":
            knob, cost = match_knob(spec.key, recipe, 4, model, target)
            assert 0.5 * target < cost < 1.5 * target, (spec.key, knob, cost, target)
            if spec.key == "qsparse":
                assert 0 < knob < 1 and abs(cost - target) < 0.01 * target, (knob, cost, target)
