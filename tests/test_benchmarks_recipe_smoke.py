"""benchmarks.recipe in its --smoke mode (2 workers, 1 epoch), its refusals of bad settings, and the
knobs it sweeps in benchmarks.convergence_horovod.replay (learning-rate scaling, ScaleCom's dense
warm-up, a learning-rate warm-up) checked on the replay's own per-step trace."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recipe(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "benchmarks.recipe", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def mlp_bytes(ratio=0.01, min_numel=1024):
    """Bytes per step of the examples' MLP: compressed (k int32 indices and k fp32 values per large
    tensor, small tensors dense) and dense."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from pytorch_scalecom import make_model
    sizes = [p.numel() for p in make_model().parameters()]
    return sum(8 * math.ceil(ratio * n) if n >= min_numel else 4 * n for n in sizes), 4 * sum(sizes)


def test_smoke_runs_scalecom_and_dense_and_summarises_them():
    proc = recipe("--smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["compression"] for r in lines] == ["scalecom", "dense"]
    steps = 1437 // 2 // 16  # training images // workers // batch, 1 epoch
    sent, dense = mlp_bytes()
    for r in lines:
        assert (r["workers"], r["seed"], r["epochs"], r["batch"], r["steps"]) == (2, 0, 1, 16, steps)
        assert 0.1 < r["accuracy"] <= 1 and math.isfinite(r["loss"]) and not r["diverged"], r
        assert r["peak_lr"] == pytest.approx(0.0125 * 2)
    assert lines[0]["payload_bytes_total"] == steps * sent
    assert lines[1]["payload_bytes_total"] == steps * dense
    table = proc.stdout[proc.stdout.index("| workers |"):].splitlines()
    assert table[0] == "| workers | compression | seed 0 | mean |"
    for r, row in zip(lines, table[2:]):
        a = f"{100 * r['accuracy']:.1f}"
        assert row == f"| 2 | {r['compression']} | {a} | {a} |"


@pytest.mark.parametrize("args, message", [
    (["--set", "lr=0"], "argument --set: lr: must be a finite number > 0, got 0"),
    (["--grid", "beta=0.5,2"], "argument --grid: beta: must be a finite number > 0 and <= 1, got 2"),
    (["--set", "lr_scaling=log"], "argument --set: lr_scaling: must be one of linear, sqrt"),
    (["--set", "batches=16"], "argument --set: 'batches=16': expected KEY=VALUE"),
    (["--workers", "0"], "argument --workers: must be an integer >= 1, got 0"),
    (["--set", "lr=0.1", "--grid", "lr=0.1,0.2"], "--set/--grid: lr given more than once"),
    (["--see", "1"], "unrecognized arguments: --see"),
])
def test_bad_settings_are_refused_naming_the_option(args, message, capsys):
    from benchmarks.recipe import parse_args
    with pytest.raises(SystemExit) as exit_:
        parse_args(args)
    stderr = capsys.readouterr().err
    assert exit_.value.code == 2 and message in stderr, stderr


def test_defaults_are_the_examples(monkeypatch):
    from benchmarks.recipe import DEFAULTS
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from pytorch_scalecom import parse_args
    args = parse_args([])
    assert DEFAULTS == {"ratio": args.ratio, "beta": args.beta, "warmup_steps": args.warmup_steps, "lr": args.lr,
                        "lr_scaling": args.lr_scaling, "lr_warmup": 0, "batch": args.batch_size,
                        "epochs": args.epochs, "momentum": args.momentum}


def test_replay_knobs_show_in_its_trace():
    """sqrt scaling sets the peak rate; ScaleCom's residue memory stays empty through its dense
    warm-up and fills from the first compressed step; a learning-rate warm-up of W steps takes its
    first step at lr / W (the loss before the second step is that of a run at lr / W)."""
    from benchmarks.convergence_horovod import replay
    torch.set_num_threads(1)
    run = replay("scalecom", 4, 1, 0.01, 0.5, batch=16, lr=0.0125, lr_scaling="sqrt", warmup_steps=5, trace=True)
    assert run["peak_lr"] == pytest.approx(0.0125 * 2)
    trace = run["trace"]
    assert [s["step"] for s in trace] == list(range(1437 // 4 // 16))
    assert all(s["memory_norm"] == 0 for s in trace[:5]) and all(s["memory_norm"] > 0 for s in trace[5:])
    dense = replay("dense", 4, 1, 0.01, 0.5, batch=16, lr=0.0125, trace=True)["trace"]
    assert all(s["memory_norm"] == 0 for s in dense) and trace[0]["update_norm"] == pytest.approx(
        dense[0]["update_norm"], rel=1e-5)  # the same first step while ScaleCom runs dense
    assert trace[0]["loss"] == pytest.approx(dense[0]["loss"])
    warm = replay("dense", 4, 1, 0.01, 0.5, batch=16, lr=0.0125, lr_warmup=4, trace=True)["trace"]
    slow = replay("dense", 4, 1, 0.01, 0.5, batch=16, lr=0.0125 / 4, trace=True)["trace"]
    assert warm[1]["loss"] == pytest.approx(slow[1]["loss"], rel=1e-6) and warm[1]["loss"] != dense[1]["loss"]
    assert warm[2]["loss"] != slow[2]["loss"]  # (the second step at 2 lr / W)
    with pytest.raises(ValueError, match="lr_scaling must be 'linear' or 'sqrt', got 'log'"):
        replay("dense", 4, 1, 0.01, 0.5, lr_scaling="log")


def test_the_recipe_section_survives_a_rewrite_and_its_commands_parse(tmp_path):
    """docs/convergence.md's hand-written recipe section is what benchmarks.convergence_text appends
    when it rewrites the page, and every ``python -m benchmarks.recipe`` command in it is accepted."""
    import shlex

    from benchmarks.convergence_text import HAND_WRITTEN, PAGE, hand_written
    from benchmarks.recipe import parse_args
    kept = hand_written()
    with open(PAGE) as f:
        assert f.read().endswith("\n".join(kept[1:]) + "\n")
    assert kept[1].startswith(HAND_WRITTEN) and "## Choosing a recipe: 4, 16 and 64 workers" in kept
    commands = [line for line in kept if line.startswith("python -m benchmarks.recipe ")]
    assert len(commands) == 6
    for line in commands:
        parse_args(shlex.split(line)[3:])
    (tmp_path / "page.md").write_text("# A page\n\nno hand-written part\n")
    assert hand_written(str(tmp_path / "page.md")) == []


def test_summary_with_nothing_swept(capsys):
    """One configuration (compression set, no grid): the table has a column per seed and the mean."""
    from benchmarks.recipe import main
    assert main(["--smoke", "--set", "compression=dense", "beta=0.1"]) == 0
    out = capsys.readouterr().out
    run = json.loads(out.splitlines()[0])
    assert (run["compression"], run["beta"], run["epochs"]) == ("dense", 0.1, 1)
    a = f"{100 * run['accuracy']:.1f}"
    assert out.splitlines()[-3:] == ["| workers | seed 0 | mean |", "|---|---|---|", f"| 2 | {a} | {a} |"]
    assert "beta=0.1" in out.splitlines()[-5] and "compression=dense" in out.splitlines()[-5]
