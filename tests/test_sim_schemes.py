"""Every simulated scheme against a literal NumPy reference of its paper's equations, on tiny tensors.

The references below loop over workers (and, where the paper's description is per entry, over entries)
and share no code with ``hvd_scalecom.sim`` beyond what defines the random choices both must agree on
(the shared random-k indices, the count sketch's hash tables, PowerSGD's initial Q, QSGD's noise).
"""

import math

import numpy as np
import pytest
import torch
from reference import scalecom_reference

from hvd_scalecom.sim import (
    FP16,
    Dense,
    GlobalTopK,
    GTopK,
    LocalTopK,
    PowerSGD,
    QsparseLocalSGD,
    RandomK,
    ScaleCom,
    Simulator,
    SketchedSGD,
)
from hvd_scalecom.torch.sketch import CountSketch
from hvd_scalecom.torch.topk import shared_random_indices

N = 4
SHAPES = {"w": (6, 5), "b": (4,)}  # w (30 entries) is compressed, b (4 < min_numel) goes dense
NAMES = list(SHAPES)
MIN_NUMEL = 10
STEPS = 6


def make_grads(steps=STEPS, n=N, seed=0, shared=1.0):
    """grads[t][i][name]: a component common to all workers plus each worker's own noise."""
    rng = np.random.RandomState(seed)
    out = []
    for _ in range(steps):
        common = {name: rng.randn(*shape) for name, shape in SHAPES.items()}
        out.append([{name: (shared * common[name] + rng.randn(*shape)).astype(np.float32)
                     for name, shape in SHAPES.items()} for _ in range(n)])
    return out


def named_params(values=None):
    values = values or {name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()}
    return [(name, torch.nn.Parameter(torch.tensor(values[name]))) for name in NAMES]


def simulate(scheme, grads, n=N, params=None):
    sim = Simulator(scheme, n, named_params(params))
    results = [sim.step([[torch.from_numpy(g[i][name]) for name in NAMES] for i in range(n)])
               for g in grads]
    return sim, results


def top_k(x, k):
    """Indices of the k largest |x| (ties are absent from random test data)."""
    return np.argsort(-np.abs(x), kind="stable")[:k]


def flat(grads, t, name):
    return [g[name].reshape(-1).astype(np.float64) for g in grads[t]]


def assert_memory(sim, memory):
    np.testing.assert_allclose(sim.scheme.state["w"]["memory"].numpy(), np.array(memory), rtol=1e-5, atol=1e-6)


def assert_updates(results, expected, rtol=1e-5, atol=1e-6):
    for t, (result, want) in enumerate(zip(results, expected)):
        for name, u in zip(NAMES, result.update):
            np.testing.assert_allclose(u.numpy().reshape(-1), np.asarray(want[name]).reshape(-1),
                                       rtol=rtol, atol=atol, err_msg=f"step {t}, {name}")


# -- dense SGD and FP16 ------------------------------------------------------------------------------

def test_dense_is_the_mean():
    grads = make_grads()
    _, results = simulate(Dense(), grads)
    assert_updates(results, [{n: np.mean([g[n] for g in grads[t]], axis=0) for n in NAMES}
                             for t in range(STEPS)])


def test_fp16_rounds_values_for_the_wire():
    grads = make_grads()
    _, results = simulate(FP16(), grads)
    expected = [{n: (np.sum([g[n].astype(np.float16).astype(np.float32) for g in grads[t]], axis=0) / N)
                 .astype(np.float16).astype(np.float32) for n in NAMES} for t in range(STEPS)]
    assert_updates(results, expected, rtol=0, atol=0)
    exact = np.mean([g["w"] for g in grads[0]], axis=0)
    assert 0 < np.abs(results[0].update[0].numpy() - exact).max() < 1e-2  # fp16 really rounded
    # Horovod sums the fp16 values, then divides: a sum beyond 65,504 is Inf, not a mean of 40,000
    _, [wide] = simulate(FP16(), [[{n: np.full_like(g[n], 4e4) for n in NAMES} for g in grads[0]]])
    assert np.isposinf(wide.update[0].numpy()).all()


@pytest.mark.parametrize("make", [Dense, lambda: ScaleCom(min_numel=1024), lambda: PowerSGD(rank=2)])
def test_the_dense_path_sums_fp16_as_horovod_and_keeps_fp32_and_fp64_exact(make):
    """Uncompressed tensors (Dense(), ScaleCom's small tensors, PowerSGD's vectors) are averaged as
    Horovod does: 4 fp16 gradients of 40,000 sum beyond 65,504, Inf; fp32 and fp64 means unchanged."""
    wide = Simulator(make(), 4, [("b", torch.nn.Parameter(torch.zeros(8, dtype=torch.float16)))])
    assert torch.isposinf(wide.step_stacked([torch.full((4, 8), 4e4).half()]).update[0]).all()
    for dtype in (torch.float32, torch.float64):
        G = torch.randn(4, 8, dtype=dtype, generator=torch.Generator().manual_seed(1))
        sim = Simulator(make(), 4, [("b", torch.nn.Parameter(torch.zeros(8, dtype=dtype)))])
        assert torch.equal(sim.step_stacked([G]).update[0], G.mean(dim=0))


# -- ScaleCom ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta, leader, warmup, value_dtype, pipelined", [
    (1.0, "cyclic", 0, None, False), (0.3, "cyclic", 2, None, False), (0.5, "staggered", 1, None, False),
    (0.3, "staggered", 0, "float16", False), (0.5, "cyclic", 1, None, True),
    (1.0, "staggered", 0, None, True)])
def test_scalecom_matches_paper_reference(beta, leader, warmup, value_dtype, pipelined):
    grads = make_grads()
    scheme = ScaleCom(ratio=0.2, beta=beta, warmup_steps=warmup, min_numel=MIN_NUMEL, leader=leader,
                      value_dtype=value_dtype, pipelined=pipelined)
    sim, results = simulate(scheme, grads)
    applied, memories = scalecom_reference(grads, NAMES, N, 0.2, beta, warmup, MIN_NUMEL, leader,
                                           value_dtype=np.float16 if value_dtype else np.float32,
                                           pipelined=pipelined)
    tol = dict(rtol=2e-3, atol=2e-3) if value_dtype else {}
    assert_updates(results, applied, **tol)
    for i in range(N):
        np.testing.assert_allclose(sim.scheme.state["w"]["memory"][i].numpy(), memories[i]["w"],
                                   rtol=1e-5, atol=1e-6)
    assert "memory" not in sim.scheme.state["b"]  # dense tensors keep no memory
    assert np.count_nonzero(results[-1].update[0].numpy()) == 6  # k = ceil(0.2 * 30)


