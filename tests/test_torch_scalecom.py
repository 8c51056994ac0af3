"""ScaleCom on the stock hvd.DistributedOptimizer under real horovodrun, checked step by step against
the single-process reference of the paper's equations (tests/reference.py).

Every test reads a run of tests/workers/torch_scalecom.py; the runs share the jobs of tests/jobs.py
(``torch_np2``, ``torch_np3``, ...), one after another in the same processes.
"""

import json
import re

import numpy as np
import pytest
from jobs import add_run, define_job
from reference import assert_applied_steps, scalecom_reference

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def raw_grads(results, steps, names=NAMES, poison=None):
    """Every rank's gradients (the worker records them before its ``poison``, which is added here)."""
    first = min(int(k.split("/")[1]) for k in results[0] if k.startswith("raw/"))
    grads = [[{n: r[f"raw/{t}/{n}"] for n in names} for r in results] for t in range(first, first + steps)]
    if poison and first <= poison["step"] < first + steps:
        poisoned = grads[poison["step"] - first][poison["rank"]]
        flat = poisoned["hidden.weight"].copy().reshape(-1)
        flat[slice(None) if poison.get("index") == "all" else poison.get("index", 7)] = float(poison["value"])
        poisoned["hidden.weight"] = flat.reshape(poisoned["hidden.weight"].shape)
    return grads, first


def check_against_reference(results, opts, steps, names=NAMES, rtol=2e-5, atol=1e-6, value_dtype=np.float32,
                            skip=(), chosen_sets=None):
    if "advance_min_numel" in opts:  # the traded-buffer path ran on every rank (each leads only some steps)
        assert all(int(r["traded"]) > 0 for r in results), [int(r["traded"]) for r in results]
    grads, first = raw_grads(results, steps, names, opts.get("poison"))
    applied, memories = scalecom_reference(
        grads, names, len(results), opts.get("ratio", 0.05), opts.get("beta", 0.5),
        opts.get("warmup_steps", 0), opts.get("min_numel", 600), opts.get("leader", "cyclic"),
        value_dtype=value_dtype, pipelined=opts.get("pipelined", False), skip_memory=skip,
        chosen_sets=chosen_sets)
    assert len(applied) >= steps, (len(applied), steps)
    assert_applied_steps(results, applied[:steps], names, first, rtol, atol, skip)
    if first == 0:  # (the reference starts from zero memories)
        for rank, r in enumerate(results):
            for n in names:
                want = memories[rank][n].reshape(-1)
                # no memory recorded: a tensor never compressed (small, or warming up), whose is zero
                got = r[f"memory/{n}"] if f"memory/{n}" in r else np.zeros_like(want)
                np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"memory of {n}, rank {rank}")
    return applied


def check_identical_weights(results, names=NAMES):
    for n in names:
        for rank, r in enumerate(results[1:], 1):
            np.testing.assert_array_equal(r[f"final/{n}"], results[0][f"final/{n}"],
                                          err_msg=f"{n} differs between rank 0 and {rank}")


def sparsity(applied_step, name):
    return np.count_nonzero(applied_step[name]) / applied_step[name].size


def scalecom_run(job, part, opts, tests, **kwargs):
    """A run of tests/workers/torch_scalecom.py in ``job`` (tests/jobs.py)."""
    add_run(job, part, "torch_scalecom.py", opts, tests, **kwargs)


def job_of(np_, kind=""):
    return f"torch_np{np_}{kind}"


def slug(text):
    """A part's name from a parameter ("C, traded buffers": C_traded_buffers)."""
    return re.sub(r"\W+", "_", text)


MATCHES = [(2, 0.5, 2), (3, 1.0, 1), (3, 0.3, 0)]
for np_, beta, warmup in MATCHES:
    scalecom_run(job_of(np_), f"matches_np{np_}_beta{beta}_warmup{warmup}",
                 {"ratio": 0.05, "beta": beta, "warmup_steps": warmup, "min_numel": 600, "steps": 7},
                 ["test_matches_reference"])


@pytest.mark.parametrize("np_, beta, warmup", MATCHES)
def test_matches_reference(horovod_jobs, np_, beta, warmup):
    opts = {"ratio": 0.05, "beta": beta, "warmup_steps": warmup, "min_numel": 600, "steps": 7}
    results = horovod_jobs(job_of(np_)).completed(f"matches_np{np_}_beta{beta}_warmup{warmup}")
    assert len(results) == np_
    applied = check_against_reference(results, opts, steps=7)
    check_identical_weights(results)
    # Warm-up steps are dense, later ones carry k = ceil(0.05 * numel) entries; biases stay dense.
    for t in range(7):
        expected = 1.0 if t < warmup else 0.05
        assert sparsity(applied[t], "hidden.weight") == pytest.approx(expected, abs=0.002)
        assert sparsity(applied[t], "hidden.bias") == 1.0


