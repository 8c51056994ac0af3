"""Sketched SGD on the stock hvd.DistributedOptimizer (hvd_scalecom.torch.SketchedSGD) under real
horovodrun, step by step against the simulator (hvd_scalecom.sim.SketchedSGD) fed the job's per-rank
gradients; what Horovod moved, from its timeline; checkpoints; bad input.

The job is tests/workers/torch_seed_sketched.py: a 48-64-10 MLP whose two weight matrices (3072 and
640 entries) form the sketched vector; its biases go dense. Launches are few (each costs seconds of
start-up): :func:`sequence_job` runs the worker several times in one job.
"""

import json
import time

import numpy as np
import pytest
import torch
from jobs import add_run, rank_sections
from reference import SketchedReference

from devtools.launch import HorovodRunError
from hvd_scalecom.sim import Simulator
from hvd_scalecom.sim import SketchedSGD as SimSketchedSGD
from hvd_scalecom.torch.sketch import CountSketch

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
BASE = {"ratio": 0.02, "rows": 3, "columns": 400, "candidates": 2, "momentum": 0.9, "min_numel": 600}
K = 62 + 13  # ceil(0.02 * 3072) + ceil(0.02 * 640)
LR = 0.1
SUM_OPTS = {**BASE, "op": "sum", "groups": True, "backward_passes_per_step": 2}


# -- Horovod jobs, shared with tests/test_torch_qsparse.py -------------------------------------------------
# Starting horovodrun and importing torch and Horovod on every rank costs far more than these small runs,
# so the runs of both files share a few jobs of tests/jobs.py (each with a timeline of rank 0): in each,
# runs of the tests/workers scripts follow one another in the same processes, and a run that must fail
# comes last. A job includes only the runs that the selected tests read.


def completed(job, part, size):
    """The per-rank results of ``part``, which must have completed on all ``size`` ranks."""
    return job.completed(part, size)


THREE_RANKS = {**BASE, "warmup_steps": 1, "steps": 5, "no_out_weight_grad_on_rank": 1}
add_run("np3", "sketched_three_ranks", "torch_seed_sketched.py", THREE_RANKS,
        ["test_three_ranks_match_the_simulator_and_move_the_sketch"])
UNDER_MPI = {**BASE, "warmup_steps": 1, "steps": 4}
add_run("np3_mpi", "sketched_mpi", "torch_seed_sketched.py", UNDER_MPI,
        ["test_sketched_sgd_under_mpi_matches_the_simulator"])
add_run("np2_first", "sketched_sum_first", "torch_seed_sketched.py",
        {**SUM_OPTS, "steps": 4, "checkpoint": True},
        ["test_sum_op_groups_accumulation_and_checkpoint_round_trip"])
add_run("np2_second", "sketched_sum_second", "torch_seed_sketched.py",
        lambda root: {**SUM_OPTS, "steps": 3, "first_step": 4,
                      "resume_from": str(root / "sketched_sum_first")},
        ["test_sum_op_groups_accumulation_and_checkpoint_round_trip"])
BF16 = {**BASE, "warmup_steps": 1, "steps": 4, "dtype": "bfloat16"}
FROZEN = {**BASE, "steps": 3, "frozen": "hidden.weight"}
add_run("np2_second", "sketched_frozen", "torch_seed_sketched.py", FROZEN,
        ["test_a_parameter_frozen_before_the_optimizer_is_left_out_of_the_sketch"])
add_run("np2_first", "sketched_bf16", "torch_seed_sketched.py", BF16,
        ["test_bf16_gradients_travel_as_fp32_and_match_the_reference"])
NAN = {**BASE, "warmup_steps": 1, "steps": 6,
       "nan_at": [[0, 0, "hidden.weight"], [2, 1, "hidden.weight"], [3, 0, "hidden.bias"]]}
add_run("np2_first", "sketched_nan", "torch_seed_sketched.py", NAN,
        ["test_a_nan_in_one_ranks_gradient_skips_round_two_on_every_rank_and_is_not_kept"])
SCALED = {**BASE, "warmup_steps": 1, "steps": 6, "loss_scales": [1024, 1024, 512, 512, 4096, 256]}
add_run("np2_first", "sketched_loss_scaled", "torch_seed_sketched.py", SCALED,
        ["test_momentum_and_error_follow_a_changing_loss_scale"])
add_run("np2_first", "sketched_skewed_steps", "torch_seed_sketched.py",
        {**BASE, "warmup_steps": 2, "steps": 2, "skew_steps": {"1": 3}},
        ["test_ranks_resumed_from_states_of_different_steps_all_raise"])
SKEWED_MID_JOB = {**BASE, "warmup_steps": 2, "steps": 3, "skew_steps_at": {"1": 1}}
add_run("np2_first", "sketched_skewed_mid_job", "torch_seed_sketched.py", SKEWED_MID_JOB,
        ["test_step_counters_that_part_across_the_end_of_warm_up_mid_job_raise_on_every_rank"])
