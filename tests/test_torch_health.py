"""ScaleCom's health check (``check_every``) and dense fallback (``fallback="dense"``) on the stock
hvd.DistributedOptimizer under real horovodrun, step by step against the single-process reference
(tests/reference.py, ``scalecom_reference(..., check_every=, fallback=, ...)``); the constructor's and
load_state_dict's refusals; and the reference itself.

The runs share the jobs of tests/jobs.py (``torch_np2``, ``torch_np3``, ``torch_np3_stall``) with
tests/test_torch_scalecom.py. Their ranks train on different data until ``same_data_from``, then on
the same data: with ``min_captured`` close to 1 the leader's indices first miss the average's top-k
(low checks: the tensor falls back to dense), then, the ranks' gradients agreeing, find it (good
checks: back to compressed).
"""

import json

import numpy as np
import pytest
import torch
from jobs import add_run
from reference import assert_applied_steps, scalecom_reference
from workers.states import same

from hvd_scalecom.torch import ScaleCom

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
NUMEL = {"hidden.weight": 3072, "hidden.bias": 64, "out.weight": 640, "out.bias": 10}
K = {"hidden.weight": 154, "out.weight": 32}  # ceil(0.05 * numel): the compressed tensors


def health_opts(np_):
    """2 ranks: a check every 2 steps, one low check to fall back, one good to return. 3 ranks: two of
    each (patience 2), and a min_captured that out.weight's first two checks miss and hidden.weight's
    first reaches (0.40 and 0.37 against 0.49, the run being deterministic): at steps 4 and 5 one
    tensor falls back while the other is compressed; the indices are broadcast, to which the
    fallback steps post no receive."""
    if np_ == 2:  # (and the ranks that do not select write their memory over their gradients, where they may)
        return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 10, "same_data_from": 5,
                "advance_min_numel": 0,
                "health": {"check_every": 2, "fallback": "dense", "min_captured": 0.9, "patience": 1}}
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 16, "same_data_from": 6,
            "index_exchange": "broadcast",
            "health": {"check_every": 2, "fallback": "dense", "min_captured": 0.46, "patience": 2}}


def scalecom_run(job, part, opts, tests, **kwargs):
    add_run(job, part, "torch_scalecom.py", opts, tests, **kwargs)


for np_ in (2, 3):
    scalecom_run(f"torch_np{np_}", f"health_np{np_}", health_opts(np_),
                 ["test_fallback_and_return_match_the_reference", "test_state_mid_fallback_resumes_identically"])
# 3 ranks: the first 9 steps and a checkpoint (mid-fallback), then new processes resume from it
RESUME_AT = 9
scalecom_run("torch_np3", "health_np3_first", {**health_opts(3), "steps": RESUME_AT, "checkpoint": True},
             ["test_state_mid_fallback_resumes_identically"])
scalecom_run("torch_np3_stall", "health_np3_second", lambda root: {
    **health_opts(3), "steps": health_opts(3)["steps"] - RESUME_AT, "first_step": RESUME_AT,
    "resume_from": str(root / "health_np3_first")}, ["test_state_mid_fallback_resumes_identically"])
# checks alone (no fallback) on pipelined indices, fp16 values, traded buffers
CHECKS_PIPELINED = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 2, "min_numel": 600, "steps": 8, "pipelined": True,
                    "value_dtype": "float16", "advance_min_numel": 0, "health": {"check_every": 3}}
scalecom_run("torch_np2", "health_checks_pipelined", CHECKS_PIPELINED, ["test_checks_alone_train_as_plain_scalecom"])
# the 2-rank run, with every rank's resync() (elastic Horovod's sync) at step 3, mid-fallback
scalecom_run("torch_np2", "health_resync", {**health_opts(2), "resync_at": 3}, ["test_resync_forgets_the_checks"])

# ranks whose health options differ: one clear error on every rank at the first step, with no collective
# in flight (ScaleCom's configuration check, before Horovod reduces anything): the job goes on after it
scalecom_run("torch_np2", "health_disagreeing", {"steps": 2, "per_rank": {"1": {"health": {"check_every": 3,
                                                                                        "min_captured": 0.7}}}},
             ["test_ranks_whose_health_options_differ_all_get_one_clear_error"], timeout=120,
             raises="ValueError: ScaleCom is configured differently on different ranks (")


