"""The Simulator's API: inputs, checkpoints, local models, vectorised gradients, training, cost at n = 64."""

import dataclasses
import io
import time

import numpy as np
import pytest
import torch

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
    per_worker_gradients,
)


def mlp(sizes, seed=0):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def all_schemes(min_numel=64):
    return [Dense(), FP16(), ScaleCom(ratio=0.1, beta=0.5, min_numel=min_numel),
            ScaleCom(ratio=0.1, beta=1.0, min_numel=min_numel, leader="staggered"),
            LocalTopK(ratio=0.1, min_numel=min_numel), GlobalTopK(ratio=0.1, min_numel=min_numel),
            GTopK(ratio=0.1, min_numel=min_numel), RandomK(ratio=0.1, min_numel=min_numel),
            SketchedSGD(ratio=0.1, min_numel=min_numel), PowerSGD(rank=2, min_numel=min_numel),
            QsparseLocalSGD(lr=0.1, local_steps=2, ratio=0.1, operator="qsgd_top_k", levels=8)]


def stacked_grads(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, *p.shape, generator=g) for p in model.parameters()]


def test_lists_and_stacked_inputs_agree_and_missing_gradients_are_zeros():
    model = mlp([5, 7, 3])
    grads = stacked_grads(model, 4, 0)
    a = Simulator(LocalTopK(ratio=0.3, min_numel=0), 4, model.named_parameters())
    b = Simulator(LocalTopK(ratio=0.3, min_numel=0), 4, model.named_parameters())
    for _ in range(3):
        ra = a.step_stacked(grads)
        rb = b.step([[g[i] for g in grads] for i in range(4)])
        torch.testing.assert_close(ra.update, rb.update, rtol=0, atol=0)
    dense = Simulator(Dense(), 4, model.named_parameters())
    per_worker = [[g[i] for g in grads] for i in range(4)]
    per_worker[2][1] = None  # worker 2 has no gradient for the first bias
    result = dense.step(per_worker)
    torch.testing.assert_close(result.update[1], (grads[1].sum(0) - grads[1][2]) / 4)
    assert [u.shape for u in result.update] == [p.shape for p in model.parameters()]


def test_bad_inputs_are_refused():
    model = mlp([5, 7, 3])
    with pytest.raises(TypeError):
        Simulator(object(), 4, model.named_parameters())
    with pytest.raises(ValueError):
        Simulator(Dense(), 0, model.named_parameters())
    sim = Simulator(Dense(), 4, model.named_parameters())
    with pytest.raises(ValueError, match="4 workers"):
        sim.step([[p.detach() for p in model.parameters()]] * 3)
    with pytest.raises(ValueError, match="shape"):
        sim.step_stacked([torch.zeros(3, *p.shape) for p in model.parameters()])
    with pytest.raises(TypeError):
        sim.step_stacked([torch.zeros(4, *p.shape, dtype=torch.int64) for p in model.parameters()])
    # Simulator.step checks each worker's gradient before stacking them (where torch would promote an
    # int64 gradient, or fail naming neither parameter nor worker)
    rows = [[p.detach().clone() for p in model.parameters()] for _ in range(4)]
    for worker, g, error, text in ((2, torch.zeros(5, 7), ValueError, r"'0.weight' from worker 2 has shape \(5, 7\)"),
                                   (1, torch.zeros(7, 5, dtype=torch.int64), TypeError, "worker 1 is torch.int64"),
                                   (3, torch.zeros(7, 5, dtype=torch.float64), TypeError,
                                    "worker 3 is torch.float64, expected the parameter's dtype, torch.float32"),
                                   (0, [0.0] * 35, TypeError, "a tensor or None, got list")):
        with pytest.raises(error, match=text):
            sim.step([row if i != worker else [g] + row[1:] for i, row in enumerate(rows)])
    # Horovod reduces every gradient in its parameter's dtype: another (on all workers) would keep
    # memories and count bytes in it, and a checkpoint restore them in the parameter's
    with pytest.raises(TypeError, match="'0.weight' is torch.float64, expected the parameter's dtype, torch.float32"):
        sim.step_stacked([torch.zeros(4, *p.shape, dtype=torch.float64) for p in model.parameters()])
    with pytest.raises(TypeError, match="'0.weight' from worker 0 is torch.float16, expected the parameter's"):
        sim.step([[g.half() for g in row] for row in rows])
    assert sim.step_count == 0
    with pytest.raises(TypeError, match="diagnostics must be True or False"):
        Simulator(Dense(), 4, model.named_parameters(), diagnostics="no")
    local = Simulator(QsparseLocalSGD(lr=0.1, momentum=0.9), 4, model.named_parameters())
    with pytest.raises(ValueError, match="worker 1 gave no gradient of '2.bias': a local optimizer with momentum"):
        local.step([row if i != 1 else row[:3] + [None] for i, row in enumerate(rows)])
    plain = Simulator(QsparseLocalSGD(lr=0.1), 4, model.named_parameters())  # no momentum: zeros, as skipped
    plain.step([row if i != 1 else row[:3] + [None] for i, row in enumerate(rows)])
    assert torch.equal(plain.worker_params()[3][1], model[2].bias.detach())
    scheme = ScaleCom(ratio=0.2, min_numel=0)
    first = Simulator(scheme, 4, model.named_parameters())
    first.step_stacked(stacked_grads(model, 4, 0))
    memory = {name: entry["memory"].clone() for name, entry in scheme.state.items()}
    with pytest.raises(ValueError, match="already simulated by another Simulator: make a new ScaleCom"):
        Simulator(scheme, 4, model.named_parameters())
    assert all(torch.equal(scheme.state[name]["memory"], m) for name, m in memory.items())  # untouched