DISAGREEING = {  # part: per-rank options that only the configuration check can tell apart
    # a model cast to bfloat16 on one rank: every rank sends fp32 (sketch, probes, dense), so the
    # ranks trained on silently in different precisions (with float64: Horovod's "Mismatched data types")
    "sketched_dtype_on_one_rank": {"0": {"dtype": "float32"}, "1": {"dtype": "bfloat16"}},
    # a loss_scaler given on one rank only: its momentum and error followed the scale, the other's did not
    "sketched_loss_scaler_on_one_rank": {"1": {"no_loss_scaler": True}},
}
for part, per_rank in DISAGREEING.items():
    add_run("np2_second", part, "torch_seed_sketched.py",
            {**BASE, "warmup_steps": 1, "steps": 2, "loss_scales": [1024, 512], "expect_refusal": True,
             "per_rank": per_rank}, ["test_ranks_whose_dtypes_or_loss_scalers_differ_all_raise"])
DIRECT = {**BASE, "warmup_steps": 1, "steps": 4, "direct_allreduce": True, "single_at": 3}
add_run("np2_second", "sketched_direct", "torch_seed_sketched.py", DIRECT,
        ["test_hvd_allreduce_called_directly_one_gradient_at_a_time_is_refused_and_changes_nothing"])
SECOND_REDUCTION = {**BASE, "warmup_steps": 1, "steps": 4, "step_outside_skip_at": [0, 2]}
add_run("np2_second", "sketched_second_reduction", "torch_seed_sketched.py", SECOND_REDUCTION,
        ["test_a_second_reduction_after_synchronize_is_refused_and_changes_nothing"])
TWO_INSTANCES = {"names": ["enc", "dec"], "steps": 4}
add_run("np2_second", "sketched_two_instances", "torch_two_sketched.py", TWO_INSTANCES,
        ["test_two_instances_stepped_after_one_backward_with_their_own_names"])
add_run("np2_first", "sketched_disagreeing", "torch_seed_sketched.py",
        {**BASE, "steps": 2, "per_rank": {"1": {"rows": 5}}},
        ["test_ranks_configured_differently_all_raise"], fails=True)


class Net(torch.nn.Module):
    """The worker's model (same layers and seed, so the same initial weights)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(48, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x, detach_out_weight=False):
        h = torch.tanh(self.hidden(x))
        if detach_out_weight:
            return torch.nn.functional.linear(h, self.out.weight.detach(), self.out.bias)
        return self.out(h)


def simulator(opts, n):
    torch.manual_seed(0)
    scheme = SimSketchedSGD(ratio=opts["ratio"], rows=opts["rows"], columns=opts["columns"],
                            candidates=opts["candidates"], momentum=opts["momentum"],
                            warmup_steps=opts.get("warmup_steps", 0), min_numel=opts["min_numel"])
    return Simulator(scheme, n, Net().named_parameters())


def reference(opts, n):
    """The NumPy reference of the paper's equations (tests/reference.py); of this project's code it
    shares only the count sketch's hash functions, a random choice both must make alike."""
    def hashes(numel, rows, columns):
        buckets, signs = CountSketch(numel, rows, columns, seed=opts.get("seed", 0)).hashes(torch.arange(numel))
        return buckets.numpy(), signs.numpy()

    shapes = {n_: tuple(p.shape) for n_, p in Net().named_parameters() if n_ != opts.get("frozen")}
    return SketchedReference(shapes, n, ratio=opts["ratio"], rows=opts["rows"], columns=opts["columns"],
                             candidates=opts["candidates"], momentum=opts["momentum"],
                             warmup_steps=opts.get("warmup_steps", 0), min_numel=opts["min_numel"],
                             hashes=hashes)


def follow(ref, results, steps, first=0, scale=1.0, rtol=1e-5, atol=1e-6, names=NAMES):
    """Feed the job's raw gradients to the reference; every rank's applied gradient (of ``names``) must
    be ``scale`` times its update (float64 there, so to the job's rounding)."""
    for t in range(first, first + steps):
        update = ref.step([{n: r[f"raw/{t}/{n}"] for n in NAMES} for r in results])
        for n in names:
            for rank, r in enumerate(results):
                np.testing.assert_allclose(r[f"applied/{t}/{n}"], scale * update[n], rtol=rtol, atol=atol,
                                           err_msg=f"step {t}, {n}, rank {rank}: the reference")


def replay(sim, results, steps, first=0, scale=1.0, rtol=1e-5, atol=1e-7):
    """Feed the job's raw gradients of ``steps`` steps to ``sim``; every rank's applied gradient must be
    ``scale`` times the simulator's update. Returns the updates."""
    updates = []
    for t in range(first, first + steps):
        step = sim.step([[torch.from_numpy(r[f"raw/{t}/{n}"]) for n in NAMES] for r in results])
        for n, update in zip(NAMES, step.update):
            for rank, r in enumerate(results):
                np.testing.assert_allclose(r[f"applied/{t}/{n}"], scale * update.numpy(), rtol=rtol,
                                           atol=atol, err_msg=f"step {t}, {n}, rank {rank}")
        updates.append(dict(zip(NAMES, step.update)))
    return updates


