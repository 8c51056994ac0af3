"""Qsparse-local-SGD on Horovod (hvd_scalecom.torch.QsparseLocalSGD around torch.optim.SGD) under real
horovodrun, step by step against the simulator (hvd_scalecom.sim.QsparseLocalSGD) fed the job's
per-rank gradients; the bytes of the payload allgather, from Horovod's timeline; checkpoints; bad input;
and the wire format's bit-exactness against the quantize.py operators.

The job is tests/workers/torch_seed_qsparse.py: a 48-64-10 MLP (weights 3072 and 640 entries, biases
64 and 10), plain or momentum SGD at lr 0.1 on every rank's own data. Launches are few (each costs
seconds of start-up): the runs share the jobs of tests/test_torch_sketched_sgd.py
(tests/jobs.py), each run of the worker following others in the same processes.
"""

import json

import numpy as np
import pytest
import torch
from jobs import add_run, rank_sections
from reference import QsparseReference
from test_torch_sketched_sgd import completed

from devtools.launch import HorovodRunError
from hvd_scalecom.sim import QsparseLocalSGD as SimQsparse
from hvd_scalecom.sim import Simulator
from hvd_scalecom.torch.qsparse_steps import compress_delta, decode, encode, mean_of_sparse
from hvd_scalecom.torch.quantize import qsgd_top_k, sign_top_k

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
NUMEL = {"hidden.weight": 3072, "hidden.bias": 64, "out.weight": 640, "out.bias": 10}
QSGD_OPTS = {"operator": "qsgd_top_k", "local_steps": 3, "ratio": 0.05, "min_numel": 600, "steps": 7}
SIGN_OPTS = {"operator": "sign_top_k", "local_steps": 2, "ratio": 0.05, "max_k": 50, "min_numel": 0,
             "momentum": 0.9, "index_dtype": "int64"}
add_run("np3", "qsparse_qsgd", "torch_seed_qsparse.py", QSGD_OPTS,
        ["test_qsgd_three_ranks_match_the_simulator_and_the_timeline"])
UNDER_MPI = {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 4}
add_run("np3_mpi", "qsparse_mpi", "torch_seed_qsparse.py", UNDER_MPI,
        ["test_qsparse_under_mpi_matches_the_simulator"])
add_run("np2_first", "qsparse_sign_first", "torch_seed_qsparse.py",
        {**SIGN_OPTS, "steps": 5, "checkpoint": True}, ["test_sign_momentum_int64_and_checkpoint_round_trip"])
add_run("np2_second", "qsparse_sign_second", "torch_seed_qsparse.py",
        lambda root: {**SIGN_OPTS, "steps": 3, "first_step": 5,
                      "resume_from": str(root / "qsparse_sign_first")},
        ["test_sign_momentum_int64_and_checkpoint_round_trip"])
add_run("np2_second", "qsparse_different_models", "torch_seed_qsparse.py",
        {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 2,
         "skip_broadcast": True, "model_seed_offset": 1},
        ["test_ranks_starting_from_different_models_all_raise"], fails=True)
# a model cast to float32 on one rank from the same bfloat16 values (a bfloat16 checkpoint): x_last is
# fp32 on both and equal, so the ranks used to train on silently, rank 1 rounding to bfloat16
BF16_ON_ONE_RANK = {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 4,
                    "skip_broadcast": True, "bf16_values": True, "expect_refusal": True,
                    "per_rank": {"1": {"dtype": "bfloat16"}}}
add_run("np2_second", "qsparse_dtype_on_one_rank", "torch_seed_qsparse.py", BF16_ON_ONE_RANK,
        ["test_ranks_whose_parameter_dtypes_differ_all_raise"])
RETRY = {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 4,
         "skip_broadcast": True, "model_seed_offset": 1, "broadcast_after_refusal": True}
add_run("np2_second", "qsparse_retry_after_broadcast", "torch_seed_qsparse.py", RETRY,
        ["test_a_first_step_refused_for_different_models_succeeds_once_the_model_is_broadcast"])
add_run("np2_reload", "qsparse_partial_reload", "torch_seed_qsparse.py",
        {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 6,
         "reload": {"save_at": 1, "load_at": 3, "rank": 1}},
        ["test_a_state_restored_on_one_rank_alone_is_an_error_on_every_rank"], fails=True)
add_run("np2_reload", "qsparse_partial_reload_caught", "torch_seed_qsparse.py",
        {"operator": "qsgd_top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 6,
         "reload": {"save_at": 1, "load_at": 3, "rank": 1, "catch": True}},
        ["test_a_refused_synchronisation_leaves_the_wrappers_state_as_it_was"])
add_run("np2_reload_dense", "qsparse_partial_reload_dense", "torch_seed_qsparse.py",  # nothing compressed
        {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 10**6, "steps": 6,
         "reload": {"save_at": 1, "load_at": 3, "rank": 1}},
        ["test_a_state_restored_on_one_rank_alone_is_an_error_on_every_rank"], fails=True)