@pytest.mark.parametrize("index", range(11))
def test_checkpoint_round_trip_continues_identically(index):
    """6 steps straight equal 3 steps, state_dict through torch.save, a new simulator, 3 more."""
    model = mlp([6, 16, 16, 3])
    grads = [stacked_grads(model, 4, seed) for seed in range(6)]
    straight = Simulator(all_schemes()[index], 4, model.named_parameters())
    expected = [straight.step_stacked(g).update for g in grads]
    first = Simulator(all_schemes()[index], np.int64(4), model.named_parameters())  # (NumPy's int too)
    for g in grads[:3]:
        first.step_stacked(g)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    second = Simulator(all_schemes()[index], 4, model.named_parameters())
    second.load_state_dict(torch.load(buffer, weights_only=True))  # (torch.load's default)
    for t, g in enumerate(grads[3:], 3):
        torch.testing.assert_close(second.step_stacked(g).update, expected[t], rtol=0, atol=0)
    assert second.totals()["steps"] == 6
    # Control: a fresh simulator (no residues) diverges at once, unless the scheme keeps no state.
    fresh = Simulator(all_schemes()[index], 4, model.named_parameters())
    if index > 1:
        got = fresh.step_stacked(grads[3]).update
        assert any(not torch.equal(a, b) for a, b in zip(got, expected[3]))


def test_state_of_another_scheme_is_refused():
    model = mlp([6, 16, 3])
    a = Simulator(ScaleCom(ratio=0.1, min_numel=0), 4, model.named_parameters())
    a.step_stacked(stacked_grads(model, 4, 0))
    with pytest.raises(ValueError, match="scheme"):
        other = Simulator(LocalTopK(ratio=0.1, min_numel=0), 4, model.named_parameters())
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="saved with"):
        other = Simulator(ScaleCom(ratio=0.2, min_numel=0), 4, model.named_parameters())
        other.load_state_dict(a.state_dict())
    # Qsparse-local-SGD's learning rate is the scheme's own (on Horovod the wrapped optimizer's, which its
    # state restores): a state saved at another one would resume a different run
    saved = Simulator(QsparseLocalSGD(lr=0.1, local_steps=2, ratio=0.1), 4, model.named_parameters())
    saved.step_stacked(stacked_grads(model, 4, 0))
    with pytest.raises(ValueError, match="saved with .*'lr': 0.1"):
        Simulator(QsparseLocalSGD(lr=0.2, local_steps=2, ratio=0.1), 4,
                  model.named_parameters()).load_state_dict(saved.state_dict())


