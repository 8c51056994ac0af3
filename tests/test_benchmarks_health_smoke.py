"""benchmarks.health_fallback in its --smoke mode (n = 4, 8 steps), its plan, and its scheme keys."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_runs_dense_scalecom_with_checks_and_a_fallback(tmp_path):
    out = tmp_path / "health.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.health_fallback", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from benchmarks.convergence import SMOKE_RECIPE
    from benchmarks.convergence_schemes import scalecom_bytes
    from benchmarks.convergence_tasks import TASKS
    from benchmarks.health_fallback import PLAIN
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["task"], r["scheme"] == "dense") for r in runs) == sorted(
        [(t, d) for t in ("digits", "charlm") for d in (True, False, False)])
    for task in ("digits", "charlm"):
        plain = next(r for r in runs if r["task"] == task and r["scheme"] == PLAIN)
        fallback = next(r for r in runs if r["task"] == task and "fallback" in r["scheme"])
        summary = plain["health"]["summary"]
        # one check (the first compressed step) of each of the 3 compressed tensors, nothing dense
        assert (summary["checks"], summary["dense_steps"]) == (3, 0) and len(summary["by_tensor"]) == 3
        assert 0 < summary["captured"] <= 1 and 0 <= summary["overlap"] <= 1
        checked = [c for c in plain["health"]["captured"] if c is not None]
        assert len(checked) == 1 and plain["health"]["captured"][SMOKE_RECIPE.compression_warmup] == checked[0]
        # without the checks, the bytes of plain ScaleCom; the check step adds a dense p
        expected = scalecom_bytes(SMOKE_RECIPE, 4, TASKS[task]().model(0))
        assert plain["health"]["plain_bytes_per_step"] == pytest.approx(expected)
        assert plain["bytes_per_step"] > expected
        # the fallback's one check (step 2, the same as plain ScaleCom's) decides with patience 1: each
        # tensor below min_captured is sent densely at the 5 steps after it
        from benchmarks.convergence_schemes import scalecom_options
        options = scalecom_options(fallback["scheme"])
        assert options["patience"] == 1 and options["check_every"] > SMOKE_RECIPE.steps
        low = sum(t["captured"] < options["min_captured"] for t in summary["by_tensor"].values())
        assert fallback["health"]["summary"]["dense_steps"] == 5 * low
        assert fallback["health"]["dense_tensors"][SMOKE_RECIPE.compression_warmup] == low
    assert "| ScaleCom | " in proc.stdout and "without checks" in proc.stdout


def test_plan_puts_the_criteria_first_and_five_seeds_at_64():
    from benchmarks.health_fallback import FALLBACKS, PLAIN, plan
    runs = plan(["main", "long"], FALLBACKS)
    assert len({r.key for r in runs}) == len(runs)
    first = runs[:5 * 2 * 3]  # dense, plain ScaleCom and the first fallback setting
    assert {(r.n, r.length) for r in first} == {(64, 1)} and {r.seed for r in first} == set(range(5))
    for task in ("digits", "charlm"):
        for scheme in ("dense", PLAIN, *[f"scalecom:{f}" for f in FALLBACKS]):
            assert sorted(r.seed for r in runs if (r.task, r.scheme, r.n, r.length) == (task, scheme, 64, 1)) \
                == list(range(5))
    assert {r.scheme for r in runs if r.length == 3} == {"dense", PLAIN, f"scalecom:{FALLBACKS[0]}", "global_topk"}


def test_scheme_keys_build_scalecom_with_the_options_and_refuse_unknown_ones():
    from benchmarks.convergence import RECIPES
    from benchmarks.convergence_schemes import build
    key = "scalecom:check_every=16,fallback=dense,min_captured=0.3,patience=1,ratio=0.1"
    scheme = build(key, RECIPES["digits"], 64)
    assert (scheme.health.check_every, scheme.health.fallback, scheme.health.min_captured) == (16, "dense", 0.3)
    assert (scheme.health.patience, scheme.config.ratio, scheme.beta) == (1, 0.1, 0.1)
    with pytest.raises(ValueError, match="check_evry"):
        build("scalecom:check_evry=16", RECIPES["digits"], 64)
    with pytest.raises(ValueError, match="fallback"):
        build("scalecom:fallback=dense", RECIPES["digits"], 64)  # (needs check_every)
