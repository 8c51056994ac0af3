"""ScaleCom under real horovodrun when the backward pass differs between steps or ranks: frozen
parameters, tied parameters, hooks in rank-dependent orders, gradients missing on some ranks. Each
case either matches the NumPy reference (tests/reference.py) on every rank or fails on every rank
with a clear error within a time limit; none may hang."""

import numpy as np
import pytest
from jobs import add_run, define_job
from test_torch_scalecom import NAMES, check_against_reference, check_identical_weights

from devtools.launch import HorovodRunError

# The passing runs share the jobs torch_np2_stall and torch_np3_stall (tests/jobs.py: Horovod's stall
# settings, which ScaleCom follows too, make a wait for indices that never come end the job).
TOGGLED = [
    (2, [0, 1], False, (3, 6)), (2, [1], False, (3, 6)), (3, [2], False, (3, 6)), (3, [1], True, (3, 6)),
    (3, [2], True, (0, 1)),  # at the first step: the leader's fresh indices and the next step's in flight
]


def toggled_opts(ranks, pipelined, frozen):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 8, "pipelined": pipelined,
            "freeze": {"param": "out.weight", "ranks": ranks, "from": frozen[0], "to": frozen[1]}}


for i, (np_, ranks, pipelined, frozen) in enumerate(TOGGLED):
    add_run(f"torch_np{np_}_stall", f"toggled_{i}", "torch_scalecom.py", toggled_opts(ranks, pipelined, frozen),
            ["test_requires_grad_toggled_mid_training"])


@pytest.mark.parametrize("case", range(len(TOGGLED)))
def test_requires_grad_toggled_mid_training(horovod_jobs, case):
    """out.weight is frozen for steps ``frozen`` (e.g. 3-5) on ``ranks`` (all of them or one), then
    trainable again. A frozen rank's gradient is not computed, so Horovod reduces zeros for it after
    the backward pass: the reference sees a zero gradient from that rank, as for any missing gradient."""
    np_, ranks, pipelined, frozen = TOGGLED[case]
    opts = toggled_opts(ranks, pipelined, frozen)
    results = horovod_jobs(f"torch_np{np_}_stall").completed(f"toggled_{case}")
    assert len(results) == np_
    # every parameter goes through compress once per step, frozen or not (Horovod reduces zeros for a
    # frozen rank's parameter in synchronize())
    assert all(int(r[f"compress_calls/{t}"]) == len(NAMES) for r in results for t in range(8))
    if len(ranks) == np_:  # frozen everywhere: the residue memory still drains into the parameter
        assert np.count_nonzero(results[0]["applied/4/out.weight"]) == 32  # k = ceil(0.05 * 640)
    check_against_reference(results, opts, steps=8)
    check_identical_weights(results)


TIED = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "tied_embedding": True}
for np_ in [2, 3]:
    add_run(f"torch_np{np_}_stall", f"tied_np{np_}", "torch_scalecom.py", TIED, ["test_tied_embedding_used_twice"])


@pytest.mark.parametrize("np_", [2, 3])
def test_tied_embedding_used_twice(horovod_jobs, np_):
    """One Parameter in two modules (an embedding and an output projection), used twice in every
    forward pass: named_parameters() lists it once, its hook fires once with both uses summed."""
    names = NAMES + ["embed.weight"]
    opts = TIED
    results = horovod_jobs(f"torch_np{np_}_stall").completed(f"tied_np{np_}")
    # its hook fires once a step: one compress per parameter, the tied one included
    assert all(int(r[f"compress_calls/{t}"]) == len(names) for r in results for t in range(5))
    check_against_reference(results, opts, steps=5, names=names)
    check_identical_weights(results, names)


SPLIT = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "split_backward": True}
add_run("torch_np3_stall", "split_backward", "torch_scalecom.py", SPLIT, ["test_hooks_in_rank_dependent_order"])


def test_hooks_in_rank_dependent_order(horovod_jobs):
    """Two backward passes per step, out.* then hidden.* on odd ranks and the reverse on even ones:
    with the cyclic leader every order gives the reference's values."""
    opts = SPLIT
    results = horovod_jobs("torch_np3_stall").completed("split_backward")
    check_against_reference(results, opts, steps=6)
    check_identical_weights(results)


STAGGERED_FAILURES = [
    ({"split_backward": True, "timeout": 10}, {}, "10"),
    ({"no_out_weight_grad_on_rank": 1},
     {"HOROVOD_STALL_CHECK_TIME_SECONDS": "3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "12"}, "12"),
]
# each must fail: the first last in torch_np3 (no settings of its own), the second in a job of its own
define_job("torch_np3_stall_12s", 3, env=STAGGERED_FAILURES[1][1])
for i, (case, env, _) in enumerate(STAGGERED_FAILURES):
    add_run("torch_np3_stall_12s" if env else "torch_np3", f"staggered_failure_{i}", "torch_scalecom.py",
            {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "leader": "staggered", **case},
            ["test_staggered_leader_with_rank_dependent_order_fails_on_every_rank"], fails=True, timeout=150)


@pytest.mark.parametrize("index", range(len(STAGGERED_FAILURES)))
def test_staggered_leader_with_rank_dependent_order_fails_on_every_rank(horovod_jobs, index):
    """With leader="staggered" ranks can each wait, inside a hook, for indices another sends only
    later (opposite hook orders; a gradient that rank 1 lacks at step 5, which it leads, reduced
    after its backward pass). A waiting rank raises a RuntimeError naming the tensor after ``timeout``
    or Horovod's stall shutdown time (having warned at Horovod's stall check interval), which ends
    the job on every rank."""
    case, env, limit = STAGGERED_FAILURES[index]
    job = horovod_jobs("torch_np3_stall_12s" if env else "torch_np3")
    assert isinstance(job.error, HorovodRunError)
    report = job.failure(f"staggered_failure_{index}")
    assert "timed out" not in report.split("\n", 1)[0]
    assert "Timeout (0:" not in report  # (the run's own time limit, tests/workers/sequence.py)
    ours = f"still waiting after {limit} s for the leader's indices"
    sections = [report.split(f"----- rank {rank} -----", 1)[1].split("-----", 1)[0] for rank in range(3)]
    assert any(ours in section for section in sections)
    for section in sections:
        # A rank whose own wait had not yet expired learns of the first error from Horovod's shutdown.
        assert ours in section or "Horovod has been shut down" in section, section[-2000:]
        if "HOROVOD_STALL_CHECK_TIME_SECONDS" in env:
            assert "ScaleCom warning: still waiting after" in section