def large_tensors_opts(kernels):
    return {"ratio": 0.02, "beta": 0.3, "min_numel": 600, "steps": 6, "hidden": 1400,
            "selection": "threshold", **({"advance_min_numel": 0} if kernels == "C, traded buffers" else {}),
            **({"transposed_hidden": True} if kernels == "C, non-contiguous gradient" else {})}


KERNELS = ["C", "C, traded buffers", "C, non-contiguous gradient", "torch"]
for kernels in KERNELS:  # (HVD_SCALECOM_NATIVE=0 for the torch operations: a job of its own)
    scalecom_run("torch_np3_native_off" if kernels == "torch" else "torch_np3", f"large_tensors_{slug(kernels)}",
                 large_tensors_opts(kernels), ["test_large_tensors_threshold_selection_both_kernel_paths"])


@pytest.mark.parametrize("kernels", KERNELS)
def test_large_tensors_threshold_selection_both_kernel_paths(horovod_jobs, kernels):
    """hidden.weight of 67,200 entries: the leader's threshold selection and memory update run as
    one C pass (or, with HVD_SCALECOM_NATIVE=0, as torch operations; or with the other ranks
    writing the memory over their gradients and trading the buffers; or, the weight stored
    column-major, on a gradient that is not contiguous); all match the reference."""
    opts = large_tensors_opts(kernels)
    job = horovod_jobs("torch_np3_native_off" if kernels == "torch" else "torch_np3")
    results = job.completed(f"large_tensors_{slug(kernels)}")
    assert all(bool(r["native"]) == (kernels != "torch") for r in results)  # the path named above ran
    applied = check_against_reference(results, opts, steps=6)
    check_identical_weights(results)
    assert sparsity(applied[5], "hidden.weight") == pytest.approx(0.02, abs=1e-4)
    if "transposed_hidden" in opts:  # hidden.weight's gradient, every step on every rank
        assert all(int(r["non_contiguous"]) == 6 for r in results), [int(r["non_contiguous"]) for r in results]


CHANNELS_LAST = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 2, "min_numel": 600, "steps": 5, "conv": True,
                 "channels_last": True}
scalecom_run("torch_np2", "channels_last", CHANNELS_LAST, ["test_channels_last_conv_weight_in_warm_up_and_after"])


def test_channels_last_conv_weight_in_warm_up_and_after(horovod_jobs):
    """A channels_last conv weight (2304 entries): its gradient reaches compress not contiguous, which
    Horovod refuses to reduce. Its warm-up steps, reduced densely, used to hand it to Horovod as it
    was ("Tensor is required to be contiguous." from the backward hook); they send a contiguous copy,
    and every step matches the reference."""
    names = NAMES + ["conv.weight"]
    opts = CHANNELS_LAST
    results = horovod_jobs("torch_np2").completed("channels_last")
    assert all(int(r["non_contiguous"]) == 5 for r in results), [int(r["non_contiguous"]) for r in results]
    applied = check_against_reference(results, opts, steps=5, names=names)
    check_identical_weights(results, names)
    assert sparsity(applied[1], "conv.weight") == 1.0
    assert sparsity(applied[4], "conv.weight") == pytest.approx(0.05, abs=0.001)


def direct_opts(kernels):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 5, "direct_allreduce": True,
            **({"advance_min_numel": 0} if kernels == "C, traded buffers" else {})}


for kernels in ["C", "C, traded buffers"]:
    scalecom_run("torch_np2", f"direct_{slug(kernels)}", direct_opts(kernels), ["test_hvd_allreduce_called_directly"])


@pytest.mark.parametrize("kernels", ["C", "C, traded buffers"])
def test_hvd_allreduce_called_directly(horovod_jobs, kernels):
    """Without DistributedOptimizer: p.grad.copy_(hvd.allreduce(p.grad, compression=compression)).
    The gradient handed over is the caller's, not set to the result as the optimizer sets it: where a
    rank that did not select wrote its new memory over that gradient (traded buffers), the copy into it
    overwrote the memory, silently; it now holds the result, and the memory its own."""
    opts = direct_opts(kernels)
    results = horovod_jobs("torch_np2").completed(f"direct_{slug(kernels)}")
    check_against_reference(results, opts, steps=5)
    check_identical_weights(results)


def moves_opts(exchange):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 4, "index_exchange": exchange,
            "late_rank": {"rank": 1, "seconds": 2}}


