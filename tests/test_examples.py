"""The examples under horovodrun: a PyTorch run resumed from its checkpoint ends exactly where an
uninterrupted run ends (model, optimizer, data order and each rank's residue memory restored), a
resume with other optimizer arguments is refused, both examples draw a progress bar on rank 0 only
and name a bad argument."""

import json
import os
import re

import pytest
import torch
from jobs import add_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_scalecom.py")

# The examples' runs share horovodrun jobs (tests/jobs.py), one after another in the same processes; a run
# that must fail comes last in its job; a resumed run runs in new processes (ex_*_b and ex_*_c run after ex_*).
JOB = {"pytorch_scalecom.py": "torch", "tensorflow_scalecom.py": "tf"}
RESUME_TEST = ["test_resume_from_checkpoint_matches_an_uninterrupted_run"]


def _train_run(name, *extra, job="ex_torch_np2", fails=False):
    """A run of the PyTorch example writing ``<root>/ckpt_resume/<name>.json`` (``{ckpt}``: that folder)."""
    def arguments(root):
        folder = root / "ckpt_resume"
        folder.mkdir(exist_ok=True)
        return ["--compression", "scalecom", "--batch-size", "64", "--result", str(folder / f"{name}.json"),
                *(str(folder / "ckpt") if e == "{ckpt}" else e for e in extra)]
    add_run(job, f"ex_torch_{name}", EXAMPLE, arguments, RESUME_TEST, fails=fails, timeout=600)


def _train(job, name):
    job.completed(f"ex_torch_{name}", 0)  # (the example writes no npz)
    return json.loads((job.root / "ckpt_resume" / f"{name}.json").read_text())


_train_run("straight", "--epochs", "3")
_train_run("first", "--epochs", "2", "--checkpoint", "{ckpt}")
_train_run("resumed", "--epochs", "3", "--checkpoint", "{ckpt}", "--resume", job="ex_torch_np2_b")
_train_run("other", "--epochs", "4", "--checkpoint", "{ckpt}", "--resume", "--compression", "dense",
           job="ex_torch_np2_b",
           fails=True)


def test_resume_from_checkpoint_matches_an_uninterrupted_run(horovod_jobs):
    job, resuming = horovod_jobs("ex_torch_np2"), horovod_jobs("ex_torch_np2_b")
    ckpt = job.root / "ckpt_resume" / "ckpt"
    straight = _train(job, "straight")
    _train(job, "first")
    resumed = _train(resuming, "resumed")
    assert resumed["loss"] == straight["loss"]
    assert resumed["accuracy"] == straight["accuracy"]
    assert resumed["steps"] == straight["steps"]
    # the checkpoint holds each rank's own residue memory, and they differ
    memories = [torch.load(ckpt / f"rank{r}.pt", weights_only=False)["compression"]["params"]
                for r in range(2)]
    name = "0.weight"
    assert memories[0][name]["step"] == memories[1][name]["step"] == straight["steps"]
    assert not torch.equal(memories[0][name]["memory"], memories[1][name]["memory"])
    from devtools.launch import HorovodRunError  # another --compression would drop the memories
    assert isinstance(resuming.error, HorovodRunError)
    report = resuming.failure("ex_torch_other")
    assert re.search("--compression dense: the checkpoint in .* was trained with --compression scalecom; resume "
                     "with that", report), report[-3000:]


def other_arguments_common(example, root):
    return ["--compression", "dense", "--batch-size", "256", "--checkpoint", str(root / f"ckpt_{JOB[example]}_dense")]


for example in ["pytorch_scalecom.py", "tensorflow_scalecom.py"]:
    # (its progress bar read by test_progress_bar_on_rank_0: a run of its own would train once more)
    add_run(f"ex_{JOB[example]}_np2", f"ex_{JOB[example]}_dense_first", os.path.join(ROOT, "examples", example),
            lambda root, example=example: [*other_arguments_common(example, root), "--epochs", "1", "--progress"],
            ["test_resume_with_other_optimizer_arguments_is_refused", "test_progress_bar_on_rank_0"], timeout=600)
    add_run(f"ex_{JOB[example]}_np2_c", f"ex_{JOB[example]}_dense_other", os.path.join(ROOT, "examples", example),
            lambda root, example=example: [*other_arguments_common(example, root), "--epochs", "2", "--resume",
                                           "--lr", "0.1", "--momentum", "0.5"],
            ["test_resume_with_other_optimizer_arguments_is_refused"], fails=True, timeout=600)


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
def test_resume_with_other_optimizer_arguments_is_refused(example, horovod_jobs):
    """The checkpoint restores the optimizer with its learning rate and momentum: a resume given
    others would silently train with the checkpoint's, so it is refused, naming both values."""
    from devtools.launch import HorovodRunError
    horovod_jobs(f"ex_{JOB[example]}_np2").completed(f"ex_{JOB[example]}_dense_first", 0)
    job = horovod_jobs(f"ex_{JOB[example]}_np2_c")
    assert isinstance(job.error, HorovodRunError)
    report = job.failure(f"ex_{JOB[example]}_dense_other")
    assert re.search(r"--lr 0\.1, --momentum 0\.5: the checkpoint in .* was trained "
                     r"with --lr 0\.0125, --momentum 0\.9; resume with those", report), report[-3000:]