def raw_grads(results, steps, first=0):
    return [[{n: r[f"raw/{t}/{n}"] for n in NAMES} for r in results] for t in range(first, first + steps)]


def reference(grads, opts, size, health=True):
    """The reference's applied gradients, memories and health log for a run of ``opts`` (``health``:
    with its health options, else without)."""
    log = []
    applied, memories = scalecom_reference(
        grads, NAMES, size, opts["ratio"], opts["beta"], opts["warmup_steps"], opts["min_numel"],
        value_dtype=np.float16 if opts.get("value_dtype") == "float16" else np.float32,
        pipelined=opts.get("pipelined", False), health_log=log, **(opts.get("health", {}) if health else {}))
    return applied, memories, log


def check_steps(results, applied, memories, first=0, rtol=2e-5, atol=1e-6):
    assert_applied_steps(results, applied, NAMES, first, rtol, atol)
    for rank, r in enumerate(results):
        for n in K:
            np.testing.assert_allclose(r[f"memory/{n}"], memories[rank][n], rtol=rtol, atol=atol,
                                       err_msg=f"memory of {n}, rank {rank}")


def kinds(log, opts, steps):
    """{(t, name): "warm-up", "compressed", "check", "dense" or "check, dense"} from the reference's log."""
    health, warmup = opts["health"], opts["warmup_steps"]
    dense_after = {(t, n): dense for t, n, *_, dense in log}
    out = {}
    for n in K:
        dense = False
        for t in range(steps):
            check = t >= warmup and (t - warmup) % health["check_every"] == 0
            out[t, n] = ("warm-up" if t < warmup else "check, dense" if check and dense else "check" if check
                         else "dense" if dense else "compressed")
            dense = dense_after.get((t, n), dense)
    return out


def expected_bytes(kind_of, t, value_size=4, exchanges=1):
    """stats(step=t)'s payload bytes (float32 gradients, values of ``value_size`` bytes, ``exchanges``
    int32 index exchanges per tensor) from the tensors' kinds at t."""
    index = value = 0
    dense = 4 * (NUMEL["hidden.bias"] + NUMEL["out.bias"])
    for n, k in K.items():
        kind = kind_of[t, n]
        if kind == "warm-up":
            dense += 4 * NUMEL[n]
        elif kind == "dense":
            dense += value_size * NUMEL[n]
        else:
            index += 4 * k * exchanges
            value += value_size * (NUMEL[n] if kind.startswith("check") else k)
    return {"index_bytes": index, "value_bytes": value, "dense_bytes": dense}


def check_health_stats(stats, log, kind_of, steps):
    """stats()["health"] against the reference's log: each tensor's latest check, and the counts."""
    health = stats["health"]
    latest = {}
    for t, n, hits, k, selected, topk, total, dense in log:
        latest[n] = (t, hits, k, selected, topk, total, dense)
    assert set(health["by_tensor"]) == set(K)
    for n, (t, hits, k, selected, topk, total, dense) in latest.items():
        got = health["by_tensor"][n]
        assert (got["step"], got["dense"], got["checks"]) == (t, dense, sum(1 for e in log if e[1] == n)), (n, got)
        assert got["overlap"] == hits / k, n
        assert got["captured"] == pytest.approx(selected / topk, rel=1e-5), n
        assert got["selected_share"] == pytest.approx(selected / total, rel=1e-5), n
        assert got["topk_share"] == pytest.approx(topk / total, rel=1e-5), n
    assert health["checks"] == len(log)
    assert health["dense_steps"] == sum(kind_of[t, n] in ("dense", "check, dense") for t in range(steps) for n in K)
    assert health["dense_tensors"] == sum(latest[n][-1] for n in K)
    hits, ks = sum(latest[n][1] for n in K), sum(latest[n][2] for n in K)
    assert health["overlap"] == pytest.approx(hits / ks)
    assert health["captured"] == pytest.approx(sum(latest[n][3] for n in K) / sum(latest[n][4] for n in K), rel=1e-5)