for exchange in ["allgather", "broadcast"]:  # each with a timeline of its own: a job each
    define_job(f"torch_np2_timeline_{exchange}", 2, timeline=True)
    scalecom_run(f"torch_np2_timeline_{exchange}", f"moves_{exchange}", moves_opts(exchange),
                 ["test_horovod_moves_k_values_and_k_indices"])


@pytest.mark.parametrize("exchange", ["allgather", "broadcast"])
def test_horovod_moves_k_values_and_k_indices(horovod_jobs, exchange):
    """What Horovod really moved, read from its timeline, not from stats() (and the first step's
    compress_seconds leave out the configuration check's wait for a rank that starts late)."""
    from devtools.timeline import read_operations

    job = horovod_jobs(f"torch_np2_timeline_{exchange}")
    timeline = job.timeline
    results = job.completed(f"moves_{exchange}")
    # Rank 0's wait for rank 1 in the first step's configuration check is not compression time.
    assert json.loads(str(results[0]["stats/first"]))["compress_seconds"] < 1.0
    ops = read_operations(timeline)
    sizes = {}
    for op in ops:
        sizes.setdefault((op["op"], op["name"].split(".", 1)[1]), []).append((op["numel"], op["dtype"]))
    # Step 0 is warm-up (dense), steps 1-3 send k = ceil(0.05 * numel) values and indices. Horovod
    # may not have flushed the timeline's last events when the job ends under load, so each record
    # is checked as a prefix of what was expected, missing at most the trailing event.
    expected = {
        ("allreduce", "hidden.weight"): [(3072, "float32")] + [(154, "float32")] * 3,
        ("allreduce", "out.weight"): [(640, "float32")] + [(32, "float32")] * 3,
        ("allreduce", "hidden.bias"): [(64, "float32")] * 4,
        # The leader's indices: an allgather to which only the leader gives its k (at every step,
        # whichever rank leads: rank 0, which writes the timeline, records the gathered output), or
        # a broadcast, whose shape rank 0 records when it receives (steps 1 and 3: leader 1).
        (exchange, "scalecom.hidden.weight"): [(154, "int32")] * (3 if exchange == "allgather" else 2),
        (exchange, "scalecom.out.weight"): [(32, "int32")] * (3 if exchange == "allgather" else 2),
    }
    for key, want in expected.items():
        got = sizes.get(key, [])
        assert got == want[:len(got)] and len(got) >= len(want) - 1, (key, got)
    stats = json.loads(str(results[0]["stats"]))
    assert stats["value_bytes"] == 4 * (154 + 32) and stats["index_bytes"] == 4 * (154 + 32)
    assert stats["uncompressed_bytes"] == 4 * (3072 + 64 + 640 + 10)


UNDER_MPI = [
    (2, {"warmup_steps": 1}),
    (3, {"index_exchange": "broadcast", "pipelined": True, "warmup_steps": 2, "advance_min_numel": 0}),
    (3, {"leader": "staggered", "value_dtype": "float16", "groups": 2})]
for i, (np_, extra) in enumerate(UNDER_MPI):
    scalecom_run(job_of(np_, "_mpi"), f"mpi_{i}", {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, **extra},
                 ["test_mpi_controller_matches_reference"])


@pytest.mark.parametrize("case", range(len(UNDER_MPI)))
def test_mpi_controller_matches_reference(horovod_jobs, case):
    """Under MPI (horovodrun --mpi, Open MPI carrying the collectives) as under Gloo: the index
    allgather to which only the leader contributes, broadcasts from every rank in turn, pipelined
    indices, grouped reductions."""
    np_, extra = UNDER_MPI[case]
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, **extra}
    results = horovod_jobs(job_of(np_, "_mpi")).completed(f"mpi_{case}")
    assert len(results) == np_ and not any(bool(r["gloo"]) for r in results)
    fp16 = extra.get("value_dtype") == "float16"
    applied = check_against_reference(results, opts, steps=6, **(
        {"rtol": 2e-3, "atol": 2e-4, "value_dtype": np.float16} if fp16 else {}))
    check_identical_weights(results)
    assert sparsity(applied[5], "hidden.weight") == pytest.approx(0.05, abs=0.002)


BROADCAST = [
    (3, {}),
    (2, {"pipelined": True, "warmup_steps": 2, "no_out_weight_grad_on_rank": 1, "advance_min_numel": 0}),
    (3, {"leader": "staggered", "selection": "threshold", "advance_min_numel": 0})]


def broadcast_opts(extra):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 7,
            "index_exchange": "broadcast", **extra}


for i, (np_, extra) in enumerate(BROADCAST):
    scalecom_run(job_of(np_), f"broadcast_{i}", broadcast_opts(extra), ["test_broadcast_exchange_matches_reference"])