@pytest.mark.parametrize("scheme, change, text", [
    (lambda: QsparseLocalSGD(lr=0.1, local_steps=1, ratio=0.1), lambda e: e.pop("local"), "lacks local"),
    (lambda: PowerSGD(rank=2, min_numel=0), lambda e: e.update(q=torch.randn(3, 3)), r"q .*shape \(3, 3\)"),
    (lambda: ScaleCom(ratio=0.1, min_numel=0), lambda e: e.update(stray=torch.zeros(1)), "stray"),
    (lambda: ScaleCom(ratio=0.1, min_numel=0, pipelined=True),
     lambda e: e.update(ahead=torch.zeros_like(e["ahead"])), "distinct"),
    (lambda: ScaleCom(ratio=0.1, min_numel=0, pipelined=True),
     lambda e: e.update(ahead=e["ahead"] + 1000), "distinct integers in"),
    (lambda: QsparseLocalSGD(lr=0.1, local_steps=1, ratio=0.1), lambda e: e.update(local=e["local"].long()),
     "local of '0.weight' must be a floating-point tensor"),
    (lambda: ScaleCom(ratio=0.1, min_numel=0), lambda e: e.update(memory=e["memory"].int()),
     "memory of '0.weight' must be a floating-point tensor"),
])
def test_incomplete_or_misshaped_state_is_refused_before_anything_changes(scheme, change, text):
    """A state a step would fail on (a key missing, a wrong shape, indices that repeat or overflow,
    a key the scheme never keeps) is refused by load_state_dict, the simulator left as it was."""
    model = mlp([6, 16, 3])
    sim = Simulator(scheme(), 4, model.named_parameters())
    sim.step_stacked(stacked_grads(model, 4, 0))
    saved = sim.state_dict()
    change(saved["scheme"]["state"]["0.weight"])
    before = sim.state_dict()
    with pytest.raises((ValueError, TypeError), match=text):
        sim.load_state_dict(saved)
    after = sim.state_dict()
    assert all(torch.equal(before["scheme"]["state"][n][k], v)
               for n, entry in after["scheme"]["state"].items() for k, v in entry.items())
    sim.step_stacked(stacked_grads(model, 4, 1))  # and it still steps


def test_saved_state_is_kept_in_the_dtypes_the_scheme_makes():
    """fp16 memories and x_last saved by another program come back in fp32, x_i in the parameter's
    dtype: the next step computes as after a state of its own."""
    model = mlp([6, 16, 3])
    sim = Simulator(QsparseLocalSGD(lr=0.1, local_steps=2, ratio=0.1), 4, model.named_parameters())
    sim.step_stacked(stacked_grads(model, 4, 0))
    saved = sim.state_dict()
    for entry in saved["scheme"]["state"].values():
        entry.update({key: value.half() for key, value in entry.items()})
    sim.load_state_dict(saved)
    for entry in sim.state_dict()["scheme"]["state"].values():
        assert {key: value.dtype for key, value in entry.items()} == {
            key: torch.float32 for key in entry}  # (the model is fp32: x_i too)
    sim.step_stacked(stacked_grads(model, 4, 1))


def test_per_worker_gradients_refuse_batch_norm_in_training_mode():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    sim = Simulator(Dense(), 2, model.named_parameters())
    x, y = torch.randn(2, 5, 6), torch.randint(0, 3, (2, 5))
    with pytest.raises(ValueError, match="model.eval"):
        per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), x, y)
    model.eval()
    grads = per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), x, y)
    assert [g.shape[0] for g in grads] == [2] * len(grads)
    assert torch.equal(model[1].running_mean, torch.zeros(8))  # the statistics are read, not updated