def closed_loop(opts, n, steps, no_grad_rank=None):
    """The simulator trains the worker's model itself on the worker's data; returns final weights."""
    sim = simulator(opts, n)
    torch.manual_seed(0)
    model = Net()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    for t in range(steps):
        grads = []
        for rank in range(n):
            generator = torch.Generator().manual_seed(10000 * t + rank)
            x = torch.randn(16, 48, generator=generator)
            y = torch.randint(0, 10, (16,), generator=generator)
            detach = rank == no_grad_rank and t % 2 == 1
            loss = torch.nn.functional.cross_entropy(model(x, detach), y)
            grads.append(list(torch.autograd.grad(loss, params, allow_unused=True)))
        sim.step(grads).apply_to(params, optimizer)
    return {n_: p.detach().numpy() for n_, p in zip(NAMES, params)}



def check_identical_weights(results):
    for n in NAMES:
        for rank, r in enumerate(results[1:], 1):
            np.testing.assert_array_equal(r[f"final/{n}"], results[0][f"final/{n}"],
                                          err_msg=f"{n} differs between rank 0 and {rank}")


def test_three_ranks_match_the_simulator_and_move_the_sketch(horovod_jobs):
    """np=3, one dense warm-up step, rank 1 without an out.weight gradient on odd steps (Horovod
    compresses it late in synchronize(), so rank 1 completes its sketch in another order)."""
    from devtools.timeline import read_operations

    steps, warmup = 5, 1
    opts = THREE_RANKS
    job = horovod_jobs("np3")
    timeline = job["timeline"]
    results = completed(job, "sketched_three_ranks", 3)
    assert len(results) == 3

    # Open loop: the job's raw gradients through the simulator give every rank's applied gradient.
    updates = replay(simulator(opts, 3), results, steps)
    follow(reference(opts, 3), results, steps)
    for t, update in enumerate(updates):
        sketched = sum(np.count_nonzero(update[n].numpy()) for n in ("hidden.weight", "out.weight"))
        assert sketched == (3072 + 640 if t < warmup else K), t
        assert np.count_nonzero(update["hidden.bias"].numpy()) == 64
    # Closed loop: the simulator training the same model ends at the job's weights, on every rank.
    final = closed_loop(opts, 3, steps, no_grad_rank=1)
    for n in NAMES:
        np.testing.assert_allclose(results[0][f"final/{n}"], final[n], rtol=1e-5, atol=1e-6, err_msg=n)
    check_identical_weights(results)

    # What Horovod moved (rank 0's timeline): per sketched step one r x c sketch, P k candidate sums,
    # a one-entry probe per sketched tensor; the biases dense; in warm-up the probes too, and the
    # sketched tensors' momentum, whole, in the sketch's allreduce.
    moved = {}
    for op in read_operations(timeline):
        moved.setdefault(op["name"], []).append((op["shape"], op["dtype"]))
    assert moved["allreduce.sketched_sgd.sketch"] == [([3072 + 640], "float32")] * warmup + \
        [([3, 400], "float32")] * (steps - warmup)
    assert moved["allreduce.sketched_sgd.candidates"] == [([2 * K], "float32")] * (steps - warmup)
    probes = [([1], "float32")] * steps
    assert moved["allreduce.hidden.weight"] == probes
    assert moved["allreduce.out.weight"] == probes
    assert moved["allreduce.hidden.bias"] == [([64], "float32")] * steps
    sketched_step = 4 * (3 * 400 + 2 * K + 2)
    dense_step = 4 * (64 + 10)
    for r in results:
        for t in range(steps):
            stats = json.loads(str(r[f"stats/{t}"]))
            assert stats["index_bytes"] == 0
            if t < warmup:
                assert (stats["value_bytes"], stats["dense_bytes"]) == (4 * 2, 4 * 3786)
            else:
                assert (stats["value_bytes"], stats["dense_bytes"]) == (sketched_step, dense_step)
            assert stats["uncompressed_bytes"] == 4 * 3786 and stats["tensors"] == 4
            assert stats["wire_bytes"] == pytest.approx(2 * 2 / 3 * stats["sent_bytes"])
        total = json.loads(str(r["stats"]))["total"]
        timeline_bytes = sum(op["nbytes"] for op in read_operations(timeline)
                             if op["op"] == "allreduce" and op["name"] != "allreduce.worker.done")
        assert total["sent_bytes"] == timeline_bytes == (steps - warmup) * (sketched_step + dense_step) \
            + warmup * 4 * (3786 + 2)


def test_sketched_sgd_under_mpi_matches_the_simulator(horovod_jobs):
    """np=3 under MPI (horovodrun --mpi, Open MPI carrying the collectives) as under Gloo: a dense
    warm-up step, then the sketch, the candidates and the probes."""
    results = completed(horovod_jobs("np3_mpi"), "sketched_mpi", 3)
    assert not any(bool(r["gloo"]) for r in results)
    updates = replay(simulator(UNDER_MPI, 3), results, UNDER_MPI["steps"])
    follow(reference(UNDER_MPI, 3), results, UNDER_MPI["steps"])
    check_identical_weights(results)
    assert np.count_nonzero(updates[3]["hidden.weight"].numpy()) + \
        np.count_nonzero(updates[3]["out.weight"].numpy()) == K