@pytest.mark.parametrize("bad", ["inf off I", "nan", "fp16 overflow", "fp16 sum overflow"])
def test_scalecom_a_non_finite_mean_leaves_every_memory_as_it_was(bad):
    """As the Horovod compressor does: a worker whose gradient is not finite (anywhere, even off the
    leader's indices) sends NaN, and a non-finite mean (that, or fp16 values that overflow, or values
    each within fp16's range whose sum is not: Horovod sums in fp16, then divides) skips every
    worker's memory update for that tensor; the update still carries the mean at I."""
    grads = make_grads(steps=3)
    value_dtype = "float16" if bad.startswith("fp16") else None
    scheme = ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL, value_dtype=value_dtype)
    sim, _ = simulate(scheme, grads[:2])
    before = sim.scheme.state["w"]["memory"].clone()
    last = [{name: g.copy() for name, g in worker.items()} for worker in grads[2]]
    chosen = np.flatnonzero(simulate(ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL), grads)[1][2]
                            .update[0].numpy())  # the leader's indices at that step, had it been finite
    if bad == "inf off I":
        last[1]["w"].reshape(-1)[[j for j in range(30) if j not in chosen][0]] = np.inf
    elif bad == "nan":
        last[3]["w"].reshape(-1)[chosen[0]] = np.nan
    elif bad == "fp16 overflow":
        last[2]["w"].reshape(-1)[chosen[0]] = 1e5  # beyond fp16's 65,504
    else:
        for worker in last:
            worker["w"].reshape(-1)[chosen[0]] = 4e4  # within fp16's range; N of them are not
    result = sim.step([[torch.from_numpy(last[i][name]) for name in NAMES] for i in range(N)])
    assert torch.equal(sim.scheme.state["w"]["memory"], before)
    assert sim.scheme.nonfinite_skips == 1
    update = result.update[0].numpy().reshape(-1)
    assert set(np.flatnonzero(update)) == set(chosen) and not np.isfinite(update[chosen]).all()
    assert np.isfinite(np.delete(update, chosen)).all()
    finite = sim.step([[torch.from_numpy(g[name]) for name in NAMES] for g in grads[0]])
    assert np.isfinite(finite.update[0].numpy()).all() and sim.scheme.nonfinite_skips == 1


BASELINES_WITH_MEMORY = {
    "LocalTopK": lambda v: LocalTopK(ratio=0.2, min_numel=MIN_NUMEL, value_dtype=v),
    "LocalTopK beta 0.5": lambda v: LocalTopK(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL, value_dtype=v),
    "GTopK": lambda v: GTopK(ratio=0.2, min_numel=MIN_NUMEL, value_dtype=v),
    "PowerSGD": lambda v: PowerSGD(rank=2, min_numel=MIN_NUMEL, seed=3),
}


@pytest.mark.parametrize("scheme, bad", [(scheme, bad) for scheme in BASELINES_WITH_MEMORY
                                         for bad in ("inf", "nan", "fp16 overflow")
                                         if (scheme, bad) != ("PowerSGD", "fp16 overflow")])  # (fp32 factors)
def test_baselines_keep_their_memory_through_a_non_finite_step(scheme, bad):
    """As ScaleCom: a non-finite step (one worker's inf or NaN, or fp16 values that overflow) reaches
    the update, leaves every worker's memory (PowerSGD: error and Q) as it was, and is counted; the
    next step is the one a run without the bad step would take (before, these schemes kept the inf
    and returned NaN at every later step)."""
    make = lambda: BASELINES_WITH_MEMORY[scheme]("float16" if bad == "fp16 overflow" else None)  # noqa: E731
    key = "error" if scheme == "PowerSGD" else "memory"
    grads = make_grads(steps=4)
    sim, _ = simulate(make(), grads[:2])
    before = sim.scheme.state["w"][key].clone()
    bad_step = [{name: g.copy() for name, g in worker.items()} for worker in grads[2]]
    bad_step[1]["w"].reshape(-1)[4] = {"inf": np.inf, "nan": np.nan, "fp16 overflow": 1e5}[bad]
    result = sim.step([[torch.from_numpy(bad_step[i][name]) for name in NAMES] for i in range(N)])
    assert not np.isfinite(result.update[0].numpy()).all()
    assert torch.equal(sim.scheme.state["w"][key], before) and sim.scheme.nonfinite_skips == 1
    after = sim.step([[torch.from_numpy(grads[3][i][name]) for name in NAMES] for i in range(N)])
    _, control = simulate(make(), grads[:2] + grads[3:])
    assert torch.equal(after.update[0], control[-1].update[0]) and sim.scheme.nonfinite_skips == 1


def test_powersgd_updates_scale_with_the_gradients():
    """``P_hat Q^T`` is linear in the gradients, warm start included: the same run on gradients
    times 1e-3 or 1e-6 applies that times the updates (an epsilon added to the column norms, as in
    the authors' code, made the small runs differ from the first steps on)."""
    grads = make_grads(steps=5)
    _, ones = simulate(PowerSGD(rank=2, min_numel=MIN_NUMEL, seed=3), grads)
    for c in (1e-3, 1e-6):
        scaled = [[{name: (g * np.float32(c)).astype(np.float32) for name, g in worker.items()} for worker in step]
                  for step in grads]
        _, small = simulate(PowerSGD(rank=2, min_numel=MIN_NUMEL, seed=3), scaled)
        for t, (a, b) in enumerate(zip(ones, small)):
            np.testing.assert_allclose(b.update[0].numpy(), c * a.update[0].numpy(), rtol=1e-3, atol=c * 1e-4,
                                       err_msg=f"scale {c}, step {t}")


