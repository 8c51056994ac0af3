"""ScaleCom as a DDP communication hook (``hvd_scalecom.ddp``) under real torchrun jobs (Gloo).

One torchrun job per world size runs every scenario in sequence (``tests/workers/ddp_scenarios.py``);
a second job at 2 ranks resumes from the first one's checkpoint, and a horovodrun job trains the same
model with the Horovod compressor. The hook's updates and residue memories are compared with the
NumPy reference of the equations (``tests/reference.py``), which never calls the code under test.
"""

import json
import math
import os
import pickle
import sys

import numpy as np
import pytest
import torch
from reference import scalecom_reference, selected_count

from devtools.launch import run, run_command
from hvd_scalecom.ddp import ScaleComState, scalecom_hook

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(ROOT, "tests", "workers")
sys.path.insert(0, WORKERS)
import ddp_common  # noqa: E402

NAMES = ["first.weight", "first.bias", "second.weight", "second.bias"]
UNUSED_NAMES = NAMES + ["unused.weight", "unused.bias"]
SMALL = {"ratio": 0.05, "min_numel": 100}
MATCH_STATE = {k: ddp_common.MATCH[k] for k in ("ratio", "beta", "warmup_steps", "min_numel")}
SCENARIOS = [
    # several buckets (one parameter or two each), warm-up, classic error feedback
    {"name": "cyclic", "kind": "train", "steps": 6, "ddp": {"bucket_cap_mb": 0.004},
     "state": {**SMALL, "beta": 1.0, "warmup_steps": 2}},
    # one bucket; several leaders in one index allreduce; values in fp16 (their own allreduce)
    {"name": "staggered", "kind": "train", "steps": 5,
     "state": {**SMALL, "beta": 0.3, "leader": "staggered", "value_dtype": "float16"}},
    # a layer the forward pass never uses, and one micro-batch under no_sync() before each step
    {"name": "unused", "kind": "train", "steps": 5, "unused": True, "accumulate": 1,
     "ddp": {"find_unused_parameters": True, "bucket_cap_mb": 0.004},
     "state": {**SMALL, "beta": 0.5, "warmup_steps": 1}},
    {"name": "static", "kind": "train", "steps": 5, "ddp": {"static_graph": True, "gradient_as_bucket_view": True},
     "state": {**SMALL, "beta": 0.5}},
    {"name": "bf16", "kind": "train", "steps": 4, "dtype": "bfloat16", "state": {**SMALL, "beta": 0.5}},
    {"name": "fp16", "kind": "train", "steps": 4, "dtype": "float16", "state": {**SMALL, "beta": 0.5}},
    {"name": "dense", "kind": "dense_bytes", "steps": 3},
]
REFERENCED = {"cyclic": NAMES, "staggered": NAMES, "unused": UNUSED_NAMES, "static": NAMES}
# The health check and the dense fallback on ddp_common.HealthNet, whose gradients take `a` through
# compressed -> check (low) -> check (low) -> fallback -> check (good) -> check (good) -> compressed,
# while `b` stays compressed: several buckets (`a` alone in one), then one bucket with fp16 values.
HEALTH = {**SMALL, "beta": 0.5, "warmup_steps": 1, "check_every": 2, "fallback": "dense", "min_captured": 0.5,
          "patience": 2}
HEALTH_NAMES = ["a", "b", "bias"]
HEALTH_SCENARIOS = [
    {"name": "health", "kind": "train", "model": "health", "steps": 11, "ddp": {"bucket_cap_mb": 0.001},
     "state": HEALTH},
    {"name": "health_staggered", "kind": "train", "model": "health", "steps": 11,
     "state": {**HEALTH, "leader": "staggered", "value_dtype": "float16"}},
]