def test_sum_op_groups_accumulation_and_checkpoint_round_trip(horovod_jobs):
    """np=2 with op=hvd.Sum (the sketched tensors follow it through their probe), a grouped allreduce
    and two backward passes per step; 4 steps, a checkpoint, new processes, 3 more steps. The
    simulator runs all 7 steps in one go: the resumed job must continue exactly where it would."""
    opts = SUM_OPTS
    first = completed(horovod_jobs("np2_first"), "sketched_sum_first", 2)
    second = completed(horovod_jobs("np2_second"), "sketched_sum_second", 2)
    sim = simulator(opts, 2)
    replay(sim, first, 4, scale=2.0)  # op=Sum: n times the mean
    ref = reference(opts, 2)
    follow(ref, first, 4, scale=2.0)
    follow(ref, second, 3, first=4, scale=2.0)
    fresh = simulator(opts, 2)
    replay(sim, second, 3, first=4, scale=2.0)
    check_identical_weights(first)
    check_identical_weights(second)
    # Control: without the restored momentum and error the same gradients give other updates.
    with pytest.raises(AssertionError):
        replay(fresh, second, 3, first=4, scale=2.0)


def test_a_nan_in_one_ranks_gradient_skips_round_two_on_every_rank_and_is_not_kept(horovod_jobs):
    """np=2, entry 7 of a gradient is NaN on one rank: hidden.weight's in the dense warm-up step 0
    (rank 0) and in sketched step 2 (rank 1), hidden.bias's (dense) in step 3 (rank 0). Every rank
    hands the optimizer NaN where the reference does (a dense tensor's NaN entry; all of the sketched
    tensors when their reduced sketch is not finite; the job skips those steps, as a loss scaler
    would), counts the sketched one and no candidates for it, and keeps no NaN: the next steps are finite, with k
    coordinates
    applied, as in the reference and the simulator."""
    results = completed(horovod_jobs("np2_first"), "sketched_nan", 2)
    for t, rank, name in NAN["nan_at"]:
        assert np.isnan(results[rank][f"raw/{t}/{name}"].reshape(-1)[7])
    follow(reference(NAN, 2), results, NAN["steps"])
    sim = simulator(NAN, 2)
    replay(sim, results, NAN["steps"])
    assert sim.scheme.nonfinite_skips == 1
    for r in results:
        for t in range(NAN["steps"]):
            applied = {n: r[f"applied/{t}/{n}"].reshape(-1) for n in NAMES}
            sketched = np.concatenate([applied["hidden.weight"], applied["out.weight"]])
            nan = {n: np.flatnonzero(np.isnan(a)).tolist() for n, a in applied.items()}
            if t == 2:
                assert np.isnan(sketched).all()
                del nan["hidden.weight"], nan["out.weight"]
            else:
                assert np.count_nonzero(sketched) == (3072 + 640 if t == 0 else K), t
            expected = {n: [] for n in nan}
            expected.update({name: [7] for step, _, name in NAN["nan_at"] if step == t and step != 2})
            assert nan == expected, t
            stats = json.loads(str(r[f"stats/{t}"]))
            assert stats["nonfinite_skips"] == (1 if t >= 2 else 0)
            if t >= 1:  # the sketch and the probes; round 2's candidates only where it ran
                assert stats["value_bytes"] == 4 * (3 * 400 + (0 if t == 2 else 2 * K) + 2), t
    check_identical_weights(results)


def test_bf16_gradients_travel_as_fp32_and_match_the_reference(horovod_jobs):
    """Horovod's collectives take no bfloat16: the dense warm-up reduction, the sketch and the probe
    travel as float32, and the optimizer gets the reference's update rounded to bfloat16."""
    results = completed(horovod_jobs("np2_first"), "sketched_bf16", 2)
    assert str(results[0]["applied_dtype"]) == "torch.bfloat16"
    follow(reference(BF16, 2), results, BF16["steps"], rtol=8e-3, atol=1e-6)
    check_identical_weights(results)


def test_a_parameter_frozen_before_the_optimizer_is_left_out_of_the_sketch(horovod_jobs):
    """np=2, hidden.weight frozen before SketchedSGD and hvd.DistributedOptimizer are built: Horovod never
    reduces it, so the sketch holds out.weight alone (k = 13) and every step applies the reference's
    update of the three trained tensors; hidden.weight stays as initialised."""
    results = completed(horovod_jobs("np2_second"), "sketched_frozen", 2)
    trained = [n for n in NAMES if n != "hidden.weight"]
    follow(reference(FROZEN, 2), results, FROZEN["steps"], names=trained)
    torch.manual_seed(0)
    initial = Net().hidden.weight.detach().numpy()
    for r in results:
        assert not any(key.startswith("applied/") and key.endswith("/hidden.weight") for key in r)
        np.testing.assert_array_equal(r["final/hidden.weight"], initial)
        stats = json.loads(str(r["stats/2"]))
        assert (stats["value_bytes"], stats["dense_bytes"]) == (4 * (3 * 400 + 2 * 13 + 1), 4 * (64 + 10))
    check_identical_weights(results)