@pytest.mark.parametrize("dtype,compressed", [(torch.float32, True), (torch.float16, False), (torch.bfloat16, False)])
def test_powersgd_compresses_only_where_its_factors_take_fewer_bytes(dtype, compressed):
    """An 8 x 8 matrix at rank 3: (8 + 8) 3 fp32 factors are 192 bytes, fewer than fp32's 256, more
    than the 128 of fp16 or bf16, which are therefore reduced densely."""
    sim = Simulator(PowerSGD(rank=3, min_numel=0), 2, [("w", torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype)))])
    grads = [torch.randn(8, 8, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(2)]
    result = sim.step([[g] for g in grads])
    assert result.traffic.payload() == (192 if compressed else 128)
    if not compressed:
        assert torch.equal(result.update[0], ((grads[0].float() + grads[1].float()) / 2).to(dtype))


def test_scalecom_overlap_and_residue_diagnostics():
    grads = make_grads(shared=0.5)
    beta, k = 0.5, 6
    _, results = simulate(ScaleCom(ratio=0.2, beta=beta, min_numel=MIN_NUMEL), grads)
    memory = [np.zeros(30) for _ in range(N)]
    overlaps, norms = [], []
    for t in range(STEPS):
        p = [m + g for m, g in zip(memory, flat(grads, t, "w"))]
        chosen = top_k(p[t % N], k)
        true = top_k(np.mean(p, axis=0), k)
        overlaps.append(len(set(chosen) & set(true)) / k)
        for i in range(N):
            sent = np.zeros(30)
            sent[chosen] = p[i][chosen]
            memory[i] = (1 - beta) * memory[i] + beta * (p[i] - sent)
        norms.append(np.mean([np.linalg.norm(m) for m in memory]))
    got = [r.diagnostics["overlap"] for r in results]
    assert got == pytest.approx(overlaps)
    assert [r.diagnostics["overlap_by_tensor"]["w"] for r in results] == pytest.approx(overlaps)
    assert 0 < min(overlaps) < 1  # the data is such that the leader's choice is imperfect
    assert [r.diagnostics["residue_norm"] for r in results] == pytest.approx(norms, rel=1e-5)


def test_scalecom_with_identical_workers_is_global_top_k():
    """Identical gradients: the leader's top-k is the global one (overlap 1), updates coincide."""
    grads = [[g[0]] * N for g in make_grads()]
    _, clt = simulate(ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL), grads)
    _, ideal = simulate(GlobalTopK(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL), grads)
    for a, b in zip(clt, ideal):
        assert a.diagnostics["overlap"] == 1.0
        torch.testing.assert_close(a.update, b.update, rtol=0, atol=0)


# -- ScaleCom's health check and dense fallback ---------------------------------------------------------

HEALTH_STEPS = 12


def health_grads(n, seed=0):
    """Steps 0-2 (and 8-9) "disjoint": worker i's gradient lives on its own block of w, the leader's
    (t mod n) 100x smaller, so its top-k misses the sum's; the other steps identical and large, so
    that the leader's top-k is the sum's. With check_every=2, patience=2, min_captured=0.9: checks at
    0 and 2 are low (fallback from step 3), at 4 and 6 good (compressed again from step 7), 8 low."""
    rng = np.random.RandomState(seed)
    numel = math.prod(SHAPES["w"])
    blocks = np.array_split(np.arange(numel), n)
    out = []
    for t in range(HEALTH_STEPS):
        if t in (0, 1, 2, 8, 9):
            step = []
            for i in range(n):
                w = np.zeros(numel, np.float32)
                w[blocks[i]] = rng.randn(len(blocks[i])) * (0.01 if i == t % n else 1.0)
                step.append({"w": w.reshape(SHAPES["w"]), "b": rng.randn(4).astype(np.float32)})
        else:
            common = (10 * rng.randn(numel)).astype(np.float32).reshape(SHAPES["w"])
            step = [{"w": common.copy(), "b": rng.randn(4).astype(np.float32)} for _ in range(n)]
        out.append(step)
    return out


HEALTH = dict(check_every=2, fallback="dense", min_captured=0.9, patience=2)


@pytest.mark.filterwarnings("ignore:ScaleCom's health check")
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("beta, value_dtype", [(0.5, None), (1.0, None), (0.3, "float16")])
def test_scalecom_health_check_and_dense_fallback_match_the_reference(n, beta, value_dtype):
    """Compressed -> check -> fallback (dense) -> check while dense -> back to compressed: the updates,
    memories, per-step health figures, decisions and byte counts against ``scalecom_reference``."""
    grads = health_grads(n)
    scheme = ScaleCom(ratio=0.2, beta=beta, min_numel=MIN_NUMEL, value_dtype=value_dtype, **HEALTH)
    sim, results = simulate(scheme, grads, n=n)
    log = []
    applied, memories = scalecom_reference(grads, NAMES, n, 0.2, beta, 0, MIN_NUMEL,
                                           value_dtype=np.float16 if value_dtype else np.float32,
                                           health_log=log, **HEALTH)
    tol = dict(rtol=2e-3, atol=2e-3) if value_dtype else {}
    assert_updates(results, applied, **tol)
    for i in range(n):
        np.testing.assert_allclose(sim.scheme.state["w"]["memory"][i].numpy(), memories[i]["w"],
                                   rtol=1e-5, atol=1e-5)
    # the run really went through every phase
    dense_after = {t: dense for t, name, *_, dense in log}
    assert dense_after == {0: False, 2: True, 4: True, 6: False, 8: False, 10: False}
    sends_dense = [False] * 3 + [True] * 4 + [False] * 5  # from the step after the deciding check
    for t, result in enumerate(results):
        diagnostics = result.diagnostics
        assert diagnostics["health_dense_tensors"] == int((sends_dense[1:] + [False])[t]), t
        assert ("health_captured" in diagnostics) == (t % 2 == 0)
        nonzero = np.count_nonzero(result.update[0].numpy())
        assert nonzero == (30 if sends_dense[t] else 6), t  # dense steps apply every entry
    for t, _name, hits, k, selected, topk, _total, _dense in log:
        got = results[t].diagnostics
        assert got["health_overlap"] == pytest.approx(hits / k)
        assert got["health_captured"] == pytest.approx(selected / topk, rel=1e-3 if value_dtype else 1e-6)
        assert got["health_by_tensor"]["w"]["captured"] == pytest.approx(got["health_captured"])
    summary = sim.scheme.health_summary()
    last = log[-1]
    assert summary["checks"] == len(log) == 6 and summary["dense_steps"] == 4 and summary["dense_tensors"] == 0
    assert summary["captured"] == pytest.approx(last[4] / last[5], rel=1e-3 if value_dtype else 1e-6)
    assert summary["selected_share"] == pytest.approx(last[4] / last[6], rel=1e-3 if value_dtype else 1e-6)
    # bytes per worker: a check sends k indices and p densely; a fallback step p densely, no indices
    itemsize = 2 if value_dtype else 4
    for t, result in enumerate(results):
        checked, dense = t % 2 == 0, sends_dense[t]
        traffic = result.traffic
        assert traffic.payload("index") == (0 if dense and not checked else 6 * 4), t
        assert traffic.payload("value") == (30 * itemsize if checked else 0 if dense else 6 * itemsize), t
        assert traffic.payload("dense") == 4 * 4 + (30 * itemsize if dense and not checked else 0), t
    totals = sim.totals()
    assert totals["sent_bytes"] == pytest.approx(sum(r.traffic.sent_bytes() for r in results))