@pytest.mark.parametrize("case", range(len(BROADCAST)))
def test_broadcast_exchange_matches_reference(horovod_jobs, case):
    """index_exchange="broadcast": each tensor's indices go out as a broadcast from its leader, every
    rank the root in turn (cyclic, pipelined, staggered), with the results of the allgather."""
    np_, extra = BROADCAST[case]
    opts = broadcast_opts(extra)
    results = horovod_jobs(job_of(np_)).completed(f"broadcast_{case}")
    applied = check_against_reference(results, opts, steps=7)
    check_identical_weights(results)
    assert sparsity(applied[6], "hidden.weight") == pytest.approx(0.05, abs=0.002)


STAGGERED_FP16 = {"ratio": 0.05, "beta": 0.3, "min_numel": 600, "steps": 6, "leader": "staggered",
                  "value_dtype": "float16", "index_dtype": "int32", "selection": "threshold",
                  "advance_min_numel": 0}  # and the ranks that do not select trade buffers
scalecom_run("torch_np3", "staggered_fp16", STAGGERED_FP16,
             ["test_staggered_leader_fp16_values_int32_indices_threshold_selection"])


def test_staggered_leader_fp16_values_int32_indices_threshold_selection(horovod_jobs):
    opts = STAGGERED_FP16
    results = horovod_jobs("torch_np3").completed("staggered_fp16")
    check_against_reference(results, opts, steps=6, rtol=2e-3, atol=2e-4, value_dtype=np.float16)
    check_identical_weights(results)
    stats = json.loads(str(results[0]["stats"]))
    k_hidden, k_out = 154, 32  # ceil(0.05 * 3072), ceil(0.05 * 640)
    assert stats["value_bytes"] == 2 * (k_hidden + k_out)
    assert stats["index_bytes"] == 4 * (k_hidden + k_out)
    assert stats["dense_bytes"] == 4 * (64 + 10)


def pipelined_opts(leader):
    # Rank 1 has no gradient for out.weight on odd steps (and so p = m there): the first compressed
    # step is even, else that leader's p would be all zeros and its top-k a matter of tie-breaking.
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 2, "min_numel": 600, "steps": 7,
            "pipelined": True, "leader": leader, "no_out_weight_grad_on_rank": 1, "advance_min_numel": 0}


for np_, leader in [(2, "cyclic"), (3, "staggered")]:
    scalecom_run(job_of(np_), f"pipelined_{leader}", pipelined_opts(leader), ["test_pipelined_indices_match_reference"])


@pytest.mark.parametrize("np_, leader", [(2, "cyclic"), (3, "staggered")])
def test_pipelined_indices_match_reference(horovod_jobs, np_, leader):
    opts = pipelined_opts(leader)
    results = horovod_jobs(job_of(np_)).completed(f"pipelined_{leader}")
    check_against_reference(results, opts, steps=7)
    check_identical_weights(results)


OPTIMIZER_FEATURES = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "groups": "list",
                      "backward_passes_per_step": 2, "momentum": 0.9, "gradient_predivide_factor": 2.0,
                      "advance_min_numel": 0}
scalecom_run("torch_np3", "optimizer_features", OPTIMIZER_FEATURES, ["test_optimizer_features"])


def test_optimizer_features(horovod_jobs):
    """groups, backward_passes_per_step, momentum and gradient_predivide_factor together, with the
    buffers of small gradients traded as those of large ones are."""
    opts = OPTIMIZER_FEATURES
    results = horovod_jobs("torch_np3").completed("optimizer_features")
    check_against_reference(results, opts, steps=5)
    check_identical_weights(results)


ONE_AT_A_TIME = [{"op": "sum"}, {"gradient_predivide_factor": 2.0}, {"groups": 2}, {"backward_passes_per_step": 2}]
for i, extra in enumerate(ONE_AT_A_TIME):
    scalecom_run("torch_np2", f"one_feature_{i}",
                 {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 4, **extra},
                 ["test_optimizer_features_one_at_a_time"])


@pytest.mark.parametrize("case", range(len(ONE_AT_A_TIME)))
def test_optimizer_features_one_at_a_time(horovod_jobs, case):
    """Each on its own: in test_optimizer_features every parameter is in a group, and Horovod's
    grouped allreduce takes no pre/postscale, so gradient_predivide_factor never applied there.
    op=hvd.Sum sums what Average averages (the memories are the same); groups=2 splits the
    parameters in two groups, each mixing a compressed weight with a dense tensor."""
    extra = ONE_AT_A_TIME[case]
    opts = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 4, **extra}
    results = horovod_jobs("torch_np2").completed(f"one_feature_{case}")
    if extra.get("op") == "sum":
        results = [{k: v / 2 if k.startswith("applied/") else v for k, v in r.items()} for r in results]
    check_against_reference(results, opts, steps=4)
    check_identical_weights(results)


