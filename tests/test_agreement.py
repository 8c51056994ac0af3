"""The framework-neutral parts of the cross-rank configuration check and of state loading."""

import json

import numpy as np
import pytest

from hvd_scalecom import agreement
from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.state_checks import check_size, checked_params


def test_equal_summaries_pass_whatever_the_key_order():
    a = agreement.encode({"ratio": 0.01, "beta": 0.1})
    b = agreement.encode({"beta": 0.1, "ratio": 0.01})
    agreement.check_gathered("ScaleCom", [a, b, bytearray(a)])


def test_disagreement_names_the_keys_and_every_ranks_values():
    base = {**ScaleComConfig().as_dict(), "parameter_digest": agreement.shapes_digest([("w", (3, 4))])}
    other = {**base, "ratio": 0.02, "parameter_digest": agreement.shapes_digest([("w", (3, 5))])}
    gathered = [agreement.encode(s) for s in (base, base, other)]
    with pytest.raises(ValueError) as error:
        agreement.check_gathered("ScaleCom", gathered, {"parameter_digest": "(names and shapes)",
                                                        "beta": "(not shown)"})
    text = str(error.value)
    assert text.startswith("ScaleCom is configured differently on different ranks "
                           "(parameter_digest, ratio differ): rank 0: parameter_digest=")
    assert f"rank 2: parameter_digest={other['parameter_digest']!r}, ratio=0.02." in text
    assert "rank 1: parameter_digest=" in text and "ratio=0.01" in text
    assert text.endswith(" (names and shapes)")
    assert base["parameter_digest"] != other["parameter_digest"]


def test_digests_depend_on_every_shape_and_name():
    shapes = [("a", (2, 3)), ("b", (4,))]
    assert agreement.shapes_digest(shapes) == agreement.shapes_digest([("a", [2, 3]), ("b", [4])])
    for changed in ([("a", (3, 2)), ("b", (4,))], [("a", (2, 3))], [("b", (4,)), ("a", (2, 3))],
                    [("a", (2, 3)), ("c", (4,))]):
        assert agreement.shapes_digest(changed) != agreement.shapes_digest(shapes)
    assert len(agreement.digest(json.loads('[["float32", [2, 3]]]'))) == 16


def test_checked_params_refuses_bad_states():
    config = ScaleComConfig().as_dict()
    good = {"config": config, "params": {"w": {"step": 3, "memory": None}, "b": {"step": np.int64(0)}}}
    assert checked_params(good, "ScaleCom", config, ["w", "b"]) is good["params"]
    cases = [
        ([], ValueError, "state must be a dict returned by ScaleCom.state_dict"),
        ({"params": {}}, ValueError, "state must be a dict"),
        ({**good, "config": {**config, "beta": 0.5}}, ValueError, "saved with config"),
        ({**good, "params": {"w": {"step": 1}}}, ValueError,
         "the variables: missing \\['b'\\], unexpected \\[\\]"),
        ({**good, "params": {**good["params"], "x": {"step": 1}}}, ValueError, "unexpected \\['x'\\]"),
        ({**good, "params": [1]}, TypeError, "params must be a dict of the variables' entries, got list"),
        ({**good, "params": {"w": {"step": -1}, "b": {"step": 0}}}, ValueError,
         "step of 'w' must be >= 0"),
        ({**good, "params": {"w": {"step": True}, "b": {"step": 0}}}, TypeError, "step of 'w'"),
        ({**good, "params": {"w": {"step": 1.0}, "b": {"step": 0}}}, TypeError, "step of 'w'"),
        ({**good, "params": {"w": 3, "b": {"step": 0}}}, TypeError, "entry of 'w' must be a dict"),
    ]
    for state, error, message in cases:
        with pytest.raises(error, match=message):
            checked_params(state, "ScaleCom", config, ["w", "b"], "variables")


def test_check_size_counts_entries_of_arrays_and_lists():
    check_size("w", "memory", np.zeros((3, 4)), 12)
    check_size("w", "memory", [1.0, 2.0], 2)
    with pytest.raises(ValueError, match="state memory of 'w' has 12 entries, the variable 13"):
        check_size("w", "memory", np.zeros((3, 4)), 13, "variable")


def test_next_indices_may_be_a_torch_tensor():
    """As ScaleCom.state_dict() saves them (on the parameter's device; moved to the CPU to check)."""
    import torch

    from hvd_scalecom.state_checks import check_next_indices
    step, indices = check_next_indices("w", (3, torch.tensor([4, 1, 7])), 3, 10, True)
    assert step == 3 and indices.tolist() == [4, 1, 7]


def test_next_indices_step_must_fit_the_step_counters():
    """A step past int64 was accepted and failed later, in TensorFlow after some variables had changed."""
    from hvd_scalecom.state_checks import check_next_indices
    for step in (-1, 2**63, 2**64, 1.0, True):
        with pytest.raises(ValueError, match=r"next_indices of 'w': step must be an int in \[0, 2\*\*63\)"):
            check_next_indices("w", (step, np.array([4, 1, 7])), 3, 10, True)
    assert check_next_indices("w", (2**63 - 1, np.array([4, 1, 7])), 3, 10, True)[0] == 2**63 - 1