def test_scalecom_health_check_alone_trains_as_plain_scalecom():
    """Without a fallback the checks only report: the same updates and memories as plain ScaleCom,
    one dense value allreduce in check_every steps, and the warning once when the checks stay low."""
    grads = health_grads(3)
    with pytest.warns(UserWarning, match="health check") as caught:
        checked, results = simulate(ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL, check_every=2,
                                             min_captured=0.9, patience=2), grads, n=3)
    assert len([w for w in caught if "health check" in str(w.message)]) == 1
    plain, control = simulate(ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL), grads, n=3)
    for a, b in zip(results, control):
        torch.testing.assert_close(a.update, b.update, rtol=0, atol=0)
    assert torch.equal(checked.scheme.state["w"]["memory"], plain.scheme.state["w"]["memory"])
    assert checked.scheme.health_summary()["dense_steps"] == 0
    assert [r.traffic.payload("value") for r in results[:4]] == [120, 24, 120, 24]
    assert "health" not in plain.scheme.describe() and plain.scheme.health_summary() is None
    assert not any(k.startswith("health") for r in control for k in r.diagnostics)


@pytest.mark.filterwarnings("ignore:ScaleCom's health check")
def test_scalecom_health_state_round_trip_mid_fallback():
    """A state saved while a tensor falls back continues as the uninterrupted run does."""
    grads = health_grads(2)
    make = lambda: ScaleCom(ratio=0.2, beta=0.5, min_numel=MIN_NUMEL, **HEALTH)  # noqa: E731
    uninterrupted, whole = simulate(make(), grads, n=2)
    first, _ = simulate(make(), grads[:4], n=2)
    assert first.scheme.monitor.sends_dense("w")
    resumed = Simulator(make(), 2, named_params())
    resumed.load_state_dict(first.state_dict())
    rest = [resumed.step([[torch.from_numpy(g[i][name]) for name in NAMES] for i in range(2)]) for g in grads[4:]]
    for a, b in zip(rest, whole[4:]):
        torch.testing.assert_close(a.update, b.update, rtol=0, atol=0)
    assert resumed.scheme.health_summary() == uninterrupted.scheme.health_summary()
    state = first.state_dict()
    state["scheme"]["extra"]["health"]["w"]["dense"] = "yes"
    with pytest.raises(ValueError, match="malformed"):
        Simulator(make(), 2, named_params()).load_state_dict(state)


@pytest.mark.parametrize("options, argument", [
    (dict(check_every=0), "check_every"), (dict(fallback="dense"), "check_every"),
    (dict(check_every=2, fallback="sparse"), "fallback"), (dict(check_every=2, min_captured=1.5), "min_captured"),
    (dict(check_every=2, patience=0), "patience"),
    (dict(check_every=2, fallback="dense", pipelined=True), "pipelined")])
def test_scalecom_health_options_are_checked(options, argument):
    with pytest.raises(ValueError, match=argument):
        ScaleCom(**options)


# -- top-k baselines -----------------------------------------------------------------------------------

def ef_reference(grads, k, beta, choose):
    """Error feedback around any index choice: ``choose(p, t) -> per-worker index arrays``."""
    memory = [np.zeros(30) for _ in range(N)]
    applied = []
    for t in range(STEPS):
        p = [m + g for m, g in zip(memory, flat(grads, t, "w"))]
        chosen = choose(p, t)
        update = np.zeros(30)
        for i in range(N):
            sent = np.zeros(30)
            sent[chosen[i]] = p[i][chosen[i]]
            update += sent / N
            memory[i] = (1 - beta) * memory[i] + beta * (p[i] - sent)
        applied.append({"w": update, "b": np.mean([g["b"] for g in grads[t]], axis=0)})
    return applied, memory


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_local_top_k(beta):
    grads = make_grads()
    sim, results = simulate(LocalTopK(ratio=0.2, beta=beta, min_numel=MIN_NUMEL), grads)
    applied, memory = ef_reference(grads, 6, beta, lambda p, t: [top_k(pi, 6) for pi in p])
    assert_updates(results, applied)
    assert_memory(sim, memory)
    # Each worker its own indices: the union is larger than k.
    assert np.count_nonzero(results[0].update[0].numpy()) > 6


def test_global_top_k():
    grads = make_grads()
    sim, results = simulate(GlobalTopK(ratio=0.2, min_numel=MIN_NUMEL), grads)
    applied, memory = ef_reference(grads, 6, 1.0, lambda p, t: [top_k(np.mean(p, axis=0), 6)] * N)
    assert_updates(results, applied)
    assert_memory(sim, memory)


def test_random_k_shared_seed():
    grads = make_grads()
    sim, results = simulate(RandomK(ratio=0.2, min_numel=MIN_NUMEL, seed=7), grads)
    draws = [shared_random_indices(30, 6, 7, t, 0).numpy() for t in range(STEPS)]
    applied, memory = ef_reference(grads, 6, 1.0, lambda p, t: [draws[t]] * N)
    assert_updates(results, applied)
    assert_memory(sim, memory)
    for t, r in enumerate(results):
        assert set(np.flatnonzero(r.update[0].numpy().reshape(-1))) <= set(draws[t])
    assert len({tuple(sorted(d)) for d in draws}) == STEPS  # a new draw every step