def process_set_opts(exchange):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "process_set": [0, 2],
            "index_exchange": exchange}


for exchange in ["allgather", "broadcast"]:  # first in the job: their hvd.init registers the process set
    scalecom_run("torch_np3", f"process_set_{exchange}", process_set_opts(exchange), ["test_process_set"], first=True)


@pytest.mark.parametrize("exchange", ["allgather", "broadcast"])
def test_process_set(horovod_jobs, exchange):
    """Ranks 0 and 2 reduce over their own process set (leaders are relative ranks 0, 1; a broadcast's
    root is the leader's global rank)."""
    opts = process_set_opts(exchange)
    results = horovod_jobs("torch_np3").completed(f"process_set_{exchange}")
    members = [results[0], results[2]]
    check_against_reference(members, opts, steps=5)
    check_identical_weights(members)
    outside = results[1]  # trains on its own gradients only
    np.testing.assert_array_equal(outside["applied/3/hidden.weight"], outside["raw/3/hidden.weight"])


MISSING_GRADIENT = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "no_out_weight_grad_on_rank": 1,
                    "advance_min_numel": 0}
scalecom_run("torch_np3", "missing_gradient", MISSING_GRADIENT,
             ["test_rank_without_gradient_takes_horovods_missing_path"])


def test_rank_without_gradient_takes_horovods_missing_path(horovod_jobs):
    """Rank 1 produces no gradient for out.weight on odd steps; Horovod reduces zeros for it in
    synchronize(), after every hook: a different order on that rank, which must not deadlock."""
    opts = MISSING_GRADIENT
    results = horovod_jobs("torch_np3").completed("missing_gradient")
    check_against_reference(results, opts, steps=6)
    check_identical_weights(results)


SPARSE_AS_DENSE = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "embedding": True,
                   "sparse_as_dense": True, "advance_min_numel": 0}
scalecom_run("torch_np2", "sparse_as_dense", SPARSE_AS_DENSE, ["test_sparse_as_dense_embedding"])


def test_sparse_as_dense_embedding(horovod_jobs):
    names = NAMES + ["embed.weight"]
    opts = SPARSE_AS_DENSE
    results = horovod_jobs("torch_np2").completed("sparse_as_dense")
    check_against_reference(results, opts, steps=5, names=names)
    check_identical_weights(results, names)


def two_embeddings_opts(frozen_layer):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "embedding": 2, "leader": "staggered",
            "sparse_as_dense": True, "frozen_layer": frozen_layer}


for frozen_layer in [False, True]:
    scalecom_run("torch_np2", f"two_embeddings_{frozen_layer}", two_embeddings_opts(frozen_layer),
                 ["test_two_embeddings_with_equal_densified_gradients_are_told_apart_under_the_optimizer"])


@pytest.mark.parametrize("frozen_layer", [False, True])
def test_two_embeddings_with_equal_densified_gradients_are_told_apart_under_the_optimizer(horovod_jobs, frozen_layer):
    """sparse_as_dense=True, two embeddings summed on the same tokens (equal gradients at every step):
    each is compressed in its own hook, before the other's gradient of the pass exists, so each gets
    its own memory. Staggered leaders give the two different selections, so a swap would show. With
    a layer frozen from the start among ScaleCom's parameters (never reduced: its step counter stays
    0), the second embedding of a step was no longer told from the first, from step 1 on (a
    ValueError naming both)."""
    names = NAMES + ["embed.weight", "embed2.weight"]
    opts = two_embeddings_opts(frozen_layer)
    results = horovod_jobs("torch_np2").completed(f"two_embeddings_{frozen_layer}")
    for t in range(5):
        np.testing.assert_array_equal(results[0][f"raw/{t}/embed.weight"], results[0][f"raw/{t}/embed2.weight"])
    applied = check_against_reference(results, opts, steps=5, names=names)
    assert any(not np.array_equal(applied[t]["embed.weight"], applied[t]["embed2.weight"]) for t in range(5))
    check_identical_weights(results, names)


SPARSE_EMBEDDING = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "embedding": True}
scalecom_run("torch_np3", "sparse_embedding", SPARSE_EMBEDDING,
             ["test_a_sparse_embedding_gradient_bypasses_scalecom_without_a_hang"])