ONE_RANK_SIGN = {"operator": "sign_top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 0, "steps": 4}
FLOAT64_TOP_K = {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 4,
                 "dtype": "float64"}
for part, opts in (("qsparse_one_rank_sign", ONE_RANK_SIGN), ("qsparse_float64_top_k", FLOAT64_TOP_K)):
    add_run("np1", part, "torch_seed_qsparse.py", opts, ["test_one_rank_and_float64_parameters_match_the_simulator"])
NAN = {"operator": "sign_top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 4,
       "nan_at": [[3, 1, "hidden.weight"]]}
add_run("np2_first", "qsparse_nan", "torch_seed_qsparse.py", NAN,
        ["test_a_nan_in_one_ranks_model_reaches_every_rank_and_no_memory"])
BF16_QSGD = {**QSGD_OPTS, "local_steps": 2, "steps": 5, "dtype": "bfloat16"}
add_run("np2_first", "qsparse_bf16", "torch_seed_qsparse.py", BF16_QSGD,
        ["test_bf16_parameters_synchronise_through_an_fp32_model_as_the_simulator_does"])
# torch.amp.GradScaler on every rank; rank 1's loss is inf at steps 2 and 5 (5: a synchronisation)
SCALER = {"operator": "top_k", "local_steps": 2, "ratio": 0.05, "min_numel": 600, "steps": 6,
          "scaler": {"inf_at": [[2, 1], [5, 1]]}}
add_run("np2_first", "qsparse_scaler", "torch_seed_qsparse.py", SCALER,
        ["test_a_step_the_grad_scaler_skips_on_one_rank_still_counts"])


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(48, 64)
        self.out = torch.nn.Linear(64, 10)


def dtype_of(opts):
    return getattr(torch, opts.get("dtype", "float32"))


def simulator(opts, n):
    torch.manual_seed(0)
    scheme = SimQsparse(lr=0.1, local_steps=opts["local_steps"], ratio=opts["ratio"], max_k=opts.get("max_k"),
                        operator=opts["operator"], levels=opts.get("levels", 256),
                        momentum=opts.get("momentum", 0.0), min_numel=opts["min_numel"],
                        seed=opts.get("seed", 0))
    return Simulator(scheme, n, Net().to(dtype_of(opts)).named_parameters())


def reference(opts, n):
    """The NumPy reference of the paper's equations (tests/reference.py), from the job's initial model."""
    torch.manual_seed(0)
    x0 = {m: p.detach().double().numpy() for m, p in Net().to(dtype_of(opts)).named_parameters()}
    return QsparseReference(x0, n, lr=0.1, local_steps=opts["local_steps"], ratio=opts["ratio"],
                            operator=opts["operator"], levels=opts.get("levels", 256),
                            momentum=opts.get("momentum", 0.0), max_k=opts.get("max_k"),
                            min_numel=opts["min_numel"], seed=opts.get("seed", 0))


def follow(ref, results, steps, first=0, rtol=1e-5, atol=1e-6, names=NAMES):
    """Feed the job's raw gradients to the reference; after every step each rank's weights (of
    ``names``) must be the reference's worker's (float64 there, so to the job's rounding)."""
    for t in range(first, first + steps):
        ref.step([{n: r[f"raw/{t}/{n}"] for n in NAMES} for r in results])
        for rank, r in enumerate(results):
            for n in names:
                np.testing.assert_allclose(r[f"local/{t}/{n}"].reshape(-1), ref.local[rank][n], rtol=rtol,
                                           atol=atol, err_msg=f"step {t}, {n}, rank {rank}: the reference")


def as_recorded(tensor):
    """``tensor`` in NumPy as the worker records it (bfloat16 as float32)."""
    return (tensor.float() if tensor.dtype is torch.bfloat16 else tensor).numpy()


def replay(sim, results, steps, first=0, rtol=1e-6, atol=1e-7, dtype=None):
    """Feed the job's raw gradients to ``sim``; after every step each rank's weights must be the
    simulator's worker's. Returns the simulator's per-step updates (the change at synchronisations).
    ``dtype``: the gradients' where the job recorded them in another (bfloat16 as float32)."""
    updates = []
    for t in range(first, first + steps):
        grads = [[torch.from_numpy(r[f"raw/{t}/{n}"]) for n in NAMES] for r in results]
        step = sim.step(grads if dtype is None else [[g.to(dtype) for g in row] for row in grads])
        for j, n in enumerate(NAMES):
            for rank, r in enumerate(results):
                np.testing.assert_allclose(r[f"local/{t}/{n}"], as_recorded(sim.worker_params()[j][rank]),
                                           rtol=rtol, atol=atol, err_msg=f"step {t}, {n}, rank {rank}")
        updates.append(dict(zip(NAMES, step.update)))
    return updates


def check_synchronised(results, t):
    for n in NAMES:
        for rank, r in enumerate(results[1:], 1):
            np.testing.assert_array_equal(r[f"local/{t}/{n}"], results[0][f"local/{t}/{n}"],
                                          err_msg=f"{n} differs between rank 0 and {rank} after step {t}")


def test_qsgd_three_ranks_match_the_simulator_and_the_timeline(horovod_jobs):
    """np=3, QSGD-TopK with s = 256, H = 3, 7 steps (two synchronisations and a local step after);
    the weights are compressed, the biases averaged densely."""
    from devtools.timeline import read_operations

    opts = QSGD_OPTS
    job = horovod_jobs("np3")
    timeline = job["timeline"]
    results = completed(job, "qsparse_qsgd", 3)
    assert len(results) == 3
    updates = replay(simulator(opts, 3), results, 7)
    follow(reference(opts, 3), results, 7)
    for t in (2, 5):  # synchronisations: k = ceil(0.05 numel) entries per rank, up to 3 k distinct
        check_synchronised(results, t)
        for n, k in (("hidden.weight", 154), ("out.weight", 32)):
            assert k <= np.count_nonzero(updates[t][n].numpy()) <= 3 * k
        assert np.count_nonzero(updates[t]["hidden.bias"].numpy()) == 64
    assert not np.array_equal(results[0]["local/6/hidden.weight"], results[1]["local/6/hidden.weight"])

    # Per rank and synchronisation: int32 indices, int16 levels and a float32 norm per weight, and the
    # biases' fp32 allreduce; what dense SGD would send in H = 3 steps is the baseline.
    index_bytes, value_bytes, dense_bytes = 4 * (154 + 32), 2 * (154 + 32) + 4 * 2, 4 * (64 + 10)
    moved = {}
    for op in read_operations(timeline):
        moved.setdefault(op["name"], []).append((op["shape"], op["dtype"]))
    header = 16  # each rank's step and x_last checksum, before its tensors
    assert moved["allgather.qsparse_local_sgd.payload"] == [([3 * (header + index_bytes + value_bytes)], "uint8")] * 2
    assert moved["grouped_allreduce.qsparse_local_sgd.dense_1of2"] == [([64], "float32")] * 2
    assert moved["grouped_allreduce.qsparse_local_sgd.dense_2of2"] == [([10], "float32")] * 2
    for r in results:
        for t in range(7):
            stats = json.loads(str(r[f"stats/{t}"]))
            if t in (2, 5):
                assert (stats["index_bytes"], stats["value_bytes"], stats["dense_bytes"]) == \
                    (index_bytes, value_bytes, dense_bytes)
                assert stats["uncompressed_bytes"] == 3 * 4 * 3786 and stats["tensors"] == 4
                wire = 2 * (index_bytes + value_bytes) + 4 / 3 * dense_bytes  # allgather, allreduce
                assert stats["wire_bytes"] == pytest.approx(wire)
            else:
                assert stats["sent_bytes"] == 0 and stats["tensors"] == 0
        assert json.loads(str(r["stats"]))["step"] == 5


def test_qsparse_under_mpi_matches_the_simulator(horovod_jobs):
    """np=3 under MPI (horovodrun --mpi, Open MPI carrying the payload allgather) as under Gloo:
    TopK, H = 2, two synchronisations."""
    results = completed(horovod_jobs("np3_mpi"), "qsparse_mpi", 3)
    assert not any(bool(r["gloo"]) for r in results)
    replay(simulator(UNDER_MPI, 3), results, UNDER_MPI["steps"])
    follow(reference(UNDER_MPI, 3), results, UNDER_MPI["steps"])
    for t in (1, 3):
        check_synchronised(results, t)


def test_sign_momentum_int64_and_checkpoint_round_trip(horovod_jobs):
    """np=2, SignTopK with k = min(ceil(0.05 numel), 50) on every tensor (min_numel 0), local momentum
    0.9, H = 2, int64 indices. 5 steps, a checkpoint one step into an interval, new processes, 3 more
    steps: the simulator runs all 8 in one go and the resumed job must continue exactly as it does."""
    opts = SIGN_OPTS
    first = completed(horovod_jobs("np2_first"), "qsparse_sign_first", 2)
    second = completed(horovod_jobs("np2_second"), "qsparse_sign_second", 2)
    sim = simulator(opts, 2)
    updates = replay(sim, first, 5)
    ref = reference(opts, 2)
    follow(ref, first, 5)
    follow(ref, second, 3, first=5)
    ks = {"hidden.weight": 50, "hidden.bias": 4, "out.weight": 32, "out.bias": 1}
    for n, k in ks.items():  # SignTopK: one magnitude per rank and tensor: s0, s1, s0 + s1, |s0 - s1| (/2)
        nonzero = updates[3][n].numpy()[updates[3][n].numpy() != 0]
        assert k <= nonzero.size <= 2 * k and len(np.unique(np.abs(nonzero).round(7))) <= 4
    replay(sim, second, 3, first=5)
    for t in (1, 3):
        check_synchronised(first, t)
    check_synchronised(second, 7)
    stats = json.loads(str(first[0]["stats/3"]))
    assert stats["index_bytes"] == 8 * sum(ks.values())
    assert stats["value_bytes"] == sum(ks.values()) + 4 * 4 and stats["dense_bytes"] == 0
    # Control: the same resumed job without the wrapper's state (memories, x_last) ends elsewhere: the
    # restored state is what the match above depends on.
    forgetful = simulator(opts, 2)
    replay(forgetful, first, 5)
    for entry in forgetful.scheme.state.values():
        entry["memory"].zero_()
    with pytest.raises(AssertionError):
        replay(forgetful, second, 3, first=5)


def test_one_rank_and_float64_parameters_match_the_simulator(horovod_jobs):
    """horovodrun -np 1: SignTopK on all four tensors, whose int8 codes leave the gathered payload's
    rows a width that is no multiple of 4 (its fields are read from copies of their own); and TopK on a
    float64 model, whose values travel as float64. Both follow the simulator step by step."""
    job = horovod_jobs("np1")
    sign = completed(job, "qsparse_one_rank_sign", 1)
    replay(simulator(ONE_RANK_SIGN, 1), sign, 4)
    follow(reference(ONE_RANK_SIGN, 1), sign, 4)
    stats = json.loads(str(sign[0]["stats/1"]))
    ks = {"hidden.weight": 154, "hidden.bias": 4, "out.weight": 32, "out.bias": 1}
    assert (stats["index_bytes"], stats["value_bytes"]) == (4 * sum(ks.values()), sum(ks.values()) + 4 * 4)
    wide = completed(job, "qsparse_float64_top_k", 1)
    assert wide[0]["local/3/hidden.weight"].dtype == np.float64
    updates = replay(simulator(FLOAT64_TOP_K, 1), wide, 4, rtol=1e-12, atol=1e-14)
    follow(reference(FLOAT64_TOP_K, 1), wide, 4, rtol=1e-12, atol=1e-14)
    assert np.count_nonzero(updates[1]["hidden.weight"].numpy()) == 154
    stats = json.loads(str(wide[0]["stats/1"]))
    assert (stats["index_bytes"], stats["value_bytes"], stats["dense_bytes"]) == \
        (4 * (154 + 32), 8 * (154 + 32), 8 * (64 + 10))
    from pathlib import Path

    from hvd_scalecom.torch import qsparse_local_sgd  # as the docs say
    guide = (Path(__file__).resolve().parent.parent / "docs" / "other-schemes.md").read_text()
    assert "`top_k` sends them in the memory's dtype\n  (fp32; fp64 for fp64 parameters)" in guide
    assert "fp32, fp64 for fp64 parameters" in qsparse_local_sgd.QsparseLocalSGD.stats.__doc__


def test_a_nan_in_one_ranks_model_reaches_every_rank_and_no_memory(horovod_jobs):
    """np=2, SignTopK, H = 2: rank 1's gradient of hidden.weight has a NaN at step 3, a synchronisation.
    Rank 1 sends NaN for that tensor (its scale), so x_new carries NaN on both ranks, as model averaging
    would, and both keep their memory of it from step 1 (counted in nonfinite_skips); out.weight
    synchronises as usual. Step by step as the simulator and the reference."""
    results = completed(horovod_jobs("np2_first"), "qsparse_nan", 2)
    assert np.isnan(results[1]["raw/3/hidden.weight"].reshape(-1)[7])
    sim = simulator(NAN, 2)
    replay(sim, results, 4)
    assert sim.scheme.nonfinite_skips == 1
    ref = reference(NAN, 2)
    follow(ref, results, 4)
    check_synchronised(results, 3)
    assert np.isnan(results[0]["local/3/hidden.weight"]).sum() == 154  # rank 1's k indices
    assert np.isfinite(results[0]["local/3/out.weight"]).all()
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["memory/3/hidden.weight"], r["memory/1/hidden.weight"])
        assert not np.array_equal(r["memory/3/out.weight"], r["memory/1/out.weight"])
        for n in ("hidden.weight", "out.weight"):
            assert np.isfinite(r[f"memory/3/{n}"]).all()
            np.testing.assert_allclose(r[f"memory/3/{n}"].reshape(-1), ref.memory[rank][n], rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(r[f"memory/3/{n}"].reshape(-1), sim.scheme.state[n]["memory"][rank])
        assert [json.loads(str(r[f"stats/{t}"]))["nonfinite_skips"] for t in range(4)] == [0, 0, 0, 1]


def test_bf16_parameters_synchronise_through_an_fp32_model_as_the_simulator_does(horovod_jobs):
    """np=2, bfloat16 parameters (Horovod's collectives take none): QSGD-TopK, H = 2, 5 steps. x_last,
    the memories and the dense biases are float32, the payload carries float32 norms; each rank's
    bfloat16 weights follow the simulator's exactly, step by step. The float64 reference agrees to
    bfloat16's rounding where no top-k decides (the first local step, and the dense biases
    throughout): at a synchronisation bfloat16's rounding of the drift changes which of two nearly
    equal entries is selected."""
    opts = BF16_QSGD
    results = completed(horovod_jobs("np2_first"), "qsparse_bf16", 2)
    assert str(results[0]["param_dtype"]) == "torch.bfloat16"
    updates = replay(simulator(opts, 2), results, 5, rtol=0, atol=0, dtype=torch.bfloat16)
    for t in (1, 3):
        check_synchronised(results, t)
        for n, k in (("hidden.weight", 154), ("out.weight", 32)):
            assert k <= np.count_nonzero(as_recorded(updates[t][n])) <= 2 * k
    # (tolerance: by step 4 the biases have been rounded to bfloat16 seven times, 2^-8 each: five
    # local steps and two synchronisations)
    follow(reference(opts, 2), results, 1, rtol=3e-2, atol=1e-4)
    follow(reference(opts, 2), results, 5, rtol=3e-2, atol=1e-4, names=["hidden.bias", "out.bias"])
    stats = json.loads(str(results[0]["stats/1"]))
    assert (stats["index_bytes"], stats["value_bytes"], stats["dense_bytes"]) == \
        (4 * (154 + 32), 2 * (154 + 32) + 4 * 2, 4 * (64 + 10))
    assert stats["uncompressed_bytes"] == 2 * 4 * 3786  # (bfloat16 counted as the float32 it travels in)


def test_ranks_starting_from_different_models_all_raise(horovod_jobs):
    job = horovod_jobs("np2_second")
    assert isinstance(job["error"], HorovodRunError) and not job["results"]["qsparse_different_models"]
    by_rank = rank_sections(str(job["error"]))
    for rank in (0, 1):
        assert "QsparseLocalSGD is configured differently on different ranks (shared_digest differ)" \
            in by_rank[rank]
        assert "hvd.broadcast_parameters(model.state_dict(), root_rank=0)" in by_rank[rank]


def test_ranks_whose_parameter_dtypes_differ_all_raise(horovod_jobs):
    """Rank 0 in float32, rank 1 in bfloat16, from the same bfloat16 values: x_last (float32 on both) is
    equal, and the ranks used to train on in different precisions, silently (their synchronised models
    then differ by bfloat16's rounding). Every rank raises at the first step, naming the dtypes."""
    results = completed(horovod_jobs("np2_second"), "qsparse_dtype_on_one_rank", 2)
    for r in results:
        assert "QsparseLocalSGD is configured differently on different ranks (parameter_dtypes differ): " \
               "rank 0: parameter_dtypes=['float32']; rank 1: parameter_dtypes=['bfloat16']" in str(r["refused"])
        assert not any(key.startswith("local/") for key in r)


def test_a_first_step_refused_for_different_models_succeeds_once_the_model_is_broadcast(horovod_jobs):
    """Ranks start from different models: the first step() is refused, having changed nothing (x_last
    included); the model broadcast from rank 0, as the error advises, the same step succeeds and the run
    follows the reference from rank 0's model."""
    results = completed(horovod_jobs("np2_second"), "qsparse_retry_after_broadcast", 2)
    for r in results:
        assert "configured differently on different ranks (shared_digest differ)" in str(r["refused"])
    follow(reference(RETRY, 2), results, 4)
    check_synchronised(results, 3)


@pytest.mark.parametrize("job", ["np2_reload", "np2_reload_dense"])
def test_a_state_restored_on_one_rank_alone_is_an_error_on_every_rank(job, horovod_jobs):
    """Rank 1 alone goes back two steps: at the next synchronisation every rank sees the other's step
    in the payload's header and raises (no rank waits in a collective the other never posts); also
    where no tensor is compressed (``np2_reload_dense``: the header then travels alone)."""
    job = horovod_jobs(job)
    assert isinstance(job["error"], HorovodRunError)
    by_rank = rank_sections(str(job["error"]))
    for rank in (0, 1):
        assert "QsparseLocalSGD: the ranks synchronise at steps [3, 1]" in by_rank[rank]
        assert "every rank must restore the same state" in by_rank[rank]


def test_a_refused_synchronisation_leaves_the_wrappers_state_as_it_was(horovod_jobs):
    """The ValueError of a rank restored alone, caught on every rank: the step counter, x_last, the
    memories (rows of both compressed tensors by then) and QSGD's generator are those from before the
    step (only the local optimizer's step was taken)."""
    job = horovod_jobs("np2_reload")
    for r in completed(job, "qsparse_partial_reload_caught", 2):
        assert "the ranks synchronise at steps [3, 1]" in str(r["refused"])
        assert int(r["refused_at"]) == 3 and bool(r["state_unchanged"])


# -- in one process: the wire format, the equations against the simulator, bad input, state ------------

def test_wire_format_decodes_to_the_operators_bit_for_bit():
    generator = torch.Generator().manual_seed(3)
    kept = torch.randn(4, 37, generator=generator)
    kept[1, :5] = 0.0  # exact zeros among the kept values (fewer non-zeros than k)
    kept[2] = 0.0
    noise = torch.rand(4, 37, generator=generator)
    scale, codes = encode(kept, "sign_top_k")
    assert codes.dtype == torch.int8 and scale.shape == (4, 1)
    assert torch.equal(decode(scale, codes, "sign_top_k"), sign_top_k(kept))
    for levels, dtype in ((3, "int8"), (256, "int16"), (40000, "int32")):
        scale, codes = encode(kept, "qsgd_top_k", levels, noise, dtype)
        assert torch.equal(decode(scale, codes, "qsgd_top_k", levels), qsgd_top_k(kept, levels, noise))
        assert int(codes.abs().max()) <= levels
    assert torch.equal(decode(*encode(kept, "top_k"), "top_k"), kept)


def test_qsgd_levels_stay_at_most_s_near_float_underflow():
    """There the computed norm can fall below |v| (4.58e-23 > ||[4.58e-23, 9.32e-24]|| in fp32), and
    a level above s = 127 would wrap around in int8, flipping the sign."""
    kept = torch.tensor([[4.58e-23, 9.32e-24]])
    noise = torch.zeros(1, 2)
    assert float(kept.norm()) < float(kept[0, 0])  # the premise, in float32
    scale, codes = encode(kept, "qsgd_top_k", 127, noise, "int8")
    assert codes.tolist() == [[127, 32]]
    decoded = decode(scale, codes, "qsgd_top_k", 127)
    assert torch.equal(decoded, qsgd_top_k(kept, 127, noise)) and bool((decoded > 0).all())


@pytest.mark.parametrize("operator", ["sign_top_k", "qsgd_top_k"])
def test_finite_values_whose_sum_overflows_are_quantized_not_skipped(operator):
    """||v||_2 of entries near 1e20 (and ||v||_1 near 1e38) overflows float32 while the operator's
    result is representable: each is what the same values scaled down by 2^70 (an exact scaling) give,
    scaled back, where an overflow used to turn the row into NaN and skip every memory update."""
    drift = torch.tensor([[1e20, -2e20, 3e19, 0.0, 1.0, 7e19],
                          [3e38, -3e38, 2e38, 0.0, 1.0, 1e38]])
    noise = torch.full((2, 4), 0.5)
    *_, c, memory = compress_delta(torch.zeros(2, 6), drift, 4, operator, 256, noise)
    *_, c_small, memory_small = compress_delta(torch.zeros(2, 6), drift * 2.0**-70, 4, operator, 256, noise)
    if operator == "qsgd_top_k":  # sqrt(4) * 3e38 is beyond float32: that row's norm cannot be sent
        c, memory, c_small, memory_small = c[:1], memory[:1], c_small[:1], memory_small[:1]
    assert bool(torch.isfinite(c).all()) and bool(torch.isfinite(memory).all())
    torch.testing.assert_close(c, c_small * 2.0**70, rtol=1e-6, atol=0)
    torch.testing.assert_close(memory, memory_small * 2.0**70, rtol=1e-6, atol=0)


@pytest.mark.parametrize("operator", ["top_k", "sign_top_k", "qsgd_top_k"])
def test_one_row_at_a_time_equals_all_workers_at_once(operator):
    """What each Horovod rank computes on its own row equals the simulator's all-rows computation."""
    generator = torch.Generator().manual_seed(5)
    n, numel, k = 3, 200, 17
    memory = torch.randn(n, numel, generator=generator)
    drift = torch.randn(n, numel, generator=generator)
    noise = torch.rand(n, k, generator=generator)
    before = memory.clone()
    indices, _, _, c, together = compress_delta(memory, drift, k, operator, 256, noise)
    assert torch.equal(memory, before)  # the caller adopts the new memories
    rows = []
    for i in range(n):
        got = compress_delta(memory[i:i + 1], drift[i:i + 1], k, operator, 256, noise[i:i + 1])
        assert torch.equal(got[0], indices[i:i + 1]) and torch.equal(got[3], c[i:i + 1])
        assert torch.equal(got[4], together[i:i + 1])
        rows.append(got)
    mean = mean_of_sparse(torch.cat([r[0] for r in rows]), torch.cat([r[3] for r in rows]), numel, n)
    assert torch.equal(mean, mean_of_sparse(indices, c, numel, n))


def small_setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("kwargs, error, argument", [
    ({"local_steps": 0}, ValueError, "local_steps"),
    ({"local_steps": 2.0}, TypeError, "local_steps"),
    ({"ratio": 0}, ValueError, "ratio"),
    ({"max_k": 0}, ValueError, "max_k"),
    ({"operator": "sign"}, ValueError, "operator"),
    ({"levels": 0}, ValueError, "levels"),
    ({"min_numel": -1}, ValueError, "min_numel"),
    ({"seed": "x"}, TypeError, "seed"),
    ({"index_dtype": torch.float32}, ValueError, "index_dtype"),
])
def test_bad_arguments(kwargs, error, argument):
    from hvd_scalecom.torch import QsparseLocalSGD

    model, optimizer = small_setup()
    with pytest.raises(error, match=argument):
        QsparseLocalSGD(optimizer, model.named_parameters(), **kwargs)


@pytest.mark.parametrize("index_dtype", [np.int32, torch.float32, "torch.int64", np.dtype("float16")])
def test_a_bad_index_dtype_gets_scalecoms_error(index_dtype):
    """index_dtype is read as ScaleCom reads it: a bad one is refused with ScaleCom's message, naming the
    value as given (a NumPy type was named as "int32'>", torch.float32 as 'float32')."""
    from hvd_scalecom.sketched_qsparse_config import QsparseConfig
    from hvd_scalecom.torch import QsparseLocalSGD, ScaleCom

    model, optimizer = small_setup()
    with pytest.raises(ValueError) as scalecom:
        ScaleCom(model.named_parameters(), index_dtype=index_dtype)
    with pytest.raises(ValueError, match="index_dtype") as qsparse:
        QsparseLocalSGD(optimizer, model.named_parameters(), index_dtype=index_dtype)
    assert str(qsparse.value) == str(scalecom.value)
    for good in (torch.int64, np.dtype("int64"), "int64"):
        assert QsparseConfig(index_dtype=good).index_dtype == "int64"
        assert QsparseLocalSGD(optimizer, model.named_parameters(), index_dtype=good).config.index_dtype == "int64"


def test_bad_optimizer_and_parameters():
    from hvd_scalecom.torch import QsparseLocalSGD

    model, optimizer = small_setup()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        QsparseLocalSGD(model, model.named_parameters())
    # hvd.DistributedOptimizer's class, built as Horovod builds it (its __init__ needs hvd.init()).
    from horovod.torch.optimizer import _DistributedOptimizer
    cls = type("SGD", (torch.optim.SGD,), dict(_DistributedOptimizer.__dict__))
    distributed = cls.__new__(cls)
    torch.optim.SGD.__init__(distributed, model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not hvd.DistributedOptimizer"):
        QsparseLocalSGD(distributed, model.named_parameters())
    model, optimizer = small_setup()
    with pytest.raises(ValueError, match="not in named_parameters"):
        QsparseLocalSGD(optimizer, list(model.named_parameters())[:2])
    with pytest.raises(TypeError, match="named_parameters"):
        QsparseLocalSGD(optimizer, None)
    wrapped = QsparseLocalSGD(optimizer, model.named_parameters())
    with pytest.raises(ValueError, match="already a QsparseLocalSGD"):
        QsparseLocalSGD(wrapped, model.named_parameters())
    with pytest.raises(ValueError, match="parameter groups"):
        wrapped.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    import horovod.torch as hvd
    hvd.init()  # (one rank, in this process)
    with pytest.raises(TypeError, match="hvd.DistributedOptimizer cannot wrap a QsparseLocalSGD"):
        hvd.DistributedOptimizer(wrapped, named_parameters=model.named_parameters())
    class Subclass(QsparseLocalSGD):  # (a subclass of its own is a QsparseLocalSGD as any)
        pass
    model, optimizer = small_setup()
    assert Subclass(optimizer, model.named_parameters()).config == wrapped.config


def test_state_dict_round_trip_and_checks():
    from hvd_scalecom.torch import QsparseLocalSGD

    model, optimizer = small_setup()
    wrapped = QsparseLocalSGD(optimizer, model.named_parameters(), local_steps=4, ratio=0.1)
    state = wrapped.state_dict()
    assert set(state) == {"state", "param_groups", "qsparse_local_sgd"}
    mine = state["qsparse_local_sgd"]
    mine["step"] = 6
    for name, p in model.named_parameters():
        mine["params"][name] = {"shared": torch.full((p.numel(),), 0.5, dtype=torch.float64),  # kept in fp32,
                                "memory": torch.full((p.numel(),), 0.25, dtype=torch.float16)}  # as made
    bad = {**state, "qsparse_local_sgd": {**mine, "params": dict(mine["params"])}}
    bad["qsparse_local_sgd"]["params"]["1.bias"] = {"shared": torch.zeros(3), "memory": None}
    with pytest.raises(ValueError, match="1.bias"):
        wrapped.load_state_dict(bad)
    assert wrapped.state_dict()["qsparse_local_sgd"]["step"] == 0  # untouched
    with pytest.raises(ValueError, match="config"):
        QsparseLocalSGD(optimizer, model.named_parameters(), local_steps=5, ratio=0.1).load_state_dict(state)
    with pytest.raises(ValueError, match="returned by QsparseLocalSGD.state_dict"):
        wrapped.load_state_dict(optimizer.state_dict())
    for part in (None, [1]):
        with pytest.raises(TypeError, match=rf"state_dict\['qsparse_local_sgd'\] must be a dict .*, "
                                            rf"got {type(part).__name__}"):
            wrapped.load_state_dict({**state, "qsparse_local_sgd": part})
    short = {**state, "qsparse_local_sgd": {**mine, "generator": torch.zeros(7, dtype=torch.uint8)}}
    with pytest.raises(ValueError, match="generator"):  # checked before anything changes
        wrapped.load_state_dict(short)
    assert wrapped.state_dict()["qsparse_local_sgd"]["step"] == 0
    for key, value, error, match in (("last_sync", "yesterday", TypeError, "state last_sync must be an int"),
                                     ("last_sync", -7, ValueError, "state last_sync must be >= 0"),
                                     ("last_sync", 7, ValueError, "synchronisation step before step 6"),
                                     ("last_sync", 2, ValueError, r"\(local_steps 4\), got 2"),
                                     ("step", 2 ** 63 + 5, ValueError, "state step must be below 2\\*\\*63")):
        with pytest.raises(error, match=match):
            wrapped.load_state_dict({**state, "qsparse_local_sgd": {**mine, key: value}})
        assert wrapped.state_dict()["qsparse_local_sgd"]["step"] == 0
    wrapped.load_state_dict({**state, "qsparse_local_sgd": {**mine, "last_sync": 3}})
    assert wrapped.stats()["step"] == 3
    wrapped.load_state_dict(state)
    # torch's load_state_dict gives the wrapped optimizer new param_groups: a scheduler (or a hand-made
    # warm-up) changing the wrapper's learning rate must still reach the optimizer that steps
    torch.optim.lr_scheduler.LambdaLR(wrapped, lambda epoch: 0.5)  # (sets the lr of epoch 0)
    assert wrapped.param_groups is optimizer.param_groups and optimizer.param_groups[0]["lr"] == 0.05
    wrapped.load_state_dict(state)
    restored = wrapped.state_dict()["qsparse_local_sgd"]
    assert restored["step"] == 6
    assert torch.equal(restored["params"]["0.weight"]["memory"], torch.full((1200,), 0.25))  # (fp32)
    assert torch.equal(wrapped.shared_parameters()["1.weight"], torch.full((2, 30), 0.5))


def test_step_hooks_deepcopy_and_pickle():
    """torch's step hooks run around step(); a deepcopy or pickle of (model, wrapper) carries the whole
    wrapper (its state, not its hooks, as torch's optimizers) and trains on exactly as the original."""
    import copy
    import pickle

    import horovod.torch as hvd

    from hvd_scalecom.torch import QsparseLocalSGD

    hvd.init()  # (one rank, in this process)
    model, optimizer = small_setup()
    wrapped = QsparseLocalSGD(optimizer, model.named_parameters(), local_steps=2, ratio=0.1)
    calls = []
    wrapped.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", opt is wrapped)))
    wrapped.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", opt is wrapped)))

    def step(m, opt, t):
        opt.zero_grad()
        m(torch.full((3, 40), float(t))).square().sum().backward()
        opt.step()

    step(model, wrapped, 0)
    assert calls == [("pre", True), ("post", True)]
    pairs = [(model, wrapped), copy.deepcopy((model, wrapped)), pickle.loads(pickle.dumps((model, wrapped)))]
    for _, opt in pairs[1:]:
        assert opt.state_dict()["qsparse_local_sgd"]["step"] == 1 and not opt._optimizer_step_pre_hooks
    for t in (1, 2):  # a synchronisation, then a local step
        for m, opt in pairs:
            step(m, opt, t)
    assert len(calls) == 6
    for m, opt in pairs[1:]:
        for a, b in zip(model.parameters(), m.parameters()):
            assert torch.equal(a, b)
        assert opt.stats()["index_bytes"] == wrapped.stats()["index_bytes"] > 0


def test_state_dict_hooks_register_and_run_as_in_torch():
    """torch's state-dict hooks (register_state_dict_pre_hook and the three others) register on the
    wrapper and run around its state_dict() and load_state_dict() (registering one was an
    AttributeError); a deepcopy drops them, as torch's optimizers do."""
    import copy

    from hvd_scalecom.torch import QsparseLocalSGD

    model, optimizer = small_setup()
    wrapped = QsparseLocalSGD(optimizer, model.named_parameters(), local_steps=4, ratio=0.1)
    calls = []
    wrapped.register_state_dict_pre_hook(lambda opt: calls.append(("save pre", opt is wrapped)))
    wrapped.register_state_dict_post_hook(lambda opt, state: {**state, "epoch": 3})

    def renamed(opt, state):  # a state saved under another key
        calls.append(("load pre", state.get("epoch")))
        return {("qsparse_local_sgd" if k == "old" else k): v for k, v in state.items() if k != "epoch"}

    wrapped.register_load_state_dict_pre_hook(renamed)
    wrapped.register_load_state_dict_post_hook(lambda opt: calls.append(("load post", opt is wrapped)))
    state = wrapped.state_dict()
    assert state["epoch"] == 3 and calls == [("save pre", True)]
    state["qsparse_local_sgd"]["step"] = 4
    state["old"] = state.pop("qsparse_local_sgd")
    wrapped.load_state_dict(state)
    assert calls[1:] == [("load pre", 3), ("load post", True)]
    assert wrapped.state_dict()["qsparse_local_sgd"]["step"] == 4
    copied = copy.deepcopy(wrapped)
    assert not copied._optimizer_state_dict_post_hooks and "epoch" not in copied.state_dict()


def test_a_step_the_grad_scaler_skips_on_one_rank_still_counts(horovod_jobs):
    """np=2, TopK, H = 2, every step through torch.amp.GradScaler: rank 1's gradients are inf at steps 2
    and 5, which its scaler skips (its scale halves twice, rank 0's stays). The skipped steps count, so
    both ranks synchronise at steps 1, 3 and 5, rank 1 at 5 without a local step; step by step as the
    simulator fed the unscaled gradients, zero at the skipped steps. (Counting only the steps taken,
    rank 1 synchronised at its step 4 with rank 0's 3, and rank 0's third synchronisation found
    rank 1 gone.)"""
    results = completed(horovod_jobs("np2_first"), "qsparse_scaler", 2)
    assert [float(results[0][f"scale/{t}"]) for t in range(6)] == [1024.0] * 6
    assert [float(results[1][f"scale/{t}"]) for t in range(6)] == [1024.0] * 2 + [512.0] * 3 + [256.0]
    replay(simulator(SCALER, 2), results, 6)
    for t in (1, 3, 5):
        check_synchronised(results, t)
    assert not np.array_equal(results[0]["local/4/out.weight"], results[1]["local/4/out.weight"])


def test_grad_scaler_unscale_then_step_and_skipped_steps():
    """One rank: scaler.unscale_ (for clipping) then scaler.step leaves the gradients unscaled once,
    and scaler.step alone unscales them: both give plain SGD's weights exactly (the scale is a power
    of two); an iteration with inf gradients takes no local step, yet counts (H = 3: the
    synchronisation comes at the third call of step())."""
    import horovod.torch as hvd

    from hvd_scalecom.torch import QsparseLocalSGD

    hvd.init()  # (one rank, in this process)
    plain_model, plain = small_setup()
    runs = [small_setup() for _ in range(2)]
    scaled = [(m, QsparseLocalSGD(opt, m.named_parameters(), local_steps=3, ratio=1.0), torch.amp.GradScaler(
        "cpu", init_scale=2.0 ** 12)) for m, opt in runs]
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    plain.zero_grad()
    plain_model(x).square().sum().backward()
    plain.step()
    for unscale_first, (m, opt, scaler) in zip((True, False), scaled):
        opt.zero_grad()
        scaler.scale(m(x).square().sum()).backward()
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        for a, b in zip(plain_model.parameters(), m.parameters()):
            assert torch.equal(a, b)
        assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
        before = [p.detach().clone() for p in m.parameters()]
        opt.zero_grad()
        scaler.scale(m(x).square().sum() * float("inf")).backward()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == 2.0 ** 11
        assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
        assert opt.state_dict()["qsparse_local_sgd"]["step"] == 2 and opt.stats()["index_bytes"] == 0
        opt.zero_grad()
        scaler.scale(m(x).square().sum()).backward()
        scaler.step(opt)
        assert opt.stats()["step"] == 2 and opt.stats()["index_bytes"] > 0