def test_random_k_indices_agree_across_workers_without_touching_global_rng():
    """Each worker computes the indices on its own, with its own RNG history: same set everywhere."""
    per_worker = []
    for worker in range(8):
        torch.manual_seed(1000 + worker)  # every worker's global RNG in a different state
        torch.rand(worker + 1)
        before = torch.get_rng_state()
        per_worker.append(shared_random_indices(10_000, 100, seed=3, step=5, tensor_index=2))
        assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(per_worker[0], w) for w in per_worker)
    assert per_worker[0].unique().numel() == 100
    assert not torch.equal(per_worker[0], shared_random_indices(10_000, 100, seed=3, step=6, tensor_index=2))
    assert not torch.equal(per_worker[0], shared_random_indices(10_000, 100, seed=3, step=5, tensor_index=1))


def gtopk_reference(grads, k):
    """Shi et al.'s tree: sets as {index: (summed value, contributing workers)}, merged pairwise."""
    memory = [np.zeros(30) for _ in range(N)]
    applied = []
    for t in range(STEPS):
        p = [m + g for m, g in zip(memory, flat(grads, t, "w"))]
        sets = [{int(j): (p[i][j], {i}) for j in top_k(p[i], k)} for i in range(N)]
        while len(sets) > 1:
            merged = []
            for a, b in zip(sets[0::2], sets[1::2]):
                union = dict(a)
                for j, (v, who) in b.items():
                    v0, w0 = union.get(j, (0.0, set()))
                    union[j] = (v0 + v, w0 | who)
                kept = sorted(union, key=lambda j: -abs(union[j][0]))[:k]
                merged.append({j: union[j] for j in kept})
            sets = merged
        update = np.zeros(30)
        for j, (v, _) in sets[0].items():
            update[j] = v / N
        for i in range(N):
            memory[i] = p[i].copy()
            for j, (_, who) in sets[0].items():
                if i in who:
                    memory[i][j] = 0.0  # worker i's value reached the global sum
        applied.append({"w": update, "b": np.mean([g["b"] for g in grads[t]], axis=0)})
    return applied, memory


def test_gtopk():
    grads = make_grads(shared=0.3)
    sim, results = simulate(GTopK(ratio=0.2, min_numel=MIN_NUMEL), grads)
    applied, memory = gtopk_reference(grads, 6)
    assert_updates(results, applied)
    assert_memory(sim, memory)
    # Some contributions were dropped in intermediate merges of indices that still made the final set.
    assert any(r.diagnostics["contributed_by_tensor"]["w"] < 1.0 for r in results)


def test_gtopk_needs_power_of_two_workers():
    with pytest.raises(ValueError, match="power-of-two"):
        Simulator(GTopK(), 3, named_params())


# -- Sketched SGD ----------------------------------------------------------------------------------------

def sketched_reference(grads, k, candidates, rows, columns, rho, seed):
    buckets, signs = CountSketch(30, rows, columns, seed=seed).hashes(torch.arange(30))
    buckets, signs = buckets.numpy(), signs.numpy().astype(np.float64)
    u, v = np.zeros((N, 30)), np.zeros((N, 30))
    u_b = np.zeros((N, 4))
    applied = []
    for t in range(STEPS):
        g = np.array(flat(grads, t, "w"))
        u = rho * u + g
        v = v + u
        S = np.zeros((rows, columns))
        for i in range(N):                       # round 1: each worker's sketch, summed
            for j in range(rows):
                np.add.at(S[j], buckets[j], signs[j] * v[i])
        estimate = np.median([signs[j] * S[j, buckets[j]] for j in range(rows)], axis=0)
        cand = top_k(estimate, candidates * k)
        exact = v[:, cand].sum(axis=0)           # round 2: exact sums of the candidates
        top = top_k(exact, k)
        chosen = cand[top]
        update = np.zeros(30)
        update[chosen] = exact[top] / N
        u[:, chosen] = 0.0
        v[:, chosen] = 0.0
        u_b = rho * u_b + np.array([gi["b"] for gi in grads[t]])
        applied.append({"w": update, "b": u_b.mean(axis=0)})
    return applied, v


def test_sketched_sgd():
    grads = make_grads()
    scheme = SketchedSGD(ratio=0.1, rows=3, columns=16, candidates=2, momentum=0.9, min_numel=MIN_NUMEL,
                         seed=4)
    sim, results = simulate(scheme, grads)
    applied, v = sketched_reference(grads, 3, 2, 3, 16, 0.9, seed=4)
    assert_updates(results, applied)
    np.testing.assert_allclose(sim.scheme._v.numpy(), v, rtol=1e-5, atol=1e-5)
    assert [r.diagnostics["residue_norm"] for r in results][-1] == pytest.approx(
        np.mean(np.linalg.norm(v, axis=1)), rel=1e-5)