def test_default_recipe_keeps_scalecom_within_a_point_of_dense_at_4_workers(monkeypatch):
    """The example's default options, replayed at 4 workers by the simulator (the same data, batches,
    initial weights, optimizer and ScaleCom equations as ``horovodrun -np 4``): ScaleCom ends within
    1 point of dense's test accuracy. Seed 1, where the former defaults (lr 0.05 per worker, batch
    32) drove ScaleCom's residue memory to release bursts that sent training to NaN (10% accuracy)."""
    from benchmarks.convergence_horovod import replay
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from pytorch_scalecom import parse_args
    args = parse_args([])
    # what replay runs: the learning rate scaled linearly, compression from the first step
    assert args.lr_scaling == "linear" and args.warmup_steps == 0
    torch.set_num_threads(1)
    accuracy = {c: replay(c, 4, args.epochs, args.ratio, args.beta, seed=1, batch=args.batch_size,
                          lr=args.lr, momentum=args.momentum)["accuracy"] for c in ("scalecom", "dense")}
    assert accuracy["dense"] > 0.9, accuracy
    assert accuracy["scalecom"] >= accuracy["dense"] - 0.01, accuracy


def test_checkpoint_records_what_scales_the_learning_rate(monkeypatch):
    """The record both examples check on resume (in-process): another number of workers or
    --lr-scaling changes the scaled learning rate and is refused; an older checkpoint's bare
    --compression name is checked alone."""
    import argparse
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from digits_common import check_trained_with, trained_with
    args = argparse.Namespace(compression="scalecom", lr=0.05, momentum=0.9, lr_scaling="linear")
    saved = trained_with(args, 2)
    assert saved == {"--compression": "scalecom", "--lr": 0.05, "--momentum": 0.9, "--lr-scaling": "linear",
                     "-np": 2}
    check_trained_with(saved, trained_with(args, 2), "ckpt")  # the same: resumes
    with pytest.raises(SystemExit, match="^-np 4: the checkpoint in ckpt was trained with -np 2; resume with that$"):
        check_trained_with(saved, trained_with(args, 4), "ckpt")
    args.lr_scaling = "sqrt"
    with pytest.raises(SystemExit, match="^--lr-scaling sqrt: .* with --lr-scaling linear; resume with that$"):
        check_trained_with(saved, trained_with(args, 2), "ckpt")
    check_trained_with("scalecom", trained_with(args, 4), "ckpt")
    with pytest.raises(SystemExit, match="^--compression scalecom: .* with --compression dense; resume with that$"):
        check_trained_with("dense", trained_with(args, 2), "ckpt")


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
def test_progress_bar_on_rank_0(example, horovod_jobs):
    output = horovod_jobs(f"ex_{JOB[example]}_np2").output_of(f"ex_{JOB[example]}_dense_first")
    # tqdm redraws the bar every 0.1 s or so; horovodrun prints each redraw as a line of rank 0's
    assert re.search(r"\[0\]<stdout>:epoch 1: +\d+%\|.*\| \d+/\d+ \[", output), output[-2000:]
    assert "[1]<stdout>:epoch 1:" not in output