def test_a_sparse_embedding_gradient_bypasses_scalecom_without_a_hang(horovod_jobs):
    """With Horovod's default sparse_as_dense=False a sparse gradient is allgathered without
    compress: the receives every rank posted ahead for it are dropped (its leader completes them
    with a broadcast of its own), the other parameters match the reference, and the embedding
    gets the plain average of the ranks' gradients."""
    opts = SPARSE_EMBEDDING
    results = horovod_jobs("torch_np3").completed("sparse_embedding")
    check_against_reference(results, opts, steps=5)
    for t in range(5):
        mean = np.mean([r[f"raw/{t}/embed.weight"] for r in results], axis=0)
        assert np.count_nonzero(mean) > 0.5 * mean.size  # (48 of 50 rows or so: not a sparse update)
        for rank, r in enumerate(results):
            np.testing.assert_allclose(r[f"applied/{t}/embed.weight"], mean, rtol=1e-5, atol=1e-7,
                                       err_msg=f"step {t}, rank {rank}")
    check_identical_weights(results, NAMES + ["embed.weight"])


def rollback_opts(pipelined):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 4, "embedding": True, "pipelined": pipelined,
            "timeout": 10, "commit_every_step": True, "rollback": {"after": 0, "to": 0}, "record_indices": True}


for pipelined in [False, True]:
    scalecom_run("torch_np2", f"rollback_{pipelined}", rollback_opts(pipelined),
                 ["test_commits_and_a_rollback_beside_a_sparse_embedding"])


@pytest.mark.parametrize("pipelined", [False, True])
def test_commits_and_a_rollback_beside_a_sparse_embedding(horovod_jobs, pipelined):
    """Elastic's commit after every step (state_dict() on every rank, then a collective), and after
    step 0 a rollback to the state taken before it, while rank 1 still holds the receive it posted at
    step 0 for the sparse embedding (which Horovod reduced without compress; its leader completes it
    at its next step): state_dict() does not wait for that receive, load_state_dict() keeps it open
    for that step to complete, and the run matches the reference, step 0 twice alike."""
    opts = rollback_opts(pipelined)
    results = horovod_jobs("torch_np2").completed(f"rollback_{pipelined}")
    check_against_reference(results, opts, steps=4)  # the memories after the last step included
    names = NAMES + ["embed.weight"]
    check_identical_weights(results, names)
    for rank, r in enumerate(results):
        assert int(r["rolled_back"]) == 0
        for n in names:
            np.testing.assert_array_equal(r[f"first_attempt/0/{n}"], r[f"applied/0/{n}"], err_msg=f"{n}, rank {rank}")
        mean = np.mean([other["raw/1/embed.weight"] for other in results], axis=0)
        np.testing.assert_allclose(r["applied/1/embed.weight"], mean, rtol=1e-5, atol=1e-7)
        committed = sorted(k for k in r if k.startswith("next_indices/"))
        if not pipelined:
            assert committed == []
            continue
        # each commit holds the indices the next step then used; none for the embedding
        assert committed == [f"next_indices/{t}/{n}" for t in range(4) for n in ("hidden.weight", "out.weight")]
        for t in range(3):
            for n in ("hidden.weight", "out.weight"):
                np.testing.assert_array_equal(r[f"next_indices/{t}/{n}"], [t + 1, *r[f"chosen/{t + 1}/{n}"]])


def checkpoint_base(pipelined):
    return {"ratio": 0.05, "beta": 0.3, "warmup_steps": 1, "min_numel": 600, "pipelined": pipelined,
            "advance_min_numel": 0}


for pipelined in [False, True]:  # resumed in new processes: torch_np3_stall runs after torch_np3
    base, first = checkpoint_base(pipelined), f"checkpoint_{pipelined}_first"
    tests = ["test_checkpoint_round_trip_continues_identically"]
    scalecom_run("torch_np3", f"checkpoint_{pipelined}_straight", {**base, "steps": 10}, tests)
    scalecom_run("torch_np3", first, {**base, "steps": 5, "checkpoint": True}, tests)
    scalecom_run("torch_np3_stall", f"checkpoint_{pipelined}_second", lambda root, base=base, first=first: {
        **base, "steps": 5, "first_step": 5, "resume_from": str(root / first)}, tests)
    scalecom_run("torch_np3_stall", f"checkpoint_{pipelined}_third", lambda root, base=base, first=first: {
        **base, "steps": 5, "first_step": 5, "resume_from": str(root / first), "forget_compression_state": True},
        tests)