def test_sketched_sgd_keeps_float64_gradients_in_float64():
    """As on Horovod (``SketchedSGD`` keeps u and v in ``memory_dtype``): float64 sums, 8-byte sketch."""
    grads = [[{name: g[name].astype(np.float64) for name in NAMES} for g in step] for step in make_grads()]
    params = {name: np.zeros(shape, np.float64) for name, shape in SHAPES.items()}
    scheme = SketchedSGD(ratio=0.1, rows=3, columns=16, candidates=2, momentum=0.9, min_numel=MIN_NUMEL,
                         seed=4)
    sim, results = simulate(scheme, grads, params=params)
    applied, v = sketched_reference(grads, 3, 2, 3, 16, 0.9, seed=4)
    assert sim.scheme._v.dtype == torch.float64
    assert_updates(results, applied, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sim.scheme._v.numpy(), v, rtol=1e-12, atol=1e-12)
    sent = {c.tensor: c.nbytes for c in results[-1].traffic.collectives}
    assert (sent["sketch"], sent["candidates"]) == (3 * 16 * 8, 2 * 3 * 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sketched_sgd_sends_dense_momentum_in_the_gradients_wire_dtype(dtype):
    """As the Horovod compressor: a dense tensor's (and, in warm-up, a sketched one's) momentum u_i is
    cast to the gradient's wire dtype (fp16; bf16 travels as fp32), then averaged: fp16 values summed
    beyond 65,504 are Inf."""
    sim = Simulator(SketchedSGD(ratio=0.1, momentum=0.9, warmup_steps=2, min_numel=16), N,
                    [("w", torch.nn.Parameter(torch.zeros(8, 8, dtype=dtype))),
                     ("b", torch.nn.Parameter(torch.zeros(64, dtype=dtype)))])
    gen = torch.Generator().manual_seed(0)
    u = torch.zeros(N, 128)
    for _ in range(2):  # warm-up: both tensors dense
        g = (torch.randn(N, 128, generator=gen) * 3).to(dtype)
        result = sim.step_stacked([g[:, :64].reshape(N, 8, 8), g[:, 64:]])
        u = 0.9 * u + g.float()
        sent = u.half() if dtype == torch.float16 else u
        want = ((sent.float().sum(dim=0)) / N).to(sent.dtype).to(dtype)
        assert torch.equal(result.update[0].reshape(-1), want[:64])
        assert torch.equal(result.update[1], want[64:])
    big = sim.step_stacked([torch.zeros(N, 8, 8, dtype=dtype), torch.full((N, 64), 4e4).to(dtype)]).update[1]
    assert torch.isposinf(big).all() == (dtype == torch.float16)
    if dtype == torch.bfloat16:
        assert torch.equal(big, ((0.9 * u[:, 64:] + 4e4).sum(dim=0) / N).to(dtype))


def test_sketched_sgd_warm_up_sends_mixed_dtype_matrices_together_in_their_promoted_dtype():
    """As the Horovod compressor, which reduces the sketched tensors' u whole in their promoted dtype: an
    fp16 matrix beside an fp32 one travels (and is counted) as fp32, so 4 x 40,000 sums to no Inf."""
    sim = Simulator(SketchedSGD(ratio=0.1, momentum=0.9, warmup_steps=1, min_numel=16), N,
                    [("h", torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.float16))),
                     ("f", torch.nn.Parameter(torch.zeros(8, 8)))])
    result = sim.step_stacked([torch.full((N, 8, 8), 4e4).half(), torch.ones(N, 8, 8)])
    assert torch.equal(result.update[0], torch.full((8, 8), 4e4).half())
    assert [(c.tensor, c.nbytes, c.dtype) for c in result.traffic.collectives] == [
        ("h", 256, "float32"), ("f", 256, "float32")]


def test_count_sketch_is_linear_and_finds_heavy_hitters():
    cs = CountSketch(5000, rows=5, columns=200, seed=1)
    gen = torch.Generator().manual_seed(0)  # (unseeded, the estimate missed atol in 22 of 30,000 draws)
    a, b = (torch.randn(5000, dtype=torch.float64, generator=gen) for _ in range(2))
    torch.testing.assert_close(cs.sketch(a + b), cs.sketch(a) + cs.sketch(b))
    stacked = torch.stack([a, b])
    torch.testing.assert_close(cs.sketch(stacked).sum(dim=0), cs.sketch(a + b))
    heavy = torch.randn(5000, generator=gen) * 0.01
    heavy[[17, 999, 4321]] = torch.tensor([50.0, -40.0, 30.0])
    estimate = cs.estimate(cs.sketch(heavy))
    assert set(torch.topk(estimate.abs(), 3).indices.tolist()) == {17, 999, 4321}
    torch.testing.assert_close(estimate[[17, 999, 4321]], heavy[[17, 999, 4321]], atol=0.1, rtol=0)


def test_count_sketch_hashes_are_computed_not_stored():
    cs = CountSketch(5000, rows=4, columns=37, seed=3)
    tensors = [t for t in vars(cs).values() if isinstance(t, torch.Tensor)]
    assert sum(t.numel() for t in tensors) == 3 * 4  # three seeds per row, nothing per coordinate
    buckets, signs = cs.hashes(torch.arange(5000))
    assert buckets.shape == signs.shape == (4, 5000) and buckets.dtype == signs.dtype == torch.int64
    assert int(buckets.min()) >= 0 and int(buckets.max()) < 37 and set(signs.unique().tolist()) == {-1, 1}
    counts = torch.stack([torch.bincount(b, minlength=37) for b in buckets]).double()
    assert float((counts - 5000 / 37).abs().max()) < 6 * math.sqrt(5000 / 37)  # spread over all columns
    assert float(signs.double().mean(dim=1).abs().max()) < 0.1
    # The same hashes for any subset of indices, and whatever chunks sketch() and estimate() hash in.
    some = torch.tensor([4999, 0, 1234, 1234])
    assert all(torch.equal(a, b[:, some]) for a, b in zip(cs.hashes(some), (buckets, signs)))
    v = torch.randn(2, 5000, dtype=torch.float64)
    table = cs.sketch(v)
    estimate = cs.estimate(table)
    cs.chunk = 77
    assert torch.equal(cs.sketch(v), table) and torch.equal(cs.estimate(table), estimate)
    again = CountSketch(5000, rows=4, columns=37, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(again.hashes(torch.arange(5000)), (buckets, signs)))
    # Beyond 2**30 coordinates the high limb enters the hash; a sketch of 2**40 costs no memory.
    huge = CountSketch(2**40, rows=2, columns=1000, seed=3)
    index = torch.tensor([0, 1, 2**30, 2**30 + 1, 2**40 - 1])
    huge_buckets, _ = huge.hashes(index)
    assert int(huge_buckets.min()) >= 0 and int(huge_buckets.max()) < 1000
    assert not torch.equal(huge_buckets[:, :2], huge_buckets[:, 2:4])
    with pytest.raises(ValueError, match="at least 1 and fewer than 2\\*\\*60 coordinates, got 0"):
        CountSketch(0, rows=2, columns=10)  # (nothing to sketch: sketch() could not shape its table)