for example in ["pytorch_scalecom.py", "tensorflow_scalecom.py"]:
    add_run(f"ex_{JOB[example]}_np4", f"ex_{JOB[example]}_shards", os.path.join(ROOT, "examples", example),
            lambda root, example=example: ["--epochs", "1", "--batch-size", "120", "--result",
                                           str(root / f"ex_{JOB[example]}_shards" / "result.json")],
            ["test_shards_of_different_sizes_take_the_same_steps"], timeout=600)


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
def test_shards_of_different_sizes_take_the_same_steps(example, horovod_jobs):
    """4 workers: shards of 360, 359, 359 and 359 images; batches of 120 give every rank 2 steps (3
    on rank 0 would leave its third allreduce waiting for the others)."""
    job = horovod_jobs(f"ex_{JOB[example]}_np4")
    result = job.root / f"ex_{JOB[example]}_shards" / "result.json"
    output = job.output_of(f"ex_{JOB[example]}_shards")
    assert "2 steps per epoch" in output
    assert json.loads(result.read_text())["compression"] == "scalecom"


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
@pytest.mark.parametrize("arguments, message", [
    (["--epochs", "0"], "argument --epochs: must be a positive integer, got 0"),
    (["--batch-size", "-5"], "argument --batch-size: must be a positive integer, got -5"),
    (["--batch-size", "2000"], "--batch-size 2000 is larger than the smallest worker's shard of 1437"),
    (["--comp", "dense"], "unrecognized arguments: --comp dense"),  # no abbreviations
    (["--lr", "nan"], "argument --lr: must be a finite number > 0, got nan"),  # (trained to NaN)
    (["--lr", "inf"], "argument --lr: must be a finite number > 0, got inf"),
    (["--lr", "-0.05"], "argument --lr: must be a finite number > 0, got -0.05"),  # (not the scaled -0.1)
    (["--momentum", "1"], "argument --momentum: must be a number >= 0 and < 1, got 1"),
    (["--seed", "-1"], "argument --seed: must be an integer from 0 to 2**32 - 1, got -1"),
    # (ScaleCom's ValueError, a traceback from every rank once Horovod had started)
    (["--ratio", "nan"], "argument --ratio: must be a number > 0 and <= 1, got nan"),
    (["--beta", "0"], "argument --beta: must be a number > 0 and <= 1, got 0"),
    (["--min-numel", "-1"], "argument --min-numel: must be an integer >= 0, got -1"),
    (["--result", "/nonexistent_dir/r.json"],  # (refused before training, not after)
     "argument --result: directory /nonexistent_dir does not exist"),
])
def test_bad_example_arguments_are_named(example, arguments, message, request):
    code, output = bad_argument_outcomes(request, example)[tuple(arguments)]
    assert code != 0 and message in output, output[-2000:]


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
@pytest.mark.parametrize("arguments, message", [
    (["--fallback", "dense"], "--fallback dense needs --check-every"),
    (["--check-every", "0"], "argument --check-every: must be a positive integer, got 0"),
    (["--check-every", "5", "--fallback", "dense", "--pipelined"], "--fallback needs exact ScaleCom"),
])
def test_bad_health_check_arguments_are_named(example, arguments, message, request):
    code, output = bad_argument_outcomes(request, example)[tuple(arguments)]
    assert code != 0 and message in output, output[-2000:]


_BAD_ARGUMENT_OUTCOMES = {}


def bad_argument_outcomes(request, example):
    """``{arguments: (exit code, output)}`` of the example given each argument list of this test selected
    in the session: all in one Python process (tests/workers/each_argv.py), which starts torch or
    TensorFlow once, not once per list."""
    from shared_python import each_argv

    key = (request.node.originalname, example)
    if key not in _BAD_ARGUMENT_OUTCOMES:
        lists = [item.callspec.params["arguments"] for item in request.session.items
                 if getattr(item, "originalname", None) == request.node.originalname
                 and item.callspec.params["example"] == example]
        outcomes = each_argv(os.path.join(ROOT, "examples", example), lists)
        _BAD_ARGUMENT_OUTCOMES[key] = {a: (c, out + err) for a, (c, out, err) in outcomes.items()}
    return _BAD_ARGUMENT_OUTCOMES[key]


def test_the_demo_explains_its_arguments_and_refuses_compression_and_outputs():
    from shared_python import each_argv

    passed_on = (["--result", "x.json"], ["--checkpoint=ckpt"], ["--resume"], ["--tensorboard", "tb"])
    runs = each_argv(os.path.join(ROOT, "examples", "run_demo.py"),  # (one Python for all the lists)
                     [["--help"], ["--compression", "fp16"], ["--epochs", "0"], *passed_on])
    code, stdout, _ = runs[("--help",)]
    assert code == 0 and "go to examples/pytorch_scalecom.py in both jobs" in stdout
    code, _, stderr = runs[("--compression", "fp16")]
    assert code != 0 and "leave --compression out" in stderr
    code, stdout, stderr = runs[("--epochs", "0")]
    assert code == 2 and "argument --epochs: must be a positive integer, got 0" in stderr
    assert "horovodrun" not in stdout  # (refused before its first job started)
    for arguments in passed_on:
        code, _, stderr = runs[tuple(arguments)]
        name = arguments[0].split("=")[0]
        assert code != 0 and f"cannot pass {name} on: both of its jobs" in stderr