@pytest.mark.parametrize("np_", [2, 3])
def test_fallback_and_return_match_the_reference(horovod_jobs, np_):
    """Compressed, a low check, dense steps (and checks while dense), good checks, compressed again:
    the applied gradients and memories equal the reference's at every step on every rank; stats()
    reports the reference's measures and counts and each step's bytes (a check's dense p as values,
    with its indices; a fallback step's as dense, without); the warning comes once, on rank 0 only."""
    opts = health_opts(np_)
    steps = opts["steps"]
    results = horovod_jobs(f"torch_np{np_}").completed(f"health_np{np_}")
    applied, memories, log = reference(raw_grads(results, steps), opts, np_)
    kind_of = kinds(log, opts, steps)
    for n in K:  # each tensor went compressed -> check -> fallback (dense, checks while dense) -> compressed
        sequence = [kind_of[t, n] for t in range(steps)]
        first_dense = sequence.index("dense")
        back = first_dense + sequence[first_dense:].index("check")
        assert sequence[1] == "check" and "check, dense" in sequence[first_dense:back], (n, sequence)
        assert "compressed" in sequence[back:], (n, sequence)
    if np_ == 3:  # steps where one tensor falls back and the other is compressed (or checked)
        assert [kind_of[t, n] for t in (4, 5) for n in K] == ["compressed", "dense", "check", "check, dense"]
    check_steps(results, applied, memories)
    if "advance_min_numel" in opts:  # (plain compressed steps traded buffers; check steps may not)
        assert any(int(r["traded"]) > 0 for r in results), [int(r["traded"]) for r in results]
    for r in results:
        for t in range(steps):
            stats = json.loads(str(r[f"stats/{t}"]))
            want = expected_bytes(kind_of, t)
            assert {key: stats[key] for key in want} == want, (t, [kind_of[t, n] for n in K])
        check_health_stats(json.loads(str(r["stats"])), log, kind_of, steps)
    assert [int(r["warnings"]) for r in results] == [1] + [0] * (np_ - 1)


def test_checks_alone_train_as_plain_scalecom(horovod_jobs):
    """check_every=3 without fallback, with pipelined indices, fp16 values and traded buffers: the
    updates and memories are plain ScaleCom's (the reference without checks), a check step's values
    are the dense p in fp16, and stats() reports the reference's checks."""
    opts, steps = CHECKS_PIPELINED, CHECKS_PIPELINED["steps"]
    results = horovod_jobs("torch_np2").completed("health_checks_pipelined")
    grads = raw_grads(results, steps)
    applied, memories, _ = reference(grads, opts, 2, health=False)
    check_steps(results, applied, memories, rtol=2e-3, atol=2e-4)
    _, _, log = reference(grads, opts, 2)
    kind_of = kinds(log, opts, steps)
    assert [kind_of[t, "hidden.weight"] for t in range(steps)] == \
        ["warm-up", "warm-up", "check", "compressed", "compressed", "check", "compressed", "compressed"]
    for r in results:
        for t in range(steps):  # (the first compressed step exchanges its own indices and the next step's)
            want = expected_bytes(kind_of, t, value_size=2, exchanges=2 if t == 2 else 1)
            stats = json.loads(str(r[f"stats/{t}"]))
            assert {key: stats[key] for key in want} == want, t
        stats = json.loads(str(r["stats"]))
        assert stats["health"]["checks"] == len(log) == 4 and stats["health"]["dense_steps"] == 0
        for n in K:
            t, *_, hits, k, selected, topk, total, dense = [e for e in log if e[1] == n][-1]
            got = stats["health"]["by_tensor"][n]
            assert got["step"] == 5 and got["overlap"] == hits / k and not got["dense"]
            assert got["captured"] == pytest.approx(selected / topk, rel=1e-3)