@pytest.mark.parametrize("make, error, argument", [
    (lambda: SketchedSGD(ratio=0), ValueError, "ratio"),
    (lambda: SketchedSGD(rows=0), ValueError, "rows"),
    (lambda: SketchedSGD(rows=2), ValueError, "rows must be odd"),
    (lambda: SketchedSGD(rows=2.5), TypeError, "rows"),
    (lambda: SketchedSGD(columns=0), ValueError, "columns"),
    (lambda: SketchedSGD(candidates=0), ValueError, "candidates"),
    (lambda: SketchedSGD(momentum=1.0), ValueError, "momentum"),
    (lambda: SketchedSGD(seed=-1), ValueError, "seed"),
    (lambda: QsparseLocalSGD(0.1, local_steps=0), ValueError, "local_steps"),
    (lambda: QsparseLocalSGD(0.1, local_steps=2.0), TypeError, "local_steps"),
    (lambda: QsparseLocalSGD(0.1, ratio=0), ValueError, "ratio"),
    (lambda: QsparseLocalSGD(0.1, max_k=0), ValueError, "max_k"),
    (lambda: QsparseLocalSGD(0.1, operator="sign"), ValueError, "operator"),
    (lambda: QsparseLocalSGD(0.1, levels=0), ValueError, "levels"),
    (lambda: QsparseLocalSGD(0.1, min_numel=-1), ValueError, "min_numel"),
])
def test_sketched_and_qsparse_settings_are_checked_like_on_horovod(make, error, argument):
    with pytest.raises(error, match=argument):
        make()


# -- Qsparse-local-SGD -----------------------------------------------------------------------------------

def qsparse_reference(grads, x0, lr, H, k, operator, levels, momentum, seed):
    generator = torch.Generator().manual_seed(seed)
    x = {n: [x0[n].reshape(-1).astype(np.float64).copy() for _ in range(N)] for n in NAMES}
    shared = {n: x0[n].reshape(-1).astype(np.float64).copy() for n in NAMES}
    memory = {n: [np.zeros(x0[n].size) for _ in range(N)] for n in NAMES}
    buf = {n: [np.zeros(x0[n].size) for _ in range(N)] for n in NAMES}
    changes, local = [], []
    for t in range(len(grads)):
        for n in NAMES:
            for i in range(N):
                buf[n][i] = momentum * buf[n][i] + grads[t][i][n].reshape(-1)
                x[n][i] = x[n][i] - lr * buf[n][i]
        change = {n: np.zeros(x0[n].size) for n in NAMES}
        if (t + 1) % H == 0:
            for n in NAMES:
                if x0[n].size < MIN_NUMEL:
                    change[n] = np.mean(x[n], axis=0) - shared[n]
                else:
                    kept = []
                    chosen = []
                    for i in range(N):
                        delta = memory[n][i] + x[n][i] - shared[n]
                        chosen.append(np.sort(top_k(delta, k)))  # noise goes in index order
                        kept.append(delta[chosen[i]])
                        memory[n][i] = delta
                    kept = np.array(kept)
                    if operator == "top_k":
                        c = kept
                    elif operator == "sign_top_k":
                        c = np.abs(kept).sum(axis=1, keepdims=True) / k * np.sign(kept)
                    else:
                        noise = torch.rand(N, k, generator=generator).numpy()
                        norm = np.linalg.norm(kept, axis=1, keepdims=True)
                        scaled = np.abs(kept) / norm * levels
                        xi = np.floor(scaled) + (noise < scaled - np.floor(scaled))
                        beta = min(k / levels**2, math.sqrt(k) / levels)
                        c = norm * np.sign(kept) * xi / levels / (1 + beta)
                    for i in range(N):
                        memory[n][i][chosen[i]] -= c[i]           # m_i = delta_i - c_i
                        change[n][chosen[i]] += c[i] / N          # mean_i c_i
                shared[n] = shared[n] + change[n]
                x[n] = [shared[n].copy() for _ in range(N)]
        changes.append(change)
        local.append({n: np.array(x[n]) for n in NAMES})
    return changes, local, memory