def test_next_indices_must_be_for_the_entry_s_step():
    """Saved for the step that comes next; a rank holding some for another step exchanged fresh indices
    while the others used theirs (a hang at 2 ranks)."""
    from hvd_scalecom.state_checks import check_next_indices
    with pytest.raises(ValueError, match=r"next_indices of 'w' are for step 4, but its step counter is 3"):
        check_next_indices("w", (4, np.array([4, 1, 7])), 3, 10, True, entry_step=3)
    assert check_next_indices("w", (3, np.array([4, 1, 7])), 3, 10, True, entry_step=3)[0] == 3


def test_dtype_names_are_the_distinct_dtypes_sorted():
    import torch
    assert agreement.dtype_names([torch.float32, torch.float16, torch.float32]) == ["float16", "float32"]
    assert agreement.dtype_names(["float64"]) == ["float64"]


def test_a_key_missing_on_one_rank_is_named():
    """Present as None on one rank, missing on another: the bytes differ, and so must the message."""
    gathered = [agreement.encode({"ratio": 0.01, "extra": None}), agreement.encode({"ratio": 0.01})]
    with pytest.raises(ValueError, match=r"\(extra differ\): rank 0: extra=None; rank 1: extra missing\."):
        agreement.check_gathered("ScaleCom", gathered)


def test_wire_bytes_refuse_a_worker_count_below_one_and_bytes_below_zero():
    from hvd_scalecom.traffic import allgather_bytes_sent, allreduce_bytes_sent, broadcast_bytes_sent
    for formula in (allgather_bytes_sent, allreduce_bytes_sent, broadcast_bytes_sent):
        for n in (0, -1, 2.0, True):
            with pytest.raises(ValueError, match=r"n \(workers\) must be an int >= 1"):
                formula(100, n)
        for nbytes in (-1, float("nan"), float("inf"), "100", None, True):
            with pytest.raises(ValueError, match=r"nbytes must be a finite number >= 0"):
                formula(nbytes, 4)
    assert (allreduce_bytes_sent(100, np.int64(4)), allgather_bytes_sent(100, 4), broadcast_bytes_sent(100, 4)) == \
        (150.0, 300.0, 75.0)


@pytest.mark.parametrize("env, expected", [
    ({}, (60.0, None)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, (5.0, 30.0)),
    ({"HOROVOD_STALL_CHECK_DISABLE": "false", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, (60.0, 30.0)),
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30"}, (None, None)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "0"}, (None, None)),
])
def test_stall_settings_are_read_as_horovod_reads_them(monkeypatch, env, expected):
    """Integers; the check is off only for HOROVOD_STALL_CHECK_DISABLE above 0 (Horovod's strtol), and a
    warning interval of 0 or less means no warnings (not one at every poll)."""
    from hvd_scalecom.torch.collectives import stall_times
    for variable in ("HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                     "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    assert stall_times() == expected
    assert stall_times(timeout=7.5)[1] == 7.5


@pytest.mark.parametrize("variable", ["HOROVOD_STALL_CHECK_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"])
def test_a_stall_setting_that_is_not_an_integer_is_named(monkeypatch, variable):
    from hvd_scalecom.torch.collectives import stall_times
    monkeypatch.setenv(variable, "1m")
    with pytest.raises(ValueError, match=f"{variable} must be an integer number of seconds"):
        stall_times()


def test_traffic_meter_refuses_unknown_counts_and_bad_steps_before_counting():
    from hvd_scalecom.traffic import TrafficMeter
    meter = TrafficMeter()
    meter.record(0, value_bytes=10)
    with pytest.raises(TypeError, match=r"\['index_byte'\] are not StepTraffic fields"):
        meter.record(0, value_bytes=10, index_byte=4)
    assert (meter.step(0).value_bytes, meter.step(0).tensors, meter.total.value_bytes) == (10, 1, 10)
    for step, error in ((-3, ValueError), ("abc", TypeError), (2.5, TypeError)):
        with pytest.raises(error, match="step"):
            meter.step(step)
    assert meter.step(np.int64(0)).value_bytes == 10 and meter.step(99).value_bytes == 0


def test_traffic_meter_says_which_steps_it_no_longer_keeps():
    """Steps before the last ``keep + 1`` are an error, not zeros that look like a step that sent
    nothing; within them a step that sent nothing (Qsparse between synchronisations) is zeros."""
    from hvd_scalecom.traffic import TrafficMeter
    meter = TrafficMeter(keep=4)
    for step in (0, 3, 6, 9):
        meter.record(step, value_bytes=step + 1)
    assert [meter.step(s).value_bytes for s in (5, 6, 7, 9, 10)] == [0, 7, 0, 10, 0]
    with pytest.raises(ValueError, match=r"step 4 is not kept: the statistics keep the last 5 steps \(5\.\.9\)"):
        meter.step(4)
    assert meter.step(4, strict=False).value_bytes == 0  # (a default step: zeros, never an error)
    assert meter.total.value_bytes == 1 + 4 + 7 + 10