def test_per_worker_gradients_refuse_batches_of_another_number_of_workers():
    model = mlp([6, 8, 3])
    sim = Simulator(Dense(), 3, model.named_parameters())
    x, y = torch.randn(3, 5, 6), torch.randint(0, 3, (3, 5))
    for bad_x, bad_y, label in ((x[:2], y, "inputs"), (x, y[:2], "targets"), (x, y.tolist(), "targets")):
        with pytest.raises(ValueError, match=f"{label} must be a tensor of \\(n, batch, ...\\) with n = 3"):
            per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), bad_x, bad_y)
    # worker_params that are no such tensors, or disagree on n, are named (not inputs, or an AttributeError)
    mixed = sim.worker_params()
    mixed[1] = mixed[1][:2]
    with pytest.raises(ValueError, match=r"worker_params hold \[2, 3\] workers"):
        per_worker_gradients(model, torch.nn.functional.cross_entropy, mixed, x, y)
    with pytest.raises(TypeError, match="worker_params of '0.weight' must be a tensor of .n, .shape., got list"):
        per_worker_gradients(model, torch.nn.functional.cross_entropy, [[0.0]] * 4, x, y)


def test_per_worker_gradients_match_one_backward_per_worker():
    model = mlp([6, 16, 3])
    n = 5
    x = torch.randn(n, 8, 6)
    y = torch.randint(0, 3, (n, 8))
    sim = Simulator(Dense(), n, model.named_parameters())
    got = per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), x, y)
    for i in range(n):
        loss = torch.nn.functional.cross_entropy(model(x[i]), y[i])
        want = torch.autograd.grad(loss, list(model.parameters()))
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w, rtol=1e-5, atol=1e-6)


def test_per_worker_gradients_of_a_simulator_given_some_of_the_parameters():
    """Frozen first layer left out of the Simulator: with names=sim.names the gradients are those of
    the parameters it holds; without, or with worker_params that do not fit, a ValueError."""
    model = mlp([6, 16, 3])
    model[0].requires_grad_(False)
    held = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    sim = Simulator(Dense(), 3, held)
    x, y = torch.randn(3, 8, 6), torch.randint(0, 3, (3, 8))
    loss = torch.nn.functional.cross_entropy
    got = per_worker_gradients(model, loss, sim.worker_params(), x, y, names=sim.names)
    for i in range(3):
        want = torch.autograd.grad(loss(model(x[i]), y[i]), [p for _, p in held])
        for g, w in zip(got, want):
            torch.testing.assert_close(g[i], w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"2 worker_params for 4 parameters .*names=sim.names"):
        per_worker_gradients(model, loss, sim.worker_params(), x, y)
    with pytest.raises(ValueError, match=r"worker_params of '2.weight' have shape \(3, 3\)"):
        per_worker_gradients(model, loss, sim.worker_params()[::-1], x, y, names=sim.names)
    with pytest.raises(ValueError, match="'nope', which is not a parameter"):
        per_worker_gradients(model, loss, sim.worker_params(), x, y, names=["nope", "2.bias"])
    # All of model.named_parameters(), as the README's example passes them: the frozen layer would be
    # counted and (its gradients taken regardless, set as .grad) trained; Horovod never reduces it
    with pytest.raises(ValueError, match="'0.weight' does not require grad .*names=sim.names"):
        Simulator(Dense(), 3, model.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_local_sgd_keeps_a_model_per_worker_and_the_caller_the_shared_one(dtype):
    """The caller's copy is x_last rounded to the parameters' dtype, as each worker's (bf16: where
    adding the rounded changes sync after sync would drift away from it)."""
    model = mlp([6, 16, 3]).to(dtype)
    scheme = QsparseLocalSGD(lr=0.1, local_steps=3, ratio=0.2, operator="sign_top_k", min_numel=0)
    sim = Simulator(scheme, 4, model.named_parameters())
    x = torch.randn(4, 8, 6, dtype=dtype)
    y = torch.randint(0, 3, (4, 8))
    for t in range(30):
        grads = per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), x, y)
        sim.step_stacked(grads).apply_to(model.parameters())
        local = sim.worker_params()
        if (t + 1) % 3:
            assert not torch.equal(local[0][0], local[0][1])  # the workers drift apart between syncs
        else:
            for p, w, shared in zip(model.parameters(), local, sim.scheme.shared_params()):
                assert torch.equal(w[0], w[3])  # everyone restarts from x_new ...
                assert torch.equal(p.detach(), w[0])  # ... the caller's model
                assert torch.equal(p.detach(), shared.to(dtype))