def test_resync_forgets_the_checks(horovod_jobs):
    """resync() on every rank at step 3, while both tensors fall back: every rank forgets the checks, so
    step 3 is a check of compressed tensors (k entries applied, not a dense step), whose low figures
    (the same as the run without resync: the steps before are the same) send them densely again from
    step 4; the ranks stay in step (the same updates), and the counts start again at step 3."""
    results = horovod_jobs("torch_np2").completed("health_resync")
    for r in results:
        for n, k in K.items():
            assert np.count_nonzero(r[f"applied/2/{n}"]) > 0.9 * NUMEL[n]  # a fallback step (before resync)
            assert np.count_nonzero(r[f"applied/3/{n}"]) == k  # a check of a compressed tensor
            assert np.count_nonzero(r[f"applied/4/{n}"]) > 0.9 * NUMEL[n]  # fallen back again
        health = json.loads(str(r["stats"]))["health"]
        assert health["checks"] == 2 * 4  # steps 3, 5, 7, 9 of both tensors
        assert all(health["by_tensor"][n]["checks"] == 4 for n in K)
    for n in NAMES:
        for t in range(health_opts(2)["steps"]):
            np.testing.assert_array_equal(results[1][f"applied/{t}/{n}"], results[0][f"applied/{t}/{n}"])
    assert [int(r["warnings"]) for r in results] == [2, 0]  # (a fresh monitor on rank 0 warns again)


def test_state_mid_fallback_resumes_identically(horovod_jobs):
    """9 steps, a checkpoint while out.weight falls back, new processes, 7 more steps: the same
    updates, memories and health figures as the 16 steps straight (and as the reference)."""
    opts, steps = health_opts(3), health_opts(3)["steps"]
    straight = horovod_jobs("torch_np3").completed("health_np3")
    first = horovod_jobs("torch_np3").completed("health_np3_first")
    resumed = horovod_jobs("torch_np3_stall").completed("health_np3_second")
    saved = torch.load(horovod_jobs("torch_np3").root / "health_np3_first" / "ckpt0.pt")["compression"]
    assert saved["health"]["out.weight"]["dense"], saved["health"]["out.weight"]  # mid-fallback
    applied, memories, log = reference(raw_grads(first, RESUME_AT) + raw_grads(resumed, steps - RESUME_AT, RESUME_AT),
                                       opts, 3)
    check_steps(resumed, applied[RESUME_AT:], memories, first=RESUME_AT)
    for rank in range(3):
        for n in NAMES:  # (dense reductions are fused differently from run to run: the last bit may differ)
            np.testing.assert_allclose(resumed[rank][f"final/{n}"], straight[rank][f"final/{n}"], rtol=1e-5,
                                       atol=1e-7, err_msg=f"{n}, rank {rank}")
        health = json.loads(str(resumed[rank]["stats"]))["health"]
        want = json.loads(str(straight[rank]["stats"]))["health"]
        assert {k: health[k] for k in ("checks", "dense_steps", "dense_tensors")} == \
            {k: want[k] for k in ("checks", "dense_steps", "dense_tensors")}
        assert health["captured"] == pytest.approx(want["captured"], rel=1e-5)
    check_health_stats(json.loads(str(resumed[0]["stats"])), log, kinds(log, opts, steps), steps)


def test_ranks_whose_health_options_differ_all_get_one_clear_error(horovod_jobs):
    for printed in horovod_jobs("torch_np2").raised("health_disagreeing"):
        assert "ScaleCom is configured differently on different ranks (check_every, min_captured differ): " \
               "rank 0: check_every=None, min_captured=0.5; rank 1: check_every=3, min_captured=0.7" in printed, \
            printed[-2000:]


# -- single-process: the options, the state, the reference -----------------------------------------


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))


@pytest.mark.parametrize("kwargs, error, words", [
    ({"check_every": 0}, ValueError, "check_every"),
    ({"check_every": 1.5}, TypeError, "check_every"),
    ({"check_every": 4, "fallback": "topk"}, ValueError, "fallback"),
    ({"fallback": "dense"}, ValueError, "check_every"),
    ({"check_every": 4, "min_captured": -0.1}, ValueError, "min_captured"),
    ({"check_every": 4, "patience": 0}, ValueError, "patience"),
    ({"check_every": 4, "fallback": "dense", "pipelined": True}, ValueError, "pipelined"),
])
def test_bad_health_options_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words) as failure:
        ScaleCom(model().named_parameters(), **kwargs)
    if "pipelined" in kwargs:
        assert "fallback" in str(failure.value)


def test_checks_alone_work_pipelined():
    compression = ScaleCom(model().named_parameters(), check_every=4, pipelined=True)
    assert compression.health.check_every == 4 and compression.health.fallback is None