@pytest.mark.parametrize("pipelined", [False, True])
def test_checkpoint_round_trip_continues_identically(horovod_jobs, pipelined):
    """10 steps straight equal 5 steps, a checkpoint, new processes, and 5 more steps."""
    job, resuming = horovod_jobs("torch_np3"), horovod_jobs("torch_np3_stall")
    straight = job.completed(f"checkpoint_{pipelined}_straight")
    job.completed(f"checkpoint_{pipelined}_first")
    resumed = resuming.completed(f"checkpoint_{pipelined}_second")
    # Dense reductions are fused differently from run to run, so sums may differ in the last bit.
    for rank in range(3):
        for n in NAMES:
            np.testing.assert_allclose(resumed[rank][f"final/{n}"], straight[rank][f"final/{n}"],
                                       rtol=1e-5, atol=1e-7, err_msg=f"{n}, rank {rank}")
    # Control: resuming without the residue memories is measurably different.
    forgetful = resuming.completed(f"checkpoint_{pipelined}_third")
    diff = np.abs(forgetful[0]["final/hidden.weight"] - straight[0]["final/hidden.weight"]).max()
    assert diff > 1e-4


NONFINITE = [("nan", "C"), ("inf", "C"), ("nan", "C, traded buffers"), ("inf", "torch")]


def nonfinite_opts(value, kernels):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 7, "skip_nonfinite": True,
            "poison": {"rank": 1, "step": 3, "value": value},
            **({"advance_min_numel": 0} if kernels == "C, traded buffers" else {})}


for value, kernels in NONFINITE:
    scalecom_run("torch_np3_native_off" if kernels == "torch" else "torch_np3", f"nonfinite_{value}_{slug(kernels)}",
                 nonfinite_opts(value, kernels),
                 ["test_nonfinite_gradient_skips_the_step_on_every_rank_and_spares_the_memory"])


@pytest.mark.parametrize("value, kernels", NONFINITE)
def test_nonfinite_gradient_skips_the_step_on_every_rank_and_spares_the_memory(horovod_jobs, value, kernels):
    """Rank 1's hidden.weight gradient has one non-finite entry at step 3: every rank's update of
    that tensor is non-finite (so a loss scaler skips the step everywhere), no memory is poisoned,
    and training continues exactly as the reference with that memory update skipped."""
    opts = nonfinite_opts(value, kernels)
    job = horovod_jobs("torch_np3_native_off" if kernels == "torch" else "torch_np3")
    results = job.completed(f"nonfinite_{value}_{slug(kernels)}")
    assert all(bool(r["native"]) == (kernels != "torch") for r in results)  # the path named above ran
    for r in results:
        assert not np.isfinite(r["applied/3/hidden.weight"]).all()
        for n in ("hidden.weight", "out.weight"):  # the compressed tensors
            assert np.isfinite(r[f"memory/{n}"]).all()
        assert json.loads(str(r["stats"]))["nonfinite_skips"] == 1
    check_against_reference(results, opts, steps=7, skip={(3, "hidden.weight")})
    check_identical_weights(results)


NONFINITE_LEADER = [
    (True, "exact", {"rank": 0, "step": 3, "value": "nan"}),
    (True, "threshold", {"rank": 0, "step": 3, "value": "inf", "index": "all"}),
    (False, "exact", {"rank": 1, "step": 3, "value": "nan"}),
]


def nonfinite_leader_opts(pipelined, selection, poison):
    return {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 6, "skip_nonfinite": True,
            "pipelined": pipelined, "selection": selection, "poison": poison}


for i, case in enumerate(NONFINITE_LEADER):
    scalecom_run("torch_np2", f"nonfinite_leader_{i}", nonfinite_leader_opts(*case),
                 ["test_a_leader_whose_gradient_is_not_finite_selects_from_its_memory"])


@pytest.mark.parametrize("case", range(len(NONFINITE_LEADER)))
def test_a_leader_whose_gradient_is_not_finite_selects_from_its_memory(horovod_jobs, case):
    """Pipelined, rank 0 selects step 4's indices in step 3, where its hidden.weight gradient holds a
    NaN (or is all Inf, as after an fp16 overflow); not pipelined, rank 1 leads step 3 with a NaN.
    Such a leader selects top_k(|m|), the memory that the step leaves on every rank: the exact
    selection took the NaN's position into step 4's indices (torch.topk ranks NaN first), and after
    an all-Inf gradient both selections took k arbitrary entries. Every step matches the reference,
    the non-finite one too (NaN at exactly its k indices), and no memory absorbs the step."""
    opts = nonfinite_leader_opts(*NONFINITE_LEADER[case])
    results = horovod_jobs("torch_np2").completed(f"nonfinite_leader_{case}")
    for r in results:
        assert np.isnan(r["applied/3/hidden.weight"]).sum() == 154  # k: the mean is NaN at I, zero elsewhere
        assert np.isfinite(r["memory/hidden.weight"]).all()
        assert json.loads(str(r["stats"]))["nonfinite_skips"] == 1
    check_against_reference(results, opts, steps=6)
    check_identical_weights(results)