@pytest.mark.parametrize("index", range(11))
def test_every_scheme_trains(index):
    """8 workers, each with its own shard of a learnable task: the loss must fall well below chance."""
    torch.manual_seed(1)
    teacher = mlp([10, 3], seed=5)
    x = torch.randn(8, 32, 10)
    y = teacher(x).argmax(dim=-1)
    model = mlp([10, 32, 3], seed=2)
    scheme = all_schemes(min_numel=64)[index]
    lr = 0.5 if not isinstance(scheme, SketchedSGD) else 0.05  # Sketched SGD runs its own momentum
    if isinstance(scheme, QsparseLocalSGD):
        scheme.lr = lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    sim = Simulator(scheme, 8, model.named_parameters())
    loss = torch.nn.functional.cross_entropy
    start = loss(model(x.reshape(-1, 10)), y.reshape(-1)).item()
    for _ in range(60):
        grads = per_worker_gradients(model, loss, sim.worker_params(), x, y)
        sim.step_stacked(grads).apply_to(model.parameters(), optimizer)
    end = loss(model(x.reshape(-1, 10)), y.reshape(-1)).item()
    assert end < 0.6 * start, (scheme.name, start, end)


def test_64_workers_on_a_167k_parameter_mlp():
    """The simulator's cost at the scale it is meant for: no Python loops over entries or workers."""
    model = mlp([784, 200, 50, 10])  # 167,560 parameters
    assert sum(p.numel() for p in model.parameters()) == 167_560
    x = torch.randn(64, 16, 784)
    y = torch.randint(0, 10, (64, 16))
    timings = {}
    for scheme in all_schemes(min_numel=1024):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sim = Simulator(scheme, 64, model.named_parameters())
        start = time.perf_counter()
        for _ in range(2):
            grads = per_worker_gradients(model, torch.nn.functional.cross_entropy, sim.worker_params(), x, y)
            result = sim.step_stacked(grads)
            assert all(torch.isfinite(u).all() for u in result.update)
        timings[scheme.name] = (time.perf_counter() - start) / 2
        result.apply_to(model.parameters(), optimizer)
    print({k: round(v, 3) for k, v in timings.items()})
    assert max(timings.values()) < 10.0, timings


def test_apply_to_checks_every_shape_before_changing_any_parameter():
    """A parameter whose shape is not its update's (even of the same numel) is refused, naming it,
    before the earlier parameters' gradients or values are set."""
    a, b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(3, 2))
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(2, 4, generator=gen), torch.randn(2, 3, 2, generator=gen)]
    gradient = Simulator(ScaleCom(ratio=0.5, min_numel=0), 2, [("a", a), ("b", b)]).step_stacked(grads)
    model = Simulator(QsparseLocalSGD(lr=0.1, local_steps=1, ratio=0.5), 2, [("a", a), ("b", b)]).step_stacked(grads)
    for result in (gradient, model):
        x, y = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 3))  # y: same numel
        with pytest.raises(ValueError, match=r"parameter 1 \('b'\) has shape \(2, 3\), its update \(3, 2\)"):
            result.apply_to([x, y])
        assert x.grad is None and torch.equal(x.detach(), torch.zeros(4))
        with pytest.raises(TypeError, match="parameter 0 .'a'. must be a tensor, got list"):
            result.apply_to([[0.0] * 4, b])
    result = dataclasses.replace(model, names=None)
    with pytest.raises(ValueError, match=r"^parameter 1 has shape \(5,\), its update \(3, 2\)$"):
        result.apply_to([a, torch.nn.Parameter(torch.zeros(5))])
    assert torch.equal(a.detach(), torch.zeros(4))
    result.apply_to([a, b])
    assert torch.equal(b.detach(), model.model[1])