def test_health_state_round_trip_and_bad_health_state_changes_nothing():
    compression = ScaleCom(model().named_parameters(), min_numel=16, check_every=2, fallback="dense", patience=1)
    state = compression.state_dict()
    assert set(state["health"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    state["health"]["0.weight"].update(dense=True, checks=3, dense_steps=4, step=5,
                                       measures={"hits": 2, "k": 120, "selected": 1.0, "topk": 4.0, "total": 8.0})
    compression.load_state_dict(state)
    assert compression.stats()["health"]["dense_tensors"] == 1
    assert compression.stats()["health"]["by_tensor"]["0.weight"]["captured"] == 0.25
    before = compression.state_dict()
    assert same(before, state)
    for bad, words in [({"0.weight": {}}, "entry for each"), ({**state["health"], "0.bias": {"dense": 1}}, "'0.bias'"),
                       ("fallen back", "entry for each")]:
        with pytest.raises(ValueError, match=words):
            compression.load_state_dict({**state, "health": bad})
        assert same(compression.state_dict(), before), "a rejected state changed the compressor"
    # a state without "health" (saved without check_every): fresh checks
    compression.load_state_dict({k: v for k, v in state.items() if k != "health"})
    assert compression.stats()["health"]["dense_tensors"] == 0 and compression.stats()["health"]["checks"] == 0
    # and without check_every, no "health" in the state or stats; a saved one is ignored
    plain = ScaleCom(model().named_parameters(), min_numel=16)
    plain.load_state_dict(state)
    assert "health" not in plain.state_dict() and "health" not in plain.stats()


def reference_grads(steps, size, seed=0):
    rng = np.random.default_rng(seed)
    return [[{"w": rng.standard_normal((40, 30)).astype(np.float32), "b": rng.standard_normal(30).astype(np.float32)}
             for _ in range(size)] for _ in range(steps)]


def test_reference_checks_without_fallback_change_nothing():
    """check_every with fallback=None: the same applied gradients and memories as without checks, and
    one check logged per check step, with the measures the log names."""
    grads = reference_grads(9, 3)
    plain = scalecom_reference(grads, ["w", "b"], 3, 0.05, 0.3, 2, 100)
    log = []
    checked = scalecom_reference(grads, ["w", "b"], 3, 0.05, 0.3, 2, 100, check_every=3, min_captured=1.0,
                                 health_log=log)
    for t in range(9):
        for n in ("w", "b"):
            np.testing.assert_array_equal(checked[0][t][n], plain[0][t][n])
    for rank in range(3):
        np.testing.assert_array_equal(checked[1][rank]["w"], plain[1][rank]["w"])
    assert [(t, n) for t, n, *_ in log] == [(2, "w"), (5, "w"), (8, "w")]
    assert all(not dense and 0 <= hits <= k == 60 and selected <= topk <= total
               for _, _, hits, k, selected, topk, total, dense in log)


def test_reference_fallback_applies_the_mean_of_p_and_clears_the_memory():
    """fallback="dense" with min_captured=1 (every check low, patience 1): after the first check every
    step applies mean_i(m_i + g_i) and leaves m_i = 0."""
    grads = reference_grads(4, 2, seed=1)
    log = []
    applied, memories = scalecom_reference(grads, ["w"], 2, 0.05, 0.5, 0, 100, check_every=10, fallback="dense",
                                           min_captured=1.0, patience=1, health_log=log)
    assert [dense for *_, dense in log] == [True]
    first, m = scalecom_reference(grads[:1], ["w"], 2, 0.05, 0.5, 0, 100)  # step 0: a check, compressed
    assert np.count_nonzero(first[0]["w"]) == np.count_nonzero(applied[0]["w"]) == 60
    m = [m[r]["w"] for r in range(2)]
    for t in range(1, 4):
        p = [m[r] + grads[t][r]["w"].reshape(-1) for r in range(2)]
        np.testing.assert_allclose(applied[t]["w"].reshape(-1), (p[0] + p[1]) / 2, rtol=1e-6)
        m = [np.zeros_like(m[r]) for r in range(2)]
    for r in range(2):
        np.testing.assert_allclose(memories[r]["w"], m[r], rtol=1e-6)