def torchrun(opts, nproc, out_dir, timeout=240):
    """Run ``ddp_scenarios.py`` under ``torchrun --standalone --nproc_per_node nproc``; per-rank records."""
    os.makedirs(out_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           os.path.join(WORKERS, "ddp_scenarios.py"), json.dumps(opts), str(out_dir)]
    run_command(cmd, timeout=timeout)
    return [dict(np.load(os.path.join(out_dir, f"rank{r}.npz"))) for r in range(nproc)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{world size: per-rank records}: one job per world size, and the resumed job at 2 ranks."""
    base = tmp_path_factory.mktemp("ddp")
    match = {"name": "match", "kind": "train", "state": MATCH_STATE,
             **{k: ddp_common.MATCH[k] for k in ("steps", "lr", "momentum")}}
    resume = {"name": "resume", "kind": "train", "steps": 6, "state": {**SMALL, "beta": 0.5, "warmup_steps": 1},
              "save_after": 3, "ckpt_dir": str(base / "ckpt")}
    mismatch = {"name": "mismatch", "kind": "mismatch"}
    # saved after step 4, a fallback step of `a`: resumed in the middle of its fallback
    health_saved = {**HEALTH_SCENARIOS[0], "save_after": 5, "ckpt_dir": str(base / "health_ckpt")}
    out = {2: torchrun({"scenarios": [*SCENARIOS, match, resume, mismatch, health_saved, *HEALTH_SCENARIOS[1:]]},
                       2, base / "np2"),
           3: torchrun({"scenarios": [*SCENARIOS[:4], mismatch, *HEALTH_SCENARIOS]}, 3, base / "np3")}
    out["resumed"] = torchrun({"scenarios": [{**resume, "load": True}, {**health_saved, "load": True}]}, 2,
                              base / "resumed")
    return out


def _scenario(name):
    return next(s for s in SCENARIOS if s["name"] == name)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("name", sorted(REFERENCED))
def test_updates_and_memories_equal_the_reference(jobs, size, name):
    results, sc = jobs[size], _scenario(name)
    state = {"beta": 0.1, "warmup_steps": 0, "leader": "cyclic", **sc["state"]}
    names, steps = REFERENCED[name], sc["steps"]
    raw = [[{n: results[r][f"{name}/raw/{t}/{n}"] for n in names} for r in range(size)] for t in range(steps)]
    value_dtype = np.float16 if state.get("value_dtype") == "float16" else np.float32
    applied, memories = scalecom_reference(raw, names, size, state["ratio"], state["beta"], state["warmup_steps"],
                                           state["min_numel"], leader=state["leader"], value_dtype=value_dtype)
    # fp16 values are summed in fp16 by the process group, in fp32 by the reference
    rtol, atol = (2e-3, 1e-5) if value_dtype is np.float16 else (1e-5, 1e-6)
    for t in range(steps):
        for n in names:
            for r in range(size):
                got = results[r][f"{name}/out/{t}/{n}"]
                np.testing.assert_allclose(got, applied[t][n], rtol=rtol, atol=atol, err_msg=f"step {t} {n} rank {r}")
            numel = applied[t][n].size
            if numel >= state["min_numel"] and t >= state["warmup_steps"]:  # k entries sent, the rest 0
                assert np.count_nonzero(results[0][f"{name}/out/{t}/{n}"]) <= selected_count(state["ratio"], numel)
    for r in range(size):
        for n in names:
            if applied[0][n].size >= state["min_numel"]:
                np.testing.assert_allclose(results[r][f"{name}/mem/{n}"], memories[r][n], rtol=1e-5, atol=1e-6)
            else:
                assert f"{name}/mem/{n}" not in results[r]  # dense parameters keep no memory
    assert int(results[0][f"{name}/iter"]) == steps  # synchronised passes only (not the no_sync ones)


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_stay_in_sync_and_memories_are_fp32(jobs, size):
    results = jobs[size]
    for sc in SCENARIOS[:6] if size == 2 else SCENARIOS[:4]:
        name = sc["name"]
        finals = [k for k in results[0] if k.startswith(f"{name}/final/")]
        assert finals
        for key in finals:
            assert np.isfinite(results[0][key]).all()
            for r in range(1, size):
                np.testing.assert_array_equal(results[r][key], results[0][key], err_msg=key)
        dtypes = {str(results[0][k]) for k in results[0] if k.startswith(f"{name}/memdtype/")}
        assert dtypes == {"torch.float32"}, name
        assert int(results[0][f"{name}/iter"]) == sc["steps"]


def test_bytes_handed_to_the_process_group_show_the_compression(jobs):
    """Bytes counted in the torch.distributed calls themselves, per backward pass: ScaleCom's equal its
    stats() (plus the first step's 16-byte configuration check) and are a fraction of a dense hook's."""
    results = jobs[2]
    dense_step = int(results[0]["dense/bytes/0"])
    numels = [32 * 64, 64, 64 * 40, 40]
    assert dense_step == 4 * sum(numels)  # the whole buffer, fp32
    k = [selected_count(0.05, n) for n in numels[::2]]
    compressed_step = 4 * (2 * sum(k)) + 4 * (64 + 40)  # int32 indices and fp32 values, dense biases
    for r in range(2):
        for t in range(6):
            counted, stats = int(results[r][f"cyclic/bytes/{t}"]), int(results[r][f"cyclic/stats/{t}"])
            assert counted == stats + (16 if t == 0 else 0)
            assert stats == (dense_step if t < 2 else compressed_step)
    assert dense_step / compressed_step > 8
    scalars = json.loads(str(results[0]["static/log_stats"]))  # hvd_scalecom.torch.log_stats on the state
    assert scalars["scalecom/sent_bytes"] == compressed_step
    assert scalars["scalecom/ratio"] == pytest.approx(dense_step / compressed_step)
    assert float(results[0]["static/residue_norm"]) > 0


def test_a_resumed_job_ends_where_an_uninterrupted_one_does(jobs):
    straight, resumed = jobs[2], jobs["resumed"]
    keys = [k for k in straight[0] if k.startswith(("resume/final/", "resume/mem/"))]
    assert len(keys) == 6
    for r in range(2):
        for key in keys:
            np.testing.assert_array_equal(resumed[r][key], straight[r][key], err_msg=key)
        assert int(resumed[r]["resume/iter"]) == 6
    assert not np.array_equal(straight[0]["resume/mem/first.weight"], straight[1]["resume/mem/first.weight"])


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_configured_differently_all_get_one_error(jobs, size):
    errors = {str(jobs[size][r]["mismatch/error"]) for r in range(size)}
    assert len(errors) == 1
    assert "ScaleComState is configured differently on different ranks (ratio differ): rank 0: ratio=0.01" in \
        errors.pop()


def _health_reference(results, sc, size):
    """The reference's applied updates, memories and health log for a health scenario's recorded gradients."""
    state, steps = sc["state"], sc["steps"]
    raw = [[{n: results[r][f"{sc['name']}/raw/{t}/{n}"] for n in HEALTH_NAMES} for r in range(size)]
           for t in range(steps)]
    log = []
    applied, memories = scalecom_reference(
        raw, HEALTH_NAMES, size, state["ratio"], state["beta"], state["warmup_steps"], state["min_numel"],
        leader=state.get("leader", "cyclic"), value_dtype=np.float16 if state.get("value_dtype") else np.float32,
        check_every=state["check_every"], fallback=state["fallback"], min_captured=state["min_captured"],
        patience=state["patience"], health_log=log)
    return applied, memories, log


def _dense_before(log, name, t):
    """Whether the reference sends `name` densely at step t (its latest check before t said so)."""
    return next((entry[7] for entry in reversed(log) if entry[1] == name and entry[0] < t), False)


def _expected_health(log, t, warmup_steps):
    """stats()["health"] after step t, from the reference's log."""
    latest, by_tensor = {}, {}
    for entry in log:
        if entry[0] <= t:
            latest[entry[1]] = entry
    for name, (step, _, hits, k, selected, topk, total, dense) in latest.items():
        by_tensor[name] = {"step": step, "overlap": hits / k, "captured": selected / topk,
                           "selected_share": selected / total, "topk_share": topk / total, "dense": dense,
                           "checks": sum(e[1] == name and e[0] <= t for e in log)}
    out = {"checks": sum(e[0] <= t for e in log),
           "dense_steps": sum(_dense_before(log, n, s) for n in ("a", "b") for s in range(warmup_steps, t + 1)),
           "dense_tensors": sum(e[7] for e in latest.values()), "by_tensor": by_tensor}
    if latest:
        hits, k, selected, topk, total = (sum(e[i] for e in latest.values()) for i in range(2, 7))
        out.update(overlap=hits / k, captured=selected / topk, selected_share=selected / total,
                   topk_share=topk / total)
    return out


def _assert_close(got, expected, rtol, where):
    if isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            _assert_close(got[key], expected[key], rtol, f"{where}/{key}")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=rtol, abs=1e-12), where
    else:
        assert got == expected, where


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("sc", HEALTH_SCENARIOS, ids=lambda sc: sc["name"])
def test_health_check_and_fallback_equal_the_reference(jobs, size, sc):
    """Updates, memories and stats()["health"] of every step equal the reference's, over a run that
    goes compressed -> check -> fallback -> check -> compressed; every rank takes the same decisions."""
    results, name, steps = jobs[size], sc["name"], sc["steps"]
    applied, memories, log = _health_reference(results, sc, size)
    assert [(t, n, dense) for t, n, *_, dense in log] == [
        (t, n, n == "a" and t in (3, 5)) for t in (1, 3, 5, 7, 9) for n in ("a", "b")]  # the path taken
    assert [t for t in range(steps) if _dense_before(log, "a", t)] == [4, 5, 6, 7]
    fp16 = sc["state"].get("value_dtype") == "float16"
    rtol, atol = (2e-3, 1e-5) if fp16 else (1e-5, 1e-6)
    for t in range(steps):
        for n in HEALTH_NAMES:
            for r in range(size):
                np.testing.assert_allclose(results[r][f"{name}/out/{t}/{n}"].reshape(-1), applied[t][n].reshape(-1),
                                           rtol=rtol, atol=atol, err_msg=f"step {t} {n} rank {r}")
        expected = _expected_health(log, t, sc["state"]["warmup_steps"])
        for r in range(size):
            stats = json.loads(str(results[r][f"{name}/stats_of/{t}"]))
            _assert_close(stats["health"], expected, 1e-2 if fp16 else 1e-5, f"step {t} rank {r}")
            assert stats["health"] == json.loads(str(results[0][f"{name}/stats_of/{t}"]))["health"]
    for r in range(size):
        for n in ("a", "b"):
            np.testing.assert_allclose(results[r][f"{name}/mem/{n}"], memories[r][n], rtol=1e-5, atol=1e-6)
        for n in HEALTH_NAMES:
            np.testing.assert_array_equal(results[r][f"{name}/final/{n}"], results[0][f"{name}/final/{n}"])
    scalars = json.loads(str(results[0][f"{name}/scalars"]))
    assert scalars["scalecom/health_checks"] == 10 and scalars["scalecom/health_dense_tensors"] == 0
    warned = [json.loads(str(results[r][f"{name}/warnings"])) for r in range(size)]
    assert len(warned[0]) == 1 and "for 'a'" in warned[0][0] and "at step 3" in warned[0][0]
    assert all(not w for w in warned[1:])  # rank 0 warns, once


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("sc", HEALTH_SCENARIOS, ids=lambda sc: sc["name"])
def test_bytes_of_check_and_fallback_steps(jobs, size, sc):
    """A check step sends its indices and p densely in the values' dtype; a fallback step p densely
    and no indices; stats() counts what the torch.distributed calls were handed."""
    results, name = jobs[size], sc["name"]
    _, _, log = _health_reference(results, sc, size)
    value = 2 if sc["state"].get("value_dtype") == "float16" else 4
    numel, k = {"a": 400, "b": 300}, {"a": 20, "b": 15}
    for t in range(sc["steps"]):
        expected = {"index_bytes": 0, "value_bytes": 0, "dense_bytes": 4 * 10}
        for n in ("a", "b"):
            check, dense = t % 2 == 1, _dense_before(log, n, t)
            if t == 0:
                expected["dense_bytes"] += 4 * numel[n]  # warm-up
            elif dense and not check:
                expected["dense_bytes"] += value * numel[n]
            else:
                expected["index_bytes"] += 4 * k[n]
                expected["value_bytes"] += value * (numel[n] if check else k[n])
        for r in range(size):
            stats = json.loads(str(results[r][f"{name}/stats_of/{t}"]))
            assert {key: stats[key] for key in expected} == expected, f"step {t} rank {r}"
            assert int(results[r][f"{name}/bytes/{t}"]) == stats["sent_bytes"] + (16 if t == 0 else 0)


def test_a_job_resumed_in_the_middle_of_a_fallback_ends_where_an_uninterrupted_one_does(jobs):
    straight, resumed = jobs[2], jobs["resumed"]
    for r in range(2):
        for n in HEALTH_NAMES:
            np.testing.assert_array_equal(resumed[r][f"health/final/{n}"], straight[r][f"health/final/{n}"])
        for n in ("a", "b"):
            np.testing.assert_array_equal(resumed[r][f"health/mem/{n}"], straight[r][f"health/mem/{n}"])
        for t in range(5, 11):
            assert json.loads(str(resumed[r][f"health/stats_of/{t}"]))["health"] == \
                json.loads(str(straight[r][f"health/stats_of/{t}"]))["health"], f"step {t}"
        assert not json.loads(str(resumed[r]["health/warnings"]))  # (warned before the save)


def test_same_weights_as_the_horovod_compressor(jobs, tmp_path):
    """The Horovod ScaleCom and the DDP hook on the same model, data and settings (2 ranks) end with
    the same weights: bit for bit (the sums of two values, and the division by 2, are exact)."""
    run([os.path.join(WORKERS, "ddp_horovod_match.py"), "{}", str(tmp_path)], np=2, timeout=240)
    horovod = dict(np.load(tmp_path / "rank0.npz"))
    for name in NAMES:
        np.testing.assert_array_equal(jobs[2][0][f"match/final/{name}"], horovod[f"final/{name}"], err_msg=name)


# -- in one process ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    ({"ratio": 0}, ValueError, "ratio must be a number in"),
    ({"beta": 1.5}, ValueError, "beta must be a number in"),
    ({"warmup_steps": -1}, ValueError, "warmup_steps must be >= 0"),
    ({"min_numel": "many"}, TypeError, "min_numel must be an int"),
    ({"leader": "random"}, ValueError, "leader must be one of"),
    ({"selection": "approx"}, ValueError, "selection must be one of"),
    ({"value_dtype": torch.int8}, ValueError, "value_dtype must be one of"),
    ({"index_dtype": "int16"}, ValueError, "index_dtype must be one of"),
    ({"process_group": "world"}, TypeError, "process_group must be a torch.distributed.ProcessGroup"),
    ({"named_parameters": 5}, TypeError, "named_parameters must be an iterable"),
    ({"named_parameters": []}, ValueError, "named_parameters is empty"),
    ({"named_parameters": [("a", torch.zeros(1)), ("a", torch.zeros(1))]}, ValueError, "names 'a' twice"),
    ({"check_every": 0}, ValueError, "check_every must be >= 1"),
    ({"check_every": 2}, ValueError, "check_every=2 needs named_parameters"),
    ({"fallback": "dense"}, ValueError, "fallback='dense' needs check_every"),
    ({"check_every": 2, "fallback": "sparse"}, ValueError, "fallback must be one of"),
    ({"check_every": 2, "min_captured": 1.5}, ValueError, "min_captured must be in"),
    ({"check_every": 2, "patience": 0}, ValueError, "patience must be >= 1"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        ScaleComState(**kwargs)


def test_hook_refuses_another_state():
    with pytest.raises(TypeError, match="scalecom_hook's state must be a ScaleComState, got PowerSGDState"):
        scalecom_hook(type("PowerSGDState", (), {})(), None)


def _named_state(**kwargs):
    model = ddp_common.make_net()
    return model, ScaleComState(named_parameters=model.named_parameters(), **{**SMALL, **kwargs})


def test_state_dict_round_trip_and_refusals():
    model, state = _named_state()
    with pytest.raises(ValueError, match=r"state_dict\(\) needs the parameters' names"):
        ScaleComState().state_dict()
    saved = state.state_dict()
    assert set(saved["params"]) == set(NAMES) and saved["step"] == 0
    saved["step"] = 4
    memory = torch.arange(2048, dtype=torch.float32)
    saved["params"]["first.weight"] = {"step": 4, "shape": [64, 32], "memory": memory}
    for entry in saved["params"].values():
        entry["step"] = 4
    state.load_state_dict(saved)
    again = state.state_dict()
    assert again["step"] == state.iter == 4
    assert torch.equal(again["params"]["first.weight"]["memory"], memory)
    assert again["params"]["second.weight"]["memory"] is None
    _, other = _named_state(beta=0.5)
    with pytest.raises(ValueError, match="state was saved with config"):
        other.load_state_dict(again)
    wrong = {**again, "params": {**again["params"], "first.weight": {**again["params"]["first.weight"],
                                                                     "shape": [32, 64]}}}
    with pytest.raises(ValueError, match=r"state of 'first.weight' was saved for a parameter of shape \(32, 64\)"):
        state.load_state_dict(wrong)
    missing = {**again, "params": {n: e for n, e in again["params"].items() if n != "first.bias"}}
    with pytest.raises(ValueError, match=r"missing \['first.bias'\]"):
        state.load_state_dict(missing)
    skewed = {**again, "step": 5}
    with pytest.raises(ValueError, match="state step of 'first.weight' is 4, the state's 5"):
        state.load_state_dict(skewed)
    assert state.iter == 4  # nothing changed by the refusals


def test_health_state_round_trip_and_refusals():
    from hvd_scalecom.health import Measures
    _, state = _named_state(check_every=2, fallback="dense", patience=1)
    assert "health" not in _named_state()[1].state_dict() and "health" not in _named_state()[1].stats()
    state._record_check("first.weight", 0, Measures(hits=1, k=103, selected=1.0, topk=9.0, total=20.0))
    assert state._sends_dense("first.weight") and state.stats()["health"]["dense_tensors"] == 1
    saved = state.state_dict()
    _, other = _named_state(check_every=2, fallback="dense", patience=1)
    other.load_state_dict(saved)
    assert other._sends_dense("first.weight") and other.state_dict()["health"] == saved["health"]
    bad = {**saved, "health": {"first.weight": saved["health"]["first.weight"]}}
    with pytest.raises(ValueError, match="health state must have an entry for each of"):
        other.load_state_dict(bad)
    assert other._sends_dense("first.weight")  # nothing changed by the refusal
    other.load_state_dict({k: v for k, v in saved.items() if k != "health"})  # saved without: fresh
    assert not other._sends_dense("first.weight") and other.stats()["health"]["checks"] == 0
    _, unchecked = _named_state()
    unchecked.load_state_dict(saved)  # (check_every off: the saved health state is not used)
    assert "health" not in unchecked.state_dict()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.health == state.health and copy._sends_dense("first.weight")
    with pytest.raises(ValueError, match="bind_parameters: named_parameters name other parameters"):
        copy.bind_parameters(ddp_common.HealthNet().named_parameters())


def test_pickling_drops_the_process_group_and_keeps_the_memories():
    model, state = _named_state()
    saved = state.state_dict()
    saved["params"]["second.weight"]["memory"] = torch.ones(2560)
    state.load_state_dict(saved)
    assert "process_group" not in state.__getstate__()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.iter == state.iter
    with pytest.raises(ValueError, match=r"unpickled: call its bind_parameters"):
        copy._describe(model.first.weight)
    copy.bind_parameters(model.named_parameters())
    assert torch.equal(copy.state_dict()["params"]["second.weight"]["memory"], torch.ones(2560))


def test_stats_before_any_step_and_log_stats():
    from hvd_scalecom.torch import log_stats
    _, state = _named_state()
    stats = state.stats()
    assert stats["sent_bytes"] == 0 and stats["ratio"] == 1.0 and stats["total"]["sent_bytes"] == 0
    tags = {}
    log_stats(type("W", (), {"add_scalar": lambda self, tag, value, step: tags.__setitem__(tag, value)})(), state, 0)
    assert tags["scalecom/sent_bytes"] == 0.0


# -- the example ---------------------------------------------------------------------------------------

def test_example_trains_briefly_and_reports(tmp_path):
    """Two epochs of 11 steps; with --check-every 1000 the first step (only) is a check step: its three
    weights go densely, the other steps compress."""
    result = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(ROOT, "examples", "ddp_scalecom.py"), "--compression", "scalecom", "--epochs", "2",
           "--batch-size", "64", "--check-every", "1000", "--fallback", "dense", "--result", str(result)]
    output = run_command(cmd, timeout=240)
    assert "epoch   2/2" in output and "health check: captured" in output
    got = json.loads(result.read_text())
    line = next(line for line in output.splitlines() if line.startswith("result "))
    assert json.loads(line[len("result "):]) == got
    assert got["compression"] == "scalecom" and got["workers"] == 2 and got["steps"] == 22
    assert got["dense_bytes_per_step"] / got["sent_bytes_last_step"] > 35
    assert 0.5 < got["accuracy"] <= 1 and math.isfinite(got["loss"])
    health = got["health"]
    assert health["checks"] == 3 and health["dense_steps"] == 0 and health["dense_tensors"] == 0
    assert 0 < health["captured"] <= 1 and 0 <= health["overlap"] <= 1


def test_example_refuses_a_fallback_without_checks(capsys, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    from ddp_scalecom import parse_args
    assert parse_args(["--check-every", "50", "--fallback", "dense"]).check_every == 50
    with pytest.raises(SystemExit):
        parse_args(["--fallback", "dense"])
    assert "--fallback dense needs --check-every" in capsys.readouterr().err