def test_momentum_and_error_follow_a_changing_loss_scale(horovod_jobs):
    """np=2, the loss scaled by 1024, 1024, 512, 512, 4096, 256 (powers of two: exact), loss_scaler=
    following it, the reduced gradients divided by it as GradScaler does: every step, warm-up and
    sketched, applies what the simulator and the reference apply on the unscaled gradients."""
    results = completed(horovod_jobs("np2_first"), "sketched_loss_scaled", 2)
    replay(simulator(SCALED, 2), results, SCALED["steps"])
    follow(reference(SCALED, 2), results, SCALED["steps"])
    check_identical_weights(results)


def test_ranks_resumed_from_states_of_different_steps_all_raise(horovod_jobs):
    """Rank 1 resumes from a state of step 3, rank 0 from the start (warm-up 2 steps: rank 0 would
    reduce densely, rank 1 sketch): both raise the same error at the first step, naming the steps."""
    results = completed(horovod_jobs("np2_first"), "sketched_skewed_steps", 2)
    for r in results:
        assert "SketchedSGD is configured differently on different ranks (steps differ)" in str(r["refused"])
        assert "restore every rank from a state of the same step" in str(r["refused"])
        assert not any(key.startswith("applied/") for key in r)


def test_step_counters_that_part_across_the_end_of_warm_up_mid_job_raise_on_every_rank(horovod_jobs):
    """Warm-up of 2 steps; at the top of step 1 rank 1 loads a state of its next step (step 2, past
    warm-up), after the first-step check: rank 0 reduces step 1 densely, rank 1 sketches. Both meet in
    sketched_sgd.sketch with different shapes (u whole against the r x c table), and both raise an
    error naming SketchedSGD, a sketched tensor, the cause and the remedy; it was Horovod's "Mismatched
    ALLREDUCE tensor shapes" of a probe against a dense gradient, naming neither."""
    results = completed(horovod_jobs("np2_first"), "sketched_skewed_mid_job", 2)
    follow(reference(SKEWED_MID_JOB, 2), results, 1)  # step 0, dense, as the reference
    for rank, r in enumerate(results):
        refused = str(r["refused"])
        assert refused.startswith("SketchedSGD: the ranks' step counters differ on either side of the end of "
                                  "warm-up (warmup_steps=2), so they reduced "), refused
        assert ("'hidden.weight'" in refused) != ("'out.weight'" in refused)
        assert f"this rank is at step {1 + rank}, {['in warm-up', 'past warm-up'][rank]}" in refused
        assert "restore every rank from a state_dict() of the same step" in refused
        assert "Mismatched ALLREDUCE tensor shapes" in refused  # (Horovod's own words, kept)
        assert not any(key.startswith("applied/1/") for key in r)


def test_ranks_configured_differently_all_raise(horovod_jobs):
    job = horovod_jobs("np2_first")
    assert isinstance(job["error"], HorovodRunError) and not job["results"]["sketched_disagreeing"]
    by_rank = rank_sections(str(job["error"]))
    for rank in (0, 1):
        assert "SketchedSGD is configured differently on different ranks (rows differ)" in by_rank[rank]
        assert "rank 0: rows=3; rank 1: rows=5" in by_rank[rank]


@pytest.mark.parametrize("part, differing, hint", [
    ("sketched_dtype_on_one_rank", "parameter_dtypes", "rank 0: parameter_dtypes=['float32']; "
                                                       "rank 1: parameter_dtypes=['bfloat16']"),
    ("sketched_loss_scaler_on_one_rank", "loss_scaler", "rank 0: loss_scaler=True; rank 1: loss_scaler=False"),
])
def test_ranks_whose_dtypes_or_loss_scalers_differ_all_raise(part, differing, hint, horovod_jobs):
    """Both used to train on silently: a bfloat16 model on one rank sends fp32 like the others, and a rank
    without the loss_scaler kept its momentum and error in the scale of the step they were made in.
    Now every rank raises the same error at the first step, before anything changes."""
    results = completed(horovod_jobs("np2_second"), part, 2)
    for r in results:
        refused = str(r["refused"])
        assert f"SketchedSGD is configured differently on different ranks ({differing} differ): {hint}" in refused
        assert not any(key.startswith("applied/") for key in r)


