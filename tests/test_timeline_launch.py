"""The small helpers' handling of what they may be given: cut-off timelines, launch arguments, the
residue norm of something that is no ScaleCom."""

import json

import pytest
import torch

from hvd_scalecom import launch
from hvd_scalecom.monitor import residue_norm
from hvd_scalecom.timeline import read_operations

EVENTS = [
    {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "allreduce.x0"}},
    {"ph": "B", "name": "ALLREDUCE", "ts": 10, "pid": 1},
    {"ph": "E", "ts": 20, "pid": 1, "args": {"dtype": "float32", "shape": "[10]"}},
    {"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "broadcast.y"}},
    {"ph": "E", "ts": 30, "pid": 2, "args": {"dtype": "int32", "shape": "[3, 2]"}},
]


def test_a_timeline_cut_off_anywhere_gives_the_operations_it_completed(tmp_path):
    """Horovod writes several events per line and leaves the array open while a job runs (or when it
    is killed): a record cut short is dropped, the complete ones are read."""
    text = "[\n" + ",".join(json.dumps(e) for e in EVENTS) + "]"
    path = tmp_path / "timeline.json"
    want = [("allreduce.x0", "allreduce", 10, 40), ("broadcast.y", "broadcast", 6, 24)]
    seen = set()
    for cut in range(len(text) + 1):
        path.write_text(text[:cut])
        ops = [(o["name"], o["op"], o["numel"], o["nbytes"]) for o in read_operations(path)]
        assert ops == want[:len(ops)]
        seen.add(len(ops))
    assert seen == {0, 1, 2}


def test_launch_refuses_a_string_of_arguments_and_a_bad_np():
    with pytest.raises(TypeError, match="args must be a list"):
        launch.horovodrun_command("train.py")
    for np_ in (0, 1.5, True):
        with pytest.raises(ValueError, match="np must be an int >= 1"):
            launch.horovodrun_command(["train.py"], np=np_)
    assert launch.horovodrun_command(["train.py", "--x"], np=3)[-2:] == ["train.py", "--x"]


def test_residue_norm_names_compression_for_other_objects():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(TypeError, match="compression must be a ScaleCom"):
        residue_norm(optimizer)
    with pytest.raises(TypeError, match="compression must have a state_dict"):
        residue_norm(object())