@pytest.mark.parametrize("operator, momentum", [("top_k", 0.0), ("sign_top_k", 0.9), ("qsgd_top_k", 0.0)])
def test_qsparse_local_sgd(operator, momentum):
    grads = make_grads(steps=7)
    rng = np.random.RandomState(5)
    x0 = {n: rng.randn(*s).astype(np.float32) for n, s in SHAPES.items()}
    scheme = QsparseLocalSGD(lr=0.1, local_steps=3, ratio=0.2, operator=operator, levels=4,
                             momentum=momentum, min_numel=MIN_NUMEL, seed=9)
    sim = Simulator(scheme, N, named_params(x0))
    changes, local, memory = qsparse_reference(grads, x0, 0.1, 3, 6, operator, 4, momentum, seed=9)
    for t, g in enumerate(grads):
        before = [p.clone() for p in sim.worker_params()]
        result = sim.step([[torch.from_numpy(g[i][n]) for n in NAMES] for i in range(N)])
        assert result.kind == "model" and result.diagnostics["synced"] == ((t + 1) % 3 == 0)
        for n, u, p in zip(NAMES, result.update, sim.worker_params()):
            np.testing.assert_allclose(u.numpy().reshape(-1), changes[t][n], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {t}, {n}")
            np.testing.assert_allclose(p.numpy().reshape(N, -1), local[t][n], rtol=1e-5, atol=1e-6)
        if not result.diagnostics["synced"]:
            assert all(not torch.equal(a, b) for a, b in zip(before, sim.worker_params()))
            assert not torch.equal(sim.worker_params()[0][0], sim.worker_params()[0][1])  # models drift apart
    assert_memory(sim, memory["w"])


def test_quantizers_literal_values():
    from hvd_scalecom.torch.quantize import qsgd, qsgd_scale, qsgd_top_k, sign_top_k

    v = torch.tensor([[3.0, -4.0, 0.0, 1.0]])
    torch.testing.assert_close(sign_top_k(v), torch.tensor([[2.0, -2.0, 0.0, 2.0]]))  # ||v||_1 / k = 2
    # ||v||_2 = sqrt(26); s = 2 levels: s|v|/||v|| = [1.177, 1.569, 0, 0.392]
    noise = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    norm = math.sqrt(26.0)
    expected = torch.tensor([[norm * 1 / 2, -norm * 2 / 2, 0.0, 0.0]])
    torch.testing.assert_close(qsgd(v, 2, noise), expected)
    assert qsgd_scale(4, 2) == pytest.approx(1 / (1 + min(4 / 4, 2 / 2)))
    assert qsgd_scale(100, 256) == pytest.approx(1 / (1 + 100 / 256**2))
    torch.testing.assert_close(qsgd_top_k(v, 2, noise), expected * 0.5)
    # QSGD is unbiased: the mean over many noise draws approaches v.
    draws = torch.rand(20000, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qsgd(v.expand(20000, 4), 2, draws).mean(dim=0), v[0], atol=0.06, rtol=0)


# -- PowerSGD --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [1, 2])
def test_powersgd(rank):
    grads = make_grads()
    sim, results = simulate(PowerSGD(rank=rank, min_numel=MIN_NUMEL, seed=3), grads)
    Q = torch.randn(5, rank, generator=torch.Generator().manual_seed(3 * 100_003 + 0)).double().numpy()
    error = np.zeros((N, 6, 5))
    for t, result in enumerate(results):
        M = np.array([g["w"] for g in grads[t]], dtype=np.float64) + error
        P = np.mean([M[i] @ Q for i in range(N)], axis=0)
        P_hat = np.linalg.qr(P)[0]                      # same column space as Gram-Schmidt
        Q = np.mean([M[i].T @ P_hat for i in range(N)], axis=0)
        approx = P_hat @ Q.T
        error = M - approx
        np.testing.assert_allclose(result.update[0].numpy(), approx, rtol=1e-4, atol=1e-5,
                                   err_msg=f"step {t}")
        np.testing.assert_allclose(result.update[1].numpy(), np.mean([g["b"] for g in grads[t]], axis=0),
                                   rtol=1e-6)
        assert np.linalg.matrix_rank(result.update[0].numpy(), tol=1e-4) == rank
    np.testing.assert_allclose(sim.scheme.state["w"]["error"].numpy().reshape(N, 6, 5), error,
                               rtol=1e-4, atol=1e-5)
    assert results[-1].diagnostics["residue_norm"] == pytest.approx(
        np.mean(np.linalg.norm(error.reshape(N, -1), axis=1)), rel=1e-4)


def test_powersgd_keeps_its_q_through_an_all_zero_gradient():
    """A step whose gradients are all zero (a zero-initialised layer's first step) would make Q zero, and
    M Q zero at every later step: Q is kept from before it, and the later steps compress as usual."""
    zero = [{name: np.zeros(shape, np.float32) for name, shape in SHAPES.items()} for _ in range(N)]
    grads = [zero] + make_grads(steps=3)
    _, results = simulate(PowerSGD(rank=2, min_numel=MIN_NUMEL, seed=3), grads)
    Q = torch.randn(5, 2, generator=torch.Generator().manual_seed(3 * 100_003)).double().numpy()
    assert not results[0].update[0].any()
    error = 0.0  # no error fed back from the zero step
    for t, result in enumerate(results[1:], 1):
        M = np.array([g["w"] for g in grads[t]], dtype=np.float64) + error
        P_hat = np.linalg.qr(np.mean([M[i] @ Q for i in range(N)], axis=0))[0]
        Q = np.mean([M[i].T @ P_hat for i in range(N)], axis=0)
        approx = P_hat @ Q.T
        error = M - approx
        np.testing.assert_allclose(result.update[0].numpy(), approx, rtol=1e-4, atol=1e-5, err_msg=f"step {t}")
        assert np.linalg.matrix_rank(result.update[0].numpy(), tol=1e-4) == 2


def test_powersgd_on_float64_gradients_keeps_float64_factors():
    grads = [[{name: g.astype(np.float64) for name, g in worker.items()} for worker in step]
             for step in make_grads(steps=2)]
    params = [(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))) for name, shape in SHAPES.items()]
    sim = Simulator(PowerSGD(rank=1, min_numel=MIN_NUMEL, seed=3), N, params)
    Q = torch.randn(5, 1, generator=torch.Generator().manual_seed(3 * 100_003)).double().numpy()
    M = np.array([g["w"] for g in grads[0]])
    P_hat = np.linalg.qr(np.mean([M[i] @ Q for i in range(N)], axis=0))[0]
    approx = P_hat @ np.mean([M[i].T @ P_hat for i in range(N)], axis=0).T
    result = sim.step([[torch.from_numpy(g[name]) for name in NAMES] for g in grads[0]])
    assert result.update[0].dtype == torch.float64
    np.testing.assert_allclose(result.update[0].numpy(), approx, rtol=1e-12, atol=1e-14)
    assert result.traffic.payload() == 8 * (6 + 5) + 8 * 4  # the factors and the dense bias
    sim.step([[torch.from_numpy(g[name]) for name in NAMES] for g in grads[1]])


@pytest.mark.parametrize("make", [lambda: ScaleCom(ratio=0.2, min_numel=0), lambda: LocalTopK(ratio=0.2, min_numel=0),
                                  lambda: QsparseLocalSGD(lr=0.1, local_steps=1, ratio=0.2, min_numel=0),
                                  lambda: SketchedSGD(ratio=0.2, min_numel=0)],
                         ids=["ScaleCom", "LocalTopK", "QsparseLocalSGD", "SketchedSGD"])
def test_an_empty_parameter_is_reduced_densely_even_with_min_numel_0(make):
    params = [("w", torch.nn.Parameter(torch.zeros(6, 5))), ("empty", torch.nn.Parameter(torch.zeros(0, 5)))]
    sim = Simulator(make(), N, params)
    grads = make_grads(steps=2)
    for g in grads:
        result = sim.step([[torch.from_numpy(g[i]["w"]), torch.zeros(0, 5)] for i in range(N)])
        assert result.update[1].numel() == 0 and np.isfinite(result.update[0].numpy()).all()


def test_powersgd_orthogonalise_gives_orthonormal_columns():
    from hvd_scalecom.torch.powersgd import orthogonalise_

    P = torch.randn(3, 20, 4, dtype=torch.float64)  # a batch of three 20 x 4 matrices
    orthogonalise_(P)
    torch.testing.assert_close(P.transpose(-1, -2) @ P, torch.eye(4, dtype=torch.float64).expand(3, 4, 4),
                               atol=1e-7, rtol=0)