def test_hvd_allreduce_called_directly_one_gradient_at_a_time_is_refused_and_changes_nothing(horovod_jobs):
    """Without DistributedOptimizer: hvd.grouped_allreduce(gradients, compression=SketchedSGD) applies the
    reference's update (a warm-up step, then two sketched ones). hvd.allreduce(p.grad, compression=...)
    of one gradient at a time cannot work (a sketched tensor's update needs every sketched gradient):
    every rank raises naming that cause, where the first sketched tensor's momentum, error and step
    counter had moved on (every later step then failed out of lockstep) and the error blamed frozen
    parameters; the state is as it was before the step."""
    results = completed(horovod_jobs("np2_second"), "sketched_direct", 2)
    follow(reference(DIRECT, 2), results, 3)
    check_identical_weights(results)
    for r in results:
        refused = str(r["refused"])
        assert "'hidden.weight' was decompressed before the sketched tensors ['out.weight'] were compressed" in refused
        assert "hvd.allreduce(p.grad, compression=SketchedSGD) of one gradient at a time cannot work" in refused
        assert bool(r["state_unchanged"])
        assert not any(key.startswith("applied/3/") for key in r)


def test_a_second_reduction_after_synchronize_is_refused_and_changes_nothing(horovod_jobs):
    """optimizer.synchronize(), then optimizer.step() outside skip_synchronize() (step 0 in warm-up,
    step 2 sketched): Horovod only warns and reduces every gradient again, which averages plain
    gradients to themselves but made SketchedSGD count another step (the applied update taken in as a
    new gradient: momentum applied twice, warm-up over in half the steps). Every rank raises naming the
    cause and the remedy, before anything changes; the step then completed inside skip_synchronize()
    and every step applies the reference's update."""
    results = completed(horovod_jobs("np2_second"), "sketched_second_reduction", 2)
    follow(reference(SECOND_REDUCTION, 2), results, SECOND_REDUCTION["steps"])
    check_identical_weights(results)
    for r in results:
        for t in (0, 2):
            refused = str(r[f"refused/{t}"])
            assert "last decompress gave back, unchanged: Horovod is reducing it a second time" in refused
            assert "step inside `with optimizer.skip_synchronize():`" in refused
            assert bool(r[f"state_unchanged/{t}"])
        assert json.loads(str(r["stats"]))["step"] == SECOND_REDUCTION["steps"] - 1  # one step counted each


def test_two_instances_stepped_after_one_backward_with_their_own_names(horovod_jobs):
    """An encoder and a decoder, each with its SketchedSGD and hvd.DistributedOptimizer, stepped after
    one backward: both rounds' allreduces had fixed names, so the second instance's sketch met the
    first's still in flight and Horovod refused it ("a tensor with the same name as another tensor
    that is currently being processed"), on every step but the first. With name= each posts its own;
    at ratio 1 every coordinate is applied (momentum 0), so the weights follow plain
    hvd.DistributedOptimizer's exactly."""
    from devtools.timeline import read_operations

    job = horovod_jobs("np2_second")
    results = completed(job, "sketched_two_instances", 2)
    for r in results:
        assert float(r["max_difference"]) == 0.0
    for key in results[0]:
        if key.startswith("final/"):
            np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
    moved = {}
    for op in read_operations(job["timeline"]):
        moved.setdefault(op["name"], []).append(op["shape"])
    steps = TWO_INSTANCES["steps"]
    assert moved["allreduce.enc.sketch"] == [[3, 10 * 3072]] * steps  # k = numel at ratio 1, c = 10 k
    assert moved["allreduce.dec.sketch"] == [[3, 10 * 640]] * steps
    assert moved["allreduce.enc.candidates"] == [[3072]] * steps
    assert moved["allreduce.dec.candidates"] == [[640]] * steps


# -- in one process: bad input, state, the probe --------------------------------------------------------

def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))


@pytest.mark.parametrize("kwargs, error, argument", [
    ({"ratio": 0}, ValueError, "ratio"),
    ({"ratio": "0.1"}, ValueError, "ratio"),
    ({"rows": 0}, ValueError, "rows"),
    ({"rows": 4}, ValueError, "rows must be odd"),
    ({"rows": 2.5}, TypeError, "rows"),
    ({"columns": 0}, ValueError, "columns"),
    ({"columns": "wide"}, TypeError, "columns"),
    ({"candidates": 0}, ValueError, "candidates"),
    ({"momentum": 1.0}, ValueError, "momentum"),
    ({"momentum": "0.9"}, TypeError, "momentum"),
    ({"warmup_steps": -1}, ValueError, "warmup_steps"),
    ({"min_numel": 1.5}, TypeError, "min_numel"),
    ({"seed": -1}, ValueError, "seed"),
])
def test_bad_arguments(kwargs, error, argument):
    from hvd_scalecom.torch import SketchedSGD

    with pytest.raises(error, match=argument):
        SketchedSGD(small_model().named_parameters(), **kwargs)


@pytest.mark.parametrize("named, error, text", [
    (None, TypeError, "named_parameters"),
    ([], ValueError, "named_parameters is empty"),
    ([("a", torch.zeros(3)), ("a", torch.zeros(2))], ValueError, "'a' twice"),
    ([("w", torch.zeros(3, dtype=torch.int64))], TypeError, "floating-point"),
])
def test_bad_named_parameters(named, error, text):
    from hvd_scalecom.torch import SketchedSGD

    with pytest.raises(error, match=text):
        SketchedSGD(named)


