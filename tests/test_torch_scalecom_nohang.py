"""ScaleCom under real horovodrun when the backward pass differs between steps or ranks: frozen
parameters, tied parameters, hooks in rank-dependent orders, gradients missing on some ranks. Each
case either matches the NumPy reference (tests/reference.py) on every rank or fails on every rank
with a clear error within a time limit; none may hang."""

import numpy as np
import pytest

from devtools.launch import HorovodRunError
from test_torch_scalecom import NAMES, check_against_reference, check_identical_weights

# Horovod's stall settings, which ScaleCom follows too: a wait for indices that never come ends the job.
FAST_STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


@pytest.mark.parametrize("np_, ranks, pipelined, frozen", [
    (2, [0, 1], False, (3, 6)), (2, [1], False, (3, 6)), (3, [2], False, (3, 6)), (3, [1], True, (3, 6)),
    (3, [2], True, (0, 1)),  # at the first step: the leader's fresh indices and the next step's in flight
])
def test_requires_grad_toggled_mid_training(horovod_job, np_, ranks, pipelined, frozen):
    """out.weight is frozen for steps ``frozen`` (e.g. 3-5) on ``ranks`` (all of them or one), then
    trainable again. A frozen rank's gradient is not computed, so Horovod reduces zeros for it after
    the backward pass: the reference sees a zero gradient from that rank, as for any missing gradient."""
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 8, "pipelined": pipelined,
            "freeze": {"param": "out.weight", "ranks": ranks, "from": frozen[0], "to": frozen[1]}}
    results, _ = horovod_job("torch_scalecom.py", opts, np=np_, timeout=180, env=FAST_STALL)
    assert len(results) == np_
    # every parameter goes through compress once per step, frozen or not (Horovod reduces zeros for a
    # frozen rank's parameter in synchronize())
    assert all(int(r[f"compress_calls/{t}"]) == len(NAMES) for r in results for t in range(8))
    if len(ranks) == np_:  # frozen everywhere: the residue memory still drains into the parameter
        assert np.count_nonzero(results[0]["applied/4/out.weight"]) == 32  # k = ceil(0.05 * 640)
    check_against_reference(results, opts, steps=8)
    check_identical_weights(results)


@pytest.mark.parametrize("np_", [2, 3])
def test_tied_embedding_used_twice(horovod_job, np_):
    """One Parameter in two modules (an embedding and an output projection), used twice in every
    forward pass: named_parameters() lists it once, its hook fires once with both uses summed."""
    names = NAMES + ["embed.weight"]
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "tied_embedding": True}
    results, _ = horovod_job("torch_scalecom.py", opts, np=np_, timeout=180, env=FAST_STALL)
    # its hook fires once a step: one compress per parameter, the tied one included
    assert all(int(r[f"compress_calls/{t}"]) == len(names) for r in results for t in range(5))
    check_against_reference(results, opts, steps=5, names=names)
    check_identical_weights(results, names)


def test_hooks_in_rank_dependent_order(horovod_job):
    """Two backward passes per step, out.* then hidden.* on odd ranks and the reverse on even ones:
    with the cyclic leader every order gives the reference's values."""
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "split_backward": True}
    results, _ = horovod_job("torch_scalecom.py", opts, np=3, timeout=180, env=FAST_STALL)
    check_against_reference(results, opts, steps=6)
    check_identical_weights(results)


@pytest.mark.parametrize("case, env, limit", [
    ({"split_backward": True, "timeout": 10}, {}, "10"),
    ({"no_out_weight_grad_on_rank": 1},
     {"HOROVOD_STALL_CHECK_TIME_SECONDS": "3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "12"}, "12"),
])
def test_staggered_leader_with_rank_dependent_order_fails_on_every_rank(horovod_job, case, env, limit):
    """With leader="staggered" ranks can each wait, inside a hook, for indices another sends only
    later (opposite hook orders; a gradient that rank 1 lacks at step 5, which it leads, reduced
    after its backward pass). A waiting rank raises a RuntimeError naming the tensor after ``timeout``
    or Horovod's stall shutdown time (having warned at Horovod's stall check interval), which ends
    the job on every rank."""
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "leader": "staggered", **case}
    with pytest.raises(HorovodRunError) as failure:
        horovod_job("torch_scalecom.py", opts, np=3, timeout=150, env=env)
    report = str(failure.value)
    assert "timed out" not in report.split("\n", 1)[0]
    ours = f"still waiting after {limit} s for the leader's indices"
    sections = [report.split(f"----- rank {rank} -----", 1)[1].split("-----", 1)[0] for rank in range(3)]
    assert any(ours in section for section in sections)
    for section in sections:
        # A rank whose own wait had not yet expired learns of the first error from Horovod's shutdown.
        assert ours in section or "Horovod has been shut down" in section, section[-2000:]
        if "HOROVOD_STALL_CHECK_TIME_SECONDS" in env:
            assert "ScaleCom warning: still waiting after" in section
