"""The small helpers' handling of what they may be given: cut-off timelines, launch arguments, the
residue norm of something that is no ScaleCom."""

import json

import pytest
import torch

from devtools import launch
from devtools.timeline import read_operations
from hvd_scalecom.monitor import residue_norm

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
    with pytest.raises(TypeError, match=r"args must be strings \(or paths\), got \[3\]"):
        launch.horovodrun_command(["train.py", 3])
    for timeout in (None, -5, 2.5):
        with pytest.raises(ValueError, match="start_timeout must be an int >= 1"):
            launch.horovodrun_command(["train.py"], start_timeout=timeout)
    for timeout in (0, -5, "30", None, True):
        with pytest.raises(ValueError, match="timeout must be a number of seconds > 0"):
            launch.run(["train.py"], timeout=timeout)
    for threads in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            launch.run(["train.py"], threads=threads)


def test_a_failed_job_of_path_arguments_reports_its_ranks(tmp_path):
    missing = tmp_path / "no_such_script.py"
    assert launch.horovodrun_command([missing, "--x"])[-2:] == [str(missing), "--x"]
    with pytest.raises(launch.HorovodRunError, match="----- rank 0 -----") as failed:
        launch.run([missing], np=1, timeout=120)
    assert "horovodrun exited with" in str(failed.value) and str(missing) in str(failed.value)


def test_residue_norm_names_compression_for_other_objects():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(TypeError, match="compression must be a ScaleCom"):
        residue_norm(optimizer)
    with pytest.raises(TypeError, match="compression must have a state_dict"):
        residue_norm(object())


@pytest.mark.parametrize("controller", ["mpi", "gloo"])
def test_a_timed_out_job_leaves_no_worker_running(tmp_path, controller):
    """Open MPI starts each rank in a process group of its own: SIGKILL to horovodrun's group left them
    running; SIGTERM first lets mpirun stop them."""
    import os
    import time
    import uuid

    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(600)\n")
    marker = f"left-running-{uuid.uuid4().hex}"
    with pytest.raises(launch.HorovodRunError, match="timed out after 10 s"):
        launch.run([str(script), marker], np=2, controller=controller, timeout=10)

    def running():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(pid))
            except OSError:
                pass
        return found

    deadline = time.monotonic() + 15
    while running() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = running()
    for pid in left:  # (not to leave them behind even when the test fails)
        os.kill(pid, 9)
    assert not left, f"workers still running after the timeout: {left}"


def test_output_splits_by_rank_with_open_mpis_tags_inside_lines():
    """Under MPI an unbuffered print reaches the output as several tagged writes on one line."""
    output = ("[1,0]<stdout>:rank-line [1,0]<stdout>:0 end\n[1,1]<stdout>:rank-line 1 end\n"
              "[0]<stderr>:gloo rank 0\nlauncher line\n")
    assert launch.split_by_rank(output) == {-1: "launcher line", 0: "rank-line 0 end\ngloo rank 0",
                                            1: "rank-line 1 end"}
