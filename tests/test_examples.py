"""The examples under horovodrun: a PyTorch run resumed from its checkpoint ends exactly where an
uninterrupted run ends (model, optimizer, data order and each rank's residue memory restored), and
both examples draw a progress bar on rank 0 only."""

import json
import os
import re

import pytest
import torch

from hvd_scalecom.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_scalecom.py")


def _train(tmp_path, name, *extra):
    result = tmp_path / f"{name}.json"
    run([EXAMPLE, "--compression", "scalecom", "--batch-size", "64", "--result", str(result), *extra],
        np=2, timeout=300)
    return json.loads(result.read_text())


def test_resume_from_checkpoint_matches_an_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    straight = _train(tmp_path, "straight", "--epochs", "3")
    _train(tmp_path, "first", "--epochs", "2", "--checkpoint", str(ckpt))
    resumed = _train(tmp_path, "resumed", "--epochs", "3", "--checkpoint", str(ckpt), "--resume")
    assert resumed["loss"] == straight["loss"]
    assert resumed["accuracy"] == straight["accuracy"]
    assert resumed["steps"] == straight["steps"]
    # the checkpoint holds each rank's own residue memory, and they differ
    memories = [torch.load(ckpt / f"rank{r}.pt", weights_only=False)["compression"]["params"]
                for r in range(2)]
    name = "0.weight"
    assert memories[0][name]["step"] == memories[1][name]["step"] == straight["steps"]
    assert not torch.equal(memories[0][name]["memory"], memories[1][name]["memory"])


@pytest.mark.parametrize("example", ["pytorch_scalecom.py", "tensorflow_scalecom.py"])
def test_progress_bar_on_rank_0(example):
    output = run([os.path.join(ROOT, "examples", example), "--epochs", "1", "--progress"], np=2,
                 timeout=300)
    # tqdm redraws the bar every 0.1 s or so; horovodrun prints each redraw as a line of rank 0's
    assert re.search(r"\[0\]<stdout>:epoch 1: +\d+%\|.*\| \d+/\d+ \[", output), output[-2000:]
    assert "[1]<stdout>:epoch 1:" not in output