def test_optimizer_with_momentum_is_rejected():
    from hvd_scalecom.torch import SketchedSGD

    model = small_model()
    compression = SketchedSGD(model.named_parameters())
    compression.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="momentum=0.9"):
        compression.check_optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match="plain torch.optim.SGD"):
        compression.check_optimizer(torch.optim.Adam(model.parameters()))


def test_sketched_set_and_sizes(monkeypatch):
    from hvd_scalecom.torch import SketchedSGD

    compression = SketchedSGD(small_model().named_parameters(), ratio=0.01, min_numel=50)
    # 0.weight (1200) and 1.weight (60) are sketched, the biases are not.
    assert compression.numel == 1260
    assert compression.k == 12 + 1
    assert compression.columns == 130 and compression.num_candidates == 26
    # a parameter frozen before it is built is left out (Horovod never reduces it), and the ranks
    # compare which parameters they sketch
    model = small_model()
    model[0].weight.requires_grad_(False)
    frozen = SketchedSGD(model.named_parameters(), ratio=0.01, min_numel=50)
    assert (frozen.numel, frozen.k) == (60, 1)
    summaries = []
    monkeypatch.setattr("hvd_scalecom.torch.sketched_sgd.check_agreement",
                        lambda scheme, summary, *args, **kwargs: summaries.append(summary))
    compression._check_agreement()
    frozen._check_agreement()
    assert summaries[0]["parameter_digest"] == summaries[1]["parameter_digest"]
    assert summaries[0]["sketched_digest"] != summaries[1]["sketched_digest"]


def test_load_state_dict_checks_before_changing_anything():
    from hvd_scalecom.torch import SketchedSGD

    model = small_model()
    compression = SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=50)
    good = compression.state_dict()
    assert set(good["params"]["0.weight"]) == {"step", "shape", "momentum", "error"}
    for name, p in model.named_parameters():
        good["params"][name]["step"] = 3
        good["params"][name]["momentum"] = torch.full((p.numel(),), 0.5, dtype=torch.float16)  # kept in fp32
        if name.endswith("weight"):
            good["params"][name]["error"] = torch.full((p.numel(),), 0.25, dtype=torch.float64)
    bad = {"config": good["config"], "params": {k: dict(v) for k, v in good["params"].items()}}
    bad["params"]["1.weight"]["error"] = torch.ones(5)  # 60 entries expected
    with pytest.raises(ValueError, match="1.weight"):
        compression.load_state_dict(bad)
    assert compression.state_dict()["params"]["0.weight"]["step"] == 0  # untouched
    # the sketched tensors move in lockstep: a state whose entries were saved at different steps failed
    # at the next step, its error blaming frozen parameters, one tensor's momentum and step moved on
    skewed = {"config": good["config"], "params": {k: dict(v) for k, v in good["params"].items()}}
    skewed["params"]["1.weight"]["step"] = 4
    with pytest.raises(ValueError, match=r"state steps of the sketched tensors differ, \{'0.weight': 3, "
                                         r"'1.weight': 4\}"):
        compression.load_state_dict(skewed)
    assert compression.state_dict()["params"]["0.weight"]["step"] == 0  # untouched
    skewed["params"]["1.weight"]["step"] = 3
    skewed["params"]["1.bias"]["step"] = 5  # (a dense tensor's counter decides nothing the ranks share)
    SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=50).load_state_dict(skewed)
    with pytest.raises(ValueError, match="config"):
        SketchedSGD(model.named_parameters(), ratio=0.2, min_numel=50).load_state_dict(good)
    compression.load_state_dict(good)
    restored = compression.state_dict()
    for name in good["params"]:
        assert restored["params"][name]["step"] == 3
        assert torch.equal(restored["params"][name]["momentum"], good["params"][name]["momentum"].float())
    assert torch.equal(restored["params"]["1.weight"]["error"], torch.full((60,), 0.25))  # (fp32)
    assert restored["scale"] is None
    with pytest.raises(ValueError, match="state scale must be a positive number or None, got -2"):
        compression.load_state_dict({**good, "scale": -2.0})
    # saved at loss scale 4 into one without a loss_scaler: unscaled; and back, as of scale 1
    compression.load_state_dict({**good, "scale": 4.0})
    unscaled = compression.state_dict()
    assert unscaled["scale"] is None and torch.equal(unscaled["params"]["0.bias"]["momentum"], torch.full((30,), 0.125))
    assert torch.equal(unscaled["params"]["1.weight"]["error"], torch.full((60,), 0.0625))
    scaled = SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=50, loss_scaler=torch.amp.GradScaler("cpu"))
    scaled.load_state_dict(good)
    assert scaled.state_dict()["scale"] == 1.0