FP16 = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 5, "dtype": "float16"}
scalecom_run("torch_np2", "fp16", FP16, ["test_fp16_gradients_keep_an_fp32_memory"])


def test_fp16_gradients_keep_an_fp32_memory(horovod_jobs):
    opts = FP16
    results = horovod_jobs("torch_np2").completed("fp16")
    assert results[0]["memory/hidden.weight"].dtype == np.float32
    check_against_reference(results, opts, steps=5, rtol=5e-3, atol=5e-4, value_dtype=np.float16)
    check_identical_weights(results)


GRAD_SCALER = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 7,
               "grad_scaler": {"init_scale": 1024.0, "growth_interval": 2},
               "poison": {"rank": 1, "step": 3, "value": "inf"}}
scalecom_run("torch_np2", "grad_scaler", GRAD_SCALER,
             ["test_a_real_grad_scaler_rescales_the_memory_and_skips_a_non_finite_step"])


def test_a_real_grad_scaler_rescales_the_memory_and_skips_a_non_finite_step(horovod_jobs):
    """torch.amp.GradScaler as loss_scaler: its scale doubles every 2 finite steps and halves at the
    step where rank 1's gradient holds an Inf (every rank skips it: the reduction is NaN); the
    unscaled updates and memories equal the reference's, that step's memory update skipped."""
    opts = GRAD_SCALER
    results = horovod_jobs("torch_np2").completed("grad_scaler")
    for r in results:
        assert [float(r[f"scale/{t}"]) for t in range(7)] == [1024, 1024, 2048, 2048, 1024, 1024, 2048]
        assert not np.isfinite(r["applied/3/hidden.weight"]).all()
        assert json.loads(str(r["stats"]))["nonfinite_skips"] == 1
    check_against_reference(results, opts, steps=7, rtol=1e-4, skip={(3, "hidden.weight")})
    check_identical_weights(results)


BF16 = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "warmup_steps": 1, "steps": 5, "dtype": "bfloat16",
        "record_indices": True}
scalecom_run("torch_np2", "bf16", BF16, ["test_bf16_gradients_travel_as_fp32_and_keep_an_fp32_memory"])


def test_bf16_gradients_travel_as_fp32_and_keep_an_fp32_memory(horovod_jobs):
    """Horovod's collectives take no bfloat16: the selected values (by default) and the dense
    gradients (warm-up, small tensors) travel as float32, and the optimizer gets bfloat16 back."""
    opts = BF16
    results = horovod_jobs("torch_np2").completed("bf16")
    assert results[0]["memory/hidden.weight"].dtype == np.float32
    assert str(results[0]["applied_dtype"]) == "torch.bfloat16"
    # Gradients of 8 mantissa bits often tie at the k-th magnitude: the reference checks that each
    # leader's choice is a top-k and follows it. (The applied gradients are the float32 reduction
    # rounded to bfloat16.)
    chosen = {(int(key.split("/")[1]), key.split("/")[2]): results[0][key] for key in results[0]
              if key.startswith("chosen/")}
    assert sorted(chosen) == [(t, n) for t in range(1, 5) for n in ("hidden.weight", "out.weight")]
    for key in results[0]:
        if key.startswith("chosen/"):
            np.testing.assert_array_equal(results[1][key], results[0][key])  # one I on every rank
    check_against_reference(results, opts, steps=5, rtol=8e-3, atol=1e-6, chosen_sets=chosen)
    check_identical_weights(results)
    stats = json.loads(str(results[0]["stats"]))
    assert stats["value_bytes"] == 4 * (154 + 32)  # k fp32 values of hidden.weight and out.weight
    assert stats["dense_bytes"] == 4 * (64 + 10)  # the biases, as fp32
    assert stats["uncompressed_bytes"] == 4 * (3072 + 64 + 640 + 10)  # dense reduction as Horovod can (fp32)


LOSS_SCALE = {"ratio": 0.05, "beta": 0.5, "min_numel": 600, "steps": 7,
              "loss_scale_schedule": {"0": 1024, "3": 64, "5": 4096}}
scalecom_run("torch_np2", "loss_scale", LOSS_SCALE, ["test_loss_scale_changes_rescale_the_memory"])


def test_loss_scale_changes_rescale_the_memory(horovod_jobs):
    """Gradients arrive multiplied by a loss scale that changes (powers of two, so exactly): with
    loss_scaler the unscaled updates equal the reference on unscaled gradients."""
    opts = LOSS_SCALE
    results = horovod_jobs("torch_np2").completed("loss_scale")
    check_against_reference(results, {**opts}, steps=7, rtol=1e-4)
    check_identical_weights(results)