def test_step_stacked_refuses_non_tensors_and_dtypes_without_a_byte_size_before_any_change():
    a = torch.nn.Parameter(torch.zeros(8))
    sim = Simulator(ScaleCom(ratio=0.25, min_numel=0), 2, [("a", a), ("b", torch.nn.Parameter(torch.zeros(4)))])
    for bad, name in ((None, "NoneType"), (np.zeros((2, 4), np.float32), "ndarray"), ([[0.0] * 4] * 2, "list")):
        with pytest.raises(TypeError, match=f"gradient of 'b' must be a tensor, got {name}"):
            sim.step_stacked([torch.randn(2, 8), bad])
    eight = torch.zeros(2, 4).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="gradient of 'b' is torch.float8_e4m3fn, expected float16, bfloat16"):
        sim.step_stacked([torch.randn(2, 8), eight])
    with pytest.raises(TypeError, match="'b' from worker 0 is torch.float8_e4m3fn, expected float16, bfloat16"):
        sim.step([[torch.randn(8), eight[i]] for i in range(2)])
    assert sim.step_count == 0 and "memory" not in sim.scheme.state["a"] and sim.history == []
    with pytest.raises(TypeError, match="parameter 'b' is torch.float8_e4m3fn; the simulator takes float16"):
        Simulator(Dense(), 2, [("a", a), ("b", torch.zeros(4, dtype=torch.float8_e4m3fn))])


def test_a_sketched_sgd_refused_by_a_simulator_can_be_bound_by_another():
    scheme = SketchedSGD(ratio=1.0, min_numel=0)
    with pytest.raises(ValueError, match="columns, 2"):  # 10 k >= 2**31 columns
        Simulator(scheme, 2, [("w", torch.nn.Parameter(torch.empty(15000, 15000, device="meta")))])
    assert scheme.specs is None
    sim = Simulator(scheme, 2, [("w", torch.nn.Parameter(torch.zeros(64, 64)))])
    assert sim.step_stacked([torch.ones(2, 64, 64)]).update[0].shape == (64, 64)


def test_a_non_contiguous_saved_memory_is_loaded_as_a_contiguous_copy():
    params = [("a", torch.nn.Parameter(torch.zeros(6))), ("b", torch.nn.Parameter(torch.zeros(6)))]
    sims = [Simulator(ScaleCom(ratio=0.5, min_numel=0), 2, params) for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(2, 6, generator=gen) for _ in params] for _ in range(2)]
    memory = torch.randn(6, 2, generator=gen).t()  # (2, 6), not contiguous
    for sim, saved_memory in zip(sims, (memory, memory.contiguous())):
        sim.step_stacked(grads[0])
        saved = sim.state_dict()
        saved["scheme"]["state"]["b"]["memory"] = saved_memory
        sim.load_state_dict(saved)
        assert sim.scheme.state["b"]["memory"].is_contiguous()
        assert sim.scheme.state["b"]["memory"].data_ptr() != saved_memory.data_ptr()
    first, second = (sim.step_stacked(grads[1]).update for sim in sims)
    assert all(torch.equal(u, v) for u, v in zip(first, second))
    sketched = Simulator(SketchedSGD(ratio=0.1, min_numel=0), 2, [("w", torch.nn.Parameter(torch.zeros(8, 8)))])
    sketched.step_stacked([torch.randn(2, 8, 8, generator=gen)])
    saved = sketched.state_dict()
    saved["scheme"]["extra"] = {key: torch.randn(64, 2, generator=gen).t() for key in ("u", "v")}
    sketched.load_state_dict(saved)
    assert sketched.scheme._u.is_contiguous() and sketched.scheme._v.is_contiguous()
    torch.testing.assert_close(sketched.scheme._u, saved["scheme"]["extra"]["u"], rtol=0, atol=0)