def test_a_tensor_out_of_lockstep_is_refused_before_anything_changes():
    """0.weight handed over twice in one step (Horovod would not): refused, its step counter unchanged,
    and the step completes as usual once the other tensors are reduced."""
    import horovod.torch as hvd

    from hvd_scalecom.torch import SketchedSGD

    hvd.init()  # (one rank, in this process)
    model = small_model()
    compression = SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=50)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    sent = [compression.compress(model[0].weight.grad)]
    with pytest.raises(RuntimeError, match=r"'0.weight' is at step 1, the step in progress is 0; steps "
                                           r"reduced so far: \{'0.weight': 1, '1.weight': 0\}"):
        compression.compress(model[0].weight.grad)
    sent += [compression.compress(p.grad) for p in list(model.parameters())[1:]]
    for values, ctx in sent:
        compression.decompress(values, ctx)
    assert [e["step"] for e in compression.state_dict()["params"].values()] == [1, 1, 1, 1]


def test_tensor_that_is_no_parameters_gradient():
    from hvd_scalecom.torch import SketchedSGD

    compression = SketchedSGD(small_model().named_parameters())
    with pytest.raises(ValueError, match="not the gradient of any parameter in named_parameters"):
        compression.compress(torch.zeros(30, 40))


@pytest.mark.parametrize("seed", [0, 1, 7, 18])  # each with a tie at the cut
def test_candidates_are_one_list_on_every_path(seed):
    """Round 2 sums ``v_i[candidates]`` position by position, so every rank must find the same list
    in the same order whichever path it runs: the count largest ``|estimate|``, ties at the cut to the
    lowest indices, ascending. Coordinates sharing the median's bucket tie often (in these cases the
    C selection and ``torch.topk`` gave their lists in different orders, and for seeds 1, 7 and 18
    kept different tied coordinates)."""
    from hvd_scalecom import native
    from hvd_scalecom.sketched_qsparse_config import SketchedSGDConfig
    from hvd_scalecom.torch.sketched_steps import heavy_candidates

    config = SketchedSGDConfig()
    d = 16384
    k = config.num_selected([d])
    count = config.num_candidates(k, d)
    generator = torch.Generator().manual_seed(seed)
    sketch = CountSketch(d, config.rows, config.num_columns(k), seed=seed)
    table = sketch.sketch(torch.randn(d, generator=generator)) + sketch.sketch(torch.randn(d, generator=generator))
    magnitude = sketch.estimate(table).abs().numpy()
    expected = np.sort(np.argsort(-magnitude, kind="stable")[:count])
    assert np.count_nonzero(magnitude == magnitude[expected].min()) > 1  # a tie at the cut
    found = heavy_candidates(sketch, table, count)
    with native.torch_operations():
        by_torch = heavy_candidates(sketch, table, count)
    np.testing.assert_array_equal(found.numpy(), expected)
    np.testing.assert_array_equal(by_torch.numpy(), expected)


def test_seed_beyond_the_generators_range_is_refused_before_any_state():
    from hvd_scalecom.sim import Simulator
    from hvd_scalecom.torch import QsparseLocalSGD, SketchedSGD

    for make in (lambda: SketchedSGD(small_model().named_parameters(), seed=2**63),
                 lambda: QsparseLocalSGD(torch.optim.SGD(small_model().parameters(), lr=0.1),
                                         small_model().named_parameters(), seed=2**63),
                 lambda: SimSketchedSGD(seed=2**63)):
        with pytest.raises(ValueError, match="seed must be below 2"):
            make()
    SketchedSGD(small_model().named_parameters(), seed=2**63 - 1)
    from hvd_scalecom.sim import PowerSGD  # its per-tensor seed wraps below 2**63
    sim = Simulator(PowerSGD(seed=2**62, min_numel=16), 2, Net().named_parameters())
    sim.step([[torch.ones_like(p) for p in Net().parameters()] for _ in range(2)])


def test_the_waits_for_both_rounds_are_counted_apart_from_compression(monkeypatch):
    """stats(): the waits for round 1's and round 2's allreduces are index_wait_seconds, which
    compress_seconds leaves out (here each collective is made to take at least 0.2 s longer)."""
    import horovod.torch as hvd

    from hvd_scalecom.torch import SketchedSGD, sketched_sgd

    hvd.init()  # (one rank, in this process)
    model = small_model()
    compression = SketchedSGD(model.named_parameters(), ratio=0.1, min_numel=50)

    def slow(collective):
        def call(*args, **kwargs):
            time.sleep(0.2)
            return collective(*args, **kwargs)
        return call

    def step():
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        sent = [compression.compress(p.grad) for p in model.parameters()]
        for values, ctx in sent:
            compression.decompress(values, ctx)

    step()  # (its first compress checks the configuration across ranks, by collectives of its own)
    monkeypatch.setattr(sketched_sgd.hvd, "synchronize", slow(hvd.synchronize))
    monkeypatch.setattr(sketched_sgd.hvd, "allreduce", slow(hvd.allreduce))
    step()
    stats = compression.stats(step=1)
    assert stats["index_wait_seconds"] >= 0.4 and stats["compress_seconds"] < 0.2, stats