def test_qsparse_generator_state_is_checked_before_anything_changes():
    sim = Simulator(QsparseLocalSGD(lr=0.1, local_steps=1, operator="qsgd_top_k"), 2,
                    [("w", torch.nn.Parameter(torch.zeros(50)))])
    sim.step_stacked([torch.randn(2, 50)])
    before = sim.state_dict()
    for extra, error, text in ((None, TypeError, "generator must be a torch.ByteTensor .*got NoneType"),
                               ({}, TypeError, "generator must be a torch.ByteTensor .*got NoneType"),
                               ({"generator": torch.zeros(5)}, TypeError, "ByteTensor .*got torch.float32"),
                               ({"generator": torch.zeros(5, dtype=torch.uint8)}, ValueError,
                                "QsparseLocalSGD state generator is not a CPU generator's state")):
        saved = sim.state_dict()
        saved["scheme"]["state"]["w"]["local"] += 1
        if extra is None:
            del saved["scheme"]["extra"]
        else:
            saved["scheme"]["extra"] = extra
        with pytest.raises(error, match=text):
            sim.load_state_dict(saved)
        assert torch.equal(sim.scheme.generator.get_state(), before["scheme"]["extra"]["generator"])
        assert torch.equal(sim.scheme.state["w"]["local"], before["scheme"]["state"]["w"]["local"])


def test_sketched_sgd_state_without_u_and_v_is_refused():
    sim = Simulator(SketchedSGD(ratio=0.05, min_numel=0), 2, [("w", torch.nn.Parameter(torch.zeros(40, 40)))])
    for _ in range(2):
        sim.step_stacked([torch.randn(2, 40, 40)])
    u = sim.scheme._u.clone()
    for extra, text in ((None, "got NoneType"), ({}, r"got keys \[\]"), ({"u": u}, r"got keys \['u'\]")):
        saved = sim.state_dict()
        saved["scheme"]["extra"] = extra
        with pytest.raises(ValueError, match="SketchedSGD state extra must be a dict of u and v.*" + text):
            sim.load_state_dict(saved)
        assert torch.equal(sim.scheme._u, u)
    saved = sim.state_dict()
    del saved["scheme"]["extra"]
    with pytest.raises(ValueError, match="extra must be a dict of u and v"):
        sim.load_state_dict(saved)


def test_per_worker_gradients_draw_a_dropout_mask_per_worker():
    """Dropout in training mode: each worker its own mask (vmap's randomness="different"), the same in
    its forward and backward pass: the second layer's weight gradient is 2 h or 0 where the first
    layer's row is (not) zero, and the workers, on the same input, differ."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
    sim = Simulator(Dense(), 4, model.named_parameters())
    x = torch.randn(1, 1, 6).expand(4, 1, 6)
    w1, _, w2, _ = per_worker_gradients(model, lambda out, y: out.sum(), sim.worker_params(), x, torch.zeros(4, 1))
    h = model[0](x[0, 0]).detach()
    kept = w1.abs().sum(dim=2) != 0  # (4, 16): the entries each worker's mask kept
    torch.testing.assert_close(w2[:, 0], torch.where(kept, 2 * h, torch.zeros(())), rtol=1e-6, atol=0)
    assert 0 < kept.sum() < kept.numel() and len({tuple(row.tolist()) for row in kept}) > 1


def test_history_entries_of_a_loaded_state_must_hold_the_summed_byte_counts():
    sim = Simulator(ScaleCom(), 2, [("w", torch.nn.Parameter(torch.zeros(3)))])
    sim.step_stacked([torch.randn(2, 3)])
    for entry, text in (({"step": 0}, "entry 0 lacks numbers for index_bytes, value_bytes"),
                        ({**sim.history[0], "sent_bytes": "12"}, "entry 0 lacks numbers for sent_bytes$"),
                        ({**sim.history[0], "dense_bytes": True}, "entry 0 lacks numbers for dense_bytes$")):
        saved = sim.state_dict()
        saved["history"] = [entry]
        saved["step"] = 5
        with pytest.raises(ValueError, match=text):
            sim.load_state_dict(saved)
        assert sim.step_count == 1 and len(sim.history) == 1
    assert sim.totals()["steps"] == 1
