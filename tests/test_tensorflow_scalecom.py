"""ScaleCom on hvd.DistributedGradientTape (TF2) under real horovodrun, checked step by step against
the single-process reference of the paper's equations (tests/reference.py), like the PyTorch tests."""

import json
import math
import os
import re
from collections import defaultdict

import numpy as np
import pytest
from jobs import add_run
from reference import scalecom_reference

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]


def shapes(hidden=64):
    return {"hidden.weight": (48, hidden), "hidden.bias": (hidden,), "out.weight": (hidden, 10),
            "out.bias": (10,)}


def check_against_reference(results, opts, steps, rtol=2e-5, atol=1e-6, value_dtype=np.float32,
                            label="", skip=(), times=1, health_log=None):
    """Every rank's applied gradients against the reference's (the mean over ranks; ``times`` that:
    the number of ranks where the tape sums); ``opts["health"]``: the health check's options, whose
    checks the reference appends to ``health_log``."""
    first = opts.get("first_step", 0)
    grads = [[{n: r[f"{label}raw/{t}/{n}"] for n in NAMES} for r in results]
             for t in range(first, first + steps)]
    applied, memories = scalecom_reference(
        grads, NAMES, len(results), opts.get("ratio", 0.05), opts.get("beta", 0.5),
        opts.get("warmup_steps", 0), opts.get("min_numel", 600), opts.get("leader", "cyclic"),
        value_dtype=value_dtype, pipelined=opts.get("pipelined", False), skip_memory=skip,
        health_log=health_log, **opts.get("health", {}))
    for t in range(steps):
        for n in NAMES:
            for rank, r in enumerate(results):
                got = r[f"{label}applied/{first + t}/{n}"]
                np.testing.assert_allclose(got, times * applied[t][n], rtol=rtol, atol=atol,
                                           err_msg=f"step {first + t}, {n}, rank {rank}")
                # and exactly the reference's entries (k of them on compressed steps), nothing else
                np.testing.assert_array_equal(np.reshape(got, -1) != 0, applied[t][n].reshape(-1) != 0,
                                              err_msg=f"step {first + t}, {n}, rank {rank}: non-zeros")
    return applied, memories


def check_identical_weights(results, label=""):
    for n in NAMES:
        for rank, r in enumerate(results[1:], 1):
            np.testing.assert_array_equal(r[f"{label}final/{n}"], results[0][f"{label}final/{n}"],
                                          err_msg=f"{n} differs between rank 0 and {rank}")


def density(applied_step, name):
    return np.count_nonzero(applied_step[name]) / applied_step[name].size


def tensorboard_scalars(log_dir):
    """{step: {tag: value}} from the TensorBoard event files in ``log_dir``."""
    import tensorflow as tf
    scalars = defaultdict(dict)
    paths = sorted(os.path.join(log_dir, f) for f in os.listdir(log_dir) if ".tfevents." in f)
    assert paths, f"no event file in {log_dir}"
    for path in paths:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                scalars[event.step][value.tag] = float(tf.make_ndarray(value.tensor))
    return dict(scalars)


def check_logged_stats(results, out_dir, steps):
    """The events each rank wrote at ``steps`` hold stats_scalars() of its stats() there."""
    from hvd_scalecom.monitor import stats_scalars
    for rank, r in enumerate(results):
        logged = tensorboard_scalars(os.path.join(out_dir, f"tb{rank}"))
        assert sorted(logged) == list(steps), f"rank {rank}"
        for step in steps:
            expected = stats_scalars(json.loads(str(r[f"tb_stats/{step}"])))
            assert set(logged[step]) == set(expected), f"rank {rank}, step {step}"
            for tag, value in expected.items():  # events store float32
                assert logged[step][tag] == pytest.approx(value, rel=1e-6, abs=1e-9), \
                    f"rank {rank}, step {step}, {tag}"
        assert logged[steps[-1]]["scalecom/sent_bytes"] > 0


def timeline_collectives(path):
    """{tensor name: (number of collectives, {(dtype, shape), ...})} from a Horovod timeline.

    A collective starts with a NEGOTIATE_* event; its shape is in the closing event's args (for a
    broadcast, only where rank 0, which writes the timeline, is not the root).
    """
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    counts, shapes_seen = defaultdict(int), defaultdict(set)
    for e in events:
        name = names.get(e.get("pid"))
        if name is None:
            continue
        if e.get("ph") == "B" and e.get("name", "").startswith("NEGOTIATE_"):
            counts[name] += 1
        if e.get("ph") == "E" and "shape" in e.get("args", {}):
            shapes_seen[name].add((e["args"]["dtype"], e["args"]["shape"]))
    return {name: (counts[name], shapes_seen[name]) for name in names.values()}


# The runs of the TensorFlow workers share the jobs tf_np2, tf_np3, tf_np2_mpi and tf_np3_mpi of
# tests/jobs.py, one after another in the same processes. One 10-step tf.function run on 2 ranks serves
# the reference/timeline test and, through the checkpoint it writes after step 5, the checkpoint test:
# it is the only run of tf_np2_timeline; tf_np2 runs after it (the resumed run, in new processes).
STRAIGHT = {"ratio": 0.05, "beta": 0.3, "warmup_steps": 2, "min_numel": 600, "mode": "function",
            "steps": 10}
add_run("tf_np2_timeline", "tf_straight", "tf_scalecom.py",
        {**STRAIGHT, "checkpoint_at": 5, "state_round_trip": True, "tensorboard": True},
        ["test_function_matches_reference_and_moves_k_values", "test_log_stats_writes_what_stats_returns",
         "test_checkpoint_round_trip_continues_identically"], timeout=600)
add_run("tf_np2", "tf_resumed", "tf_scalecom.py",
        lambda root: {**STRAIGHT, "steps": 5, "first_step": 5, "resume_from": str(root / "tf_straight")},
        ["test_checkpoint_round_trip_continues_identically"])


@pytest.fixture
def straight_run(horovod_jobs):
    """The straight run's per-rank results, its folder and the job's timeline."""
    job = horovod_jobs("tf_np2_timeline")
    return job.completed("tf_straight"), job.root / "tf_straight", job.timeline


def tf_run(job, part, opts, tests, worker="tf_scalecom.py", timeout=600, **kwargs):
    """A run of a TensorFlow worker (tracing on a loaded machine can take minutes: a limit of 10)."""
    add_run(job, part, worker, opts, tests, timeout=timeout, **kwargs)


def test_function_matches_reference_and_moves_k_values(straight_run):
    """tf.function step, 2 ranks, 2 warm-up steps, beta < 1; the timeline shows what Horovod moved."""
    results, out_dir, timeline = straight_run
    steps, warmup = STRAIGHT["steps"], STRAIGHT["warmup_steps"]
    applied, memories = check_against_reference(results, STRAIGHT, steps=steps)
    check_identical_weights(results)
    for t in range(steps):
        expected = 1.0 if t < warmup else 0.05
        assert density(applied[t], "hidden.weight") == pytest.approx(expected, abs=0.002)
        assert density(applied[t], "hidden.bias") == 1.0
    for rank, r in enumerate(results):  # state_dict() memory is the reference's m_i
        assert bool(r["state_round_trip"])
        np.testing.assert_allclose(r["memory/hidden.weight"], memories[rank]["hidden.weight"],
                                   rtol=1e-4, atol=1e-6)
        assert list(r["steps"]) == [steps] * 4

    # Horovod's timeline: after warm-up only k-sized values and indices travel for the big tensors.
    k_hidden, k_out = 154, 32  # ceil(0.05 * 3072), ceil(0.05 * 640)
    count, seen = defaultdict(int), defaultdict(set)
    for name, (n, shapes_moved) in timeline_collectives(timeline).items():
        leaf = name.rsplit("/", 1)[-1]
        kind = ("indices" if "_indices_" in leaf else "warmup dense" if "_dense_" in leaf
                else "values" if "EnsureShape" in leaf else "initial weights"
                if leaf.startswith("HorovodBroadcast_") else "eager (end of job)"
                if leaf == "HorovodAllreduce" else "agreement"
                if leaf == "HorovodAllgather" else "small dense")  # eager ops carry no name
        count[kind] += n
        seen[kind] |= shapes_moved
    assert seen["indices"] == {("int32", f"[{k_hidden}]"), ("int32", f"[{k_out}]")}
    assert seen["values"] == {("float32", f"[{k_hidden}]"), ("float32", f"[{k_out}]")}
    assert seen["warmup dense"] == {("float32", "[48, 64]"), ("float32", "[64, 10]")}
    assert seen["small dense"] == {("float32", "[64]"), ("float32", "[10]")}
    # Per step: 2 value allreduces, 2 index broadcasts after warm-up, 2 dense ones during it.
    assert count["values"] == 2 * steps and count["small dense"] == 2 * steps
    assert count["indices"] == 2 * (steps - warmup) and count["warmup dense"] == 2 * warmup
    # The configuration check: two allgathers (summary sizes, summaries), once in the job.
    assert count["agreement"] == 2
    assert {dtype for dtype, _ in seen["agreement"]} == {"int32", "uint8"}

    stats = json.loads(str(results[0]["stats"]))
    assert stats["step"] == steps - 1
    assert stats["index_bytes"] == 4 * (k_hidden + k_out)
    assert stats["value_bytes"] == 4 * (k_hidden + k_out)
    assert stats["dense_bytes"] == 4 * (64 + 10)
    assert stats["uncompressed_bytes"] == 4 * (3072 + 64 + 640 + 10)
    assert stats["compress_seconds"] >= 0 and stats["index_wait_seconds"] >= 0
    assert stats["total"]["tensors"] == 4 * steps


def test_log_stats_writes_what_stats_returns(straight_run):
    """log_stats after every step of the tf.function job: TensorBoard holds stats() per step."""
    results, out_dir, _ = straight_run
    check_logged_stats(results, out_dir, range(STRAIGHT["steps"]))
    warm, compressed = tensorboard_scalars(os.path.join(out_dir, "tb0"))[1], \
        tensorboard_scalars(os.path.join(out_dir, "tb0"))[STRAIGHT["steps"] - 1]
    assert warm["scalecom/index_bytes"] == 0 and compressed["scalecom/index_bytes"] == 4 * (154 + 32)


EAGER_ALLREDUCE = {"ratio": 0.05, "beta": 1.0, "warmup_steps": 1, "min_numel": 600, "steps": 6,
                   "mode": "eager", "index_exchange": "allreduce"}
tf_run("tf_np3", "tf_eager_allreduce", EAGER_ALLREDUCE, ["test_eager_matches_reference_allreduce_exchange"])


def test_eager_matches_reference_allreduce_exchange(horovod_jobs):
    """Eager step (Horovod traces its own reduction function), 3 ranks, beta = 1, indices summed."""
    opts = EAGER_ALLREDUCE
    results = horovod_jobs("tf_np3").completed("tf_eager_allreduce")
    applied, _ = check_against_reference(results, opts, steps=6)
    check_identical_weights(results)
    assert density(applied[0], "hidden.weight") == 1.0
    assert density(applied[5], "hidden.weight") == pytest.approx(0.05, abs=0.002)
    stats = json.loads(str(results[0]["stats"]))  # k indices and the count of leaders per tensor
    assert stats["index_bytes"] == 4 * (154 + 1 + 32 + 1) and stats["value_bytes"] == 4 * (154 + 32)


THREE_ROOTS = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 7, "mode": "function"}
tf_run("tf_np3", "tf_three_roots", THREE_ROOTS,
       ["test_function_on_three_ranks_broadcasts_from_every_root_and_matches_reference"])


def test_function_on_three_ranks_broadcasts_from_every_root_and_matches_reference(horovod_jobs):
    """tf.function with the default broadcast exchange on 3 ranks: the leaders of steps 1-6 are
    ranks 1, 2, 0, 1, 2, 0, so every branch of the switch_case over roots runs."""
    opts = THREE_ROOTS
    results = horovod_jobs("tf_np3").completed("tf_three_roots")
    applied, _ = check_against_reference(results, opts, steps=7)
    check_identical_weights(results)
    assert [density(applied[t], "hidden.weight") == 1.0 for t in range(7)] == [True] + [False] * 6


def allgather_opts(mode, pipelined):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 5, "mode": mode,
            "index_exchange": "allgather", "pipelined": pipelined}


for mode, ranks, pipelined in [("function", 3, False), ("eager", 2, True)]:
    tf_run(f"tf_np{ranks}", f"tf_allgather_{mode}", allgather_opts(mode, pipelined),
           ["test_allgather_exchange_matches_reference"])


@pytest.mark.parametrize("mode, ranks, pipelined", [("function", 3, False), ("eager", 2, True)])
def test_allgather_exchange_matches_reference(horovod_jobs, mode, ranks, pipelined):
    """index_exchange="allgather": the leader gives its k indices, the others none. On 3 ranks every
    rank leads in turn (tf.function); pipelined (eager, 2 ranks) shares the next step's indices too."""
    opts = allgather_opts(mode, pipelined)
    results = horovod_jobs(f"tf_np{ranks}").completed(f"tf_allgather_{mode}")
    applied, _ = check_against_reference(results, opts, steps=5)
    check_identical_weights(results)
    assert [density(applied[t], "hidden.weight") == 1.0 for t in range(5)] == [True] + [False] * 4
    stats = json.loads(str(results[0]["stats"]))
    assert stats["index_bytes"] == 4 * (154 + 32) and stats["value_bytes"] == 4 * (154 + 32)


def mpi_opts(mode, exchange):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 5, "mode": mode,
            "index_exchange": exchange}


for mode, ranks, exchange in [("function", 3, "broadcast"), ("eager", 2, "allgather")]:
    tf_run(f"tf_np{ranks}_mpi", f"tf_mpi_{mode}", mpi_opts(mode, exchange), ["test_mpi_controller_matches_reference"])


@pytest.mark.parametrize("mode, ranks, exchange", [("function", 3, "broadcast"), ("eager", 2, "allgather")])
def test_mpi_controller_matches_reference(horovod_jobs, mode, ranks, exchange):
    """Under MPI (horovodrun --mpi, Open MPI carrying the collectives) as under Gloo: broadcasts from
    every root in turn in a tf.function, the leader-only allgather in eager steps."""
    opts = mpi_opts(mode, exchange)
    results = horovod_jobs(f"tf_np{ranks}_mpi").completed(f"tf_mpi_{mode}")
    assert len(results) == ranks and not any(bool(r["gloo"]) for r in results)
    applied, _ = check_against_reference(results, opts, steps=5)
    check_identical_weights(results)
    assert [density(applied[t], "hidden.weight") == 1.0 for t in range(5)] == [True] + [False] * 4


V1_OPTIMIZER = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 5,
                "mode": "v1_optimizer", "lr": 1.0}
tf_run("tf_np2", "tf_v1_optimizer", V1_OPTIMIZER,
       ["test_horovods_optimizer_wrapper_around_a_compat_v1_optimizer_matches_reference"])


def test_horovods_optimizer_wrapper_around_a_compat_v1_optimizer_matches_reference(horovod_jobs):
    """hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer, compression=ScaleCom)
    (around a Keras 3 optimizer it reduces nothing: the README says so)."""
    opts = V1_OPTIMIZER
    results = horovod_jobs("tf_np2").completed("tf_v1_optimizer")
    check_against_reference(results, opts, steps=5, rtol=1e-4, atol=1e-6)
    check_identical_weights(results)
    assert json.loads(str(results[0]["stats"]))["total"]["tensors"] == 4 * 5


PIPELINED = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 6,
             "mode": "function", "leader": "staggered", "pipelined": True, "state_round_trip": True}
tf_run("tf_np2", "tf_pipelined", PIPELINED, ["test_pipelined_matches_reference"])


def test_pipelined_matches_reference(horovod_jobs):
    """pipelined=True, 2 ranks, staggered leader, 1 warm-up step: step t uses the indices its
    leader chose at step t - 1 (fresh at the first compressed step); state_dict() holds those chosen
    for the step after the last one, and a new ScaleCom loading it gives them back."""
    opts = PIPELINED
    results = horovod_jobs("tf_np2").completed("tf_pipelined")
    applied, _ = check_against_reference(results, opts, steps=6)
    check_identical_weights(results)
    # Control: these updates are not those of exact (not pipelined) ScaleCom.
    with pytest.raises(AssertionError):
        check_against_reference(results, {**opts, "pipelined": False}, steps=6)
    # The indices waiting for step 6 (leader 6 mod 2 = 0 for variable #0): the top-k of rank 0's
    # p = m + g at step 5, m being its memory after step 4.
    grads = [[{n: r[f"raw/{t}/{n}"] for n in NAMES} for r in results] for t in range(6)]
    _, memories = scalecom_reference(grads[:5], NAMES, 2, 0.05, 0.5, 1, 600, "staggered",
                                     pipelined=True)
    p = memories[0]["hidden.weight"] + grads[5][0]["hidden.weight"].reshape(-1)
    expected = np.sort(np.argsort(-np.abs(p), kind="stable")[:154])
    for r in results:
        assert bool(r["state_round_trip"]) and int(r["next_step/hidden.weight"]) == 6
        np.testing.assert_array_equal(np.sort(r["next_indices/hidden.weight"]), expected)
    # Index bytes: each compressed step shares the next one's indices, the first (step 1) its own too.
    stats = json.loads(str(results[0]["stats"]))
    assert stats["step"] == 5 and stats["index_bytes"] == 4 * (154 + 32)
    assert stats["total"]["index_bytes"] == 4 * (154 + 32) * (5 + 1)


SUMMING = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 2, "min_numel": 600, "steps": 4,
           "mode": "function", "op": "sum"}
tf_run("tf_np2", "tf_summing", SUMMING, ["test_a_summing_tape_sums_in_warm_up_and_compressed_steps"])


def test_a_summing_tape_sums_in_warm_up_and_compressed_steps(horovod_jobs):
    """op=hvd.Sum given to the tape and to ScaleCom: warm-up steps (reduced densely by ScaleCom
    itself) and compressed ones both apply the sum over ranks, twice the reference's mean."""
    opts = SUMMING
    results = horovod_jobs("tf_np2").completed("tf_summing")
    applied, _ = check_against_reference(results, opts, steps=4, times=2)
    assert density(applied[0], "hidden.weight") == 1.0 and density(applied[3], "hidden.weight") < 0.1
    check_identical_weights(results)


def test_huge_finite_gradients_are_sent_not_taken_for_non_finite(tmp_path):
    """The finiteness check goes entry by entry: gradients whose sum overflows fp32 are finite."""
    code = ("import numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "w = tf.Variable(tf.zeros([64]))\n"
            "compression = ScaleCom([w], ratio=0.05, min_numel=10)\n"
            "grad = tf.constant(np.r_[[3e38, 3e38, 3e38], np.arange(61.0)], tf.float32)\n"
            "values, ctx = compression.compress(grad)\n"
            "import json; print('VALUES', json.dumps(sorted(values.numpy().tolist())))\n")
    line, = one_rank(code, "VALUES ")
    assert json.loads(line[len("VALUES "):]) == pytest.approx([60.0, 3e38, 3e38, 3e38], rel=1e-6)


def test_an_embedding_gradient_densified_outside_tf_function_is_matched_to_its_variable():
    """Eagerly, Horovod traces its reduction in a tf.function of its own, where a densified embedding
    gradient (sparse_as_dense=True) has shape (None, 16): compatible with the variable's (500, 16),
    so it is its gradient (made (500, 16) again), as in a tf.function step."""
    code = ("import numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "emb = tf.Variable(tf.random.normal([500, 16], seed=1))\n"
            "compression = ScaleCom([emb], ratio=0.05, min_numel=100)\n"
            "def step(ids):\n"
            "    with tf.GradientTape() as tape:\n"
            "        loss = tf.reduce_sum(tf.gather(emb, ids) ** 2)\n"
            "    tape = hvd.DistributedGradientTape(tape, compression=compression, sparse_as_dense=True)\n"
            "    return tape.gradient(loss, [emb])[0]\n"
            "for label, run in (('EAGER', step), ('FUNCTION', tf.function(step))):\n"
            "    g = run(tf.constant([1, 2, 3]))\n"
            "    expected = np.zeros((500, 16), np.float32)\n"
            "    expected[[1, 2, 3]] = 2 * emb.numpy()[[1, 2, 3]]  # k = 400 >= the 48 non-zero entries\n"
            "    print(label, g.shape == (500, 16) and bool(np.allclose(g.numpy(), expected)))\n"
            "    emb.assign_add(tf.ones_like(emb))\n")
    assert one_rank(code, "EAGER ", "FUNCTION ") == ["EAGER True", "FUNCTION True"]


tf_run("tf_np2", "tf_embedding", {},
       ["test_an_embedding_first_among_variables_trains_as_the_reference_eagerly_and_traced"],
       worker="tf_embedding.py")


def test_an_embedding_first_among_variables_trains_as_the_reference_eagerly_and_traced(horovod_jobs):
    """2 ranks, an embedding (variable #0) and a dense layer, sparse_as_dense=True, one warm-up step:
    eagerly (Horovod's own tf.function, where the densified gradient's shape is (None, 16)) and in a
    tf.function, every step applies the reference's update. (Eagerly, the step check of variable #0
    was built in its gradient's cond branch, out of reach of the next variable's: InaccessibleTensorError.)"""
    results = horovod_jobs("tf_np2").completed("tf_embedding")
    assert len(results) == 2
    for mode in ("eager", "function"):
        for rank, r in enumerate(results):
            assert str(r[f"{mode}/error"]) == "", f"{mode}, rank {rank}: {r[f'{mode}/error']}"
        grads = [[{n: r[f"{mode}/raw/{t}/{n}"] for n in "01"} for r in results] for t in range(3)]
        applied, _ = scalecom_reference(grads, list("01"), 2, 0.05, 0.5, 1, 100)
        for t in range(3):
            for n in "01":
                for rank, r in enumerate(results):
                    np.testing.assert_allclose(r[f"{mode}/applied/{t}/{n}"], applied[t][n], rtol=2e-5, atol=1e-6,
                                               err_msg=f"{mode}, step {t}, variable {n}, rank {rank}")
        assert density(applied[0], "0") > density(applied[2], "0")  # (dense warm-up, then k entries)


def test_a_checkpoint_restore_rolls_the_statistics_back_with_the_steps():
    """tf.train.Checkpoint saves the tallies behind stats() with the step counters: after going back
    to step 3 of 8, stats() covers steps 0-2 (one warm-up, two compressed), as before step 3."""
    code = ("import json, numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "compression = ScaleCom([tf.Variable(tf.zeros([2000]))], ratio=0.05, min_numel=100,\n"
            "                       warmup_steps=1)\n"
            "def step(t):\n"
            "    grad = tf.constant(np.random.default_rng(t).standard_normal(2000), tf.float32)\n"
            "    compression.decompress(*compression.compress(grad))\n"
            "checkpoint = tf.train.Checkpoint(compression=compression)\n"
            "for t in range(3): step(t)\n"
            "before = compression.stats()\n"
            "path = checkpoint.write(__import__('tempfile').mkdtemp() + '/ckpt')\n"
            "for t in range(3, 8): step(t)\n"
            "checkpoint.read(path).assert_consumed()\n"
            "after = compression.stats()\n"
            "print('SAME', json.dumps(before == after), after['step'], after['total']['uncompressed_bytes'])\n")
    assert one_rank(code, "SAME ") == ["SAME true 2 24000"]


def test_a_checkpoint_restores_only_into_a_scalecom_built_alike():
    """Memories are saved by position among the compressed variables: restored into another
    min_numel they would go to other variables (here one of the same shape), into another ratio,
    beta or mode they would feed other equations. Each such restore raises ValueError naming what
    differs and leaves the memories and counters as they were; one built alike restores them."""
    code = ("import numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "variables = [tf.Variable(tf.zeros([n])) for n in (2000, 3000, 2000)]\n"
            "def built(**changed):\n"
            "    return ScaleCom(variables, **{'ratio': 0.05, 'min_numel': 1000, **changed})\n"
            "saved = built()\n"
            "for t in range(3):\n"
            "    for v in variables:\n"
            "        grad = tf.constant(np.random.default_rng(t).standard_normal(v.shape), tf.float32)\n"
            "        saved.decompress(*saved.compress(grad))\n"
            "path = tf.train.Checkpoint(compression=saved).write(__import__('tempfile').mkdtemp() + '/ckpt')\n"
            "for changed in ({'min_numel': 2500}, {'ratio': 0.01}, {'beta': 0.5}, {'pipelined': True}, {}):\n"
            "    other = built(**changed)\n"
            "    for m in other.memories: m.assign(tf.fill(m.shape, 7.0))\n"
            "    try:\n"
            "        tf.train.Checkpoint(compression=other).read(path).assert_consumed()\n"
            "        print('RESTORED', changed, all(np.array_equal(a.numpy(), b.numpy()) and a.numpy().any()\n"
            "              for a, b in zip(saved.memories, other.memories)), [int(s) for s in other.steps])\n"
            "    except ValueError as e:\n"
            "        kept = all((m.numpy() == 7).all() for m in other.memories)\n"
            "        print('REFUSED', str(e).split(': ', 2)[-1], kept, [int(s) for s in other.steps])\n")
    assert one_rank(code, "RESTORED ", "REFUSED ") == [
        "REFUSED min_numel 1000, 2500 True [0, 0, 0]",
        "REFUSED ratio 0.05, 0.01 True [0, 0, 0]",
        "REFUSED beta 0.1, 0.5 True [0, 0, 0]",
        "REFUSED pipelined False, True True [0, 0, 0]",
        "RESTORED {} True [3, 3, 3]"]


def test_a_keras_model_with_the_distributed_optimizer_saves_and_loads_as_documented(tmp_path):
    """model.save works; load_model(compile=False) gives the same weights, and the model trains
    again once compiled with a new DistributedOptimizer. The loss reads the outputs as logits: read
    as probabilities, outputs all below zero are clipped and give every weight a zero gradient."""
    path = tmp_path / "model.keras"
    code = ("import numpy as np, tensorflow as tf, keras, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom, keras as hsk\n"
            "hvd.init()\n"
            "keras.utils.set_random_seed(0)\n"
            "x, y = np.random.default_rng(0).random((32, 8), np.float32), np.arange(32) % 4\n"
            "def compiled(model):\n"
            "    compression = ScaleCom(model.trainable_variables, ratio=0.1, min_numel=16)\n"
            "    model.compile(optimizer=hsk.DistributedOptimizer(keras.optimizers.SGD(0.1), compression),\n"
            "                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),\n"
            "                  jit_compile=False)\n"
            "    return model\n"
            "model = compiled(keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(4)]))\n"
            "model.fit(x, y, batch_size=16, epochs=1, verbose=0)\n"
            f"model.save({str(path)!r})\n"
            f"loaded = keras.models.load_model({str(path)!r}, compile=False)\n"
            "same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), loaded.get_weights()))\n"
            "before = loaded.get_weights()\n"
            "compiled(loaded).fit(x, y, batch_size=16, epochs=1, verbose=0)\n"
            "moved = all(not np.array_equal(a, b) for a, b in zip(before, loaded.get_weights()))\n"
            "print('LOADED', same, moved)\n")
    assert one_rank(code, "LOADED ") == ["LOADED True True"]


def test_stats_refuses_bad_steps_as_pytorch_does():
    """stats(step=...): an int >= 0 (bools are not), and one of the last 8 steps (TIMING_STEPS); a
    step not begun yet has zeros; before any step nothing is refused. Messages as PyTorch's."""
    code = ("import json, numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "compression = ScaleCom([tf.Variable(tf.zeros([2000]))], ratio=0.05, min_numel=100)\n"
            "print('FRESH', compression.stats(step=5)['sent_bytes'])\n"
            "for t in range(12):\n"
            "    grad = tf.constant(np.random.default_rng(t).standard_normal(2000), tf.float32)\n"
            "    compression.decompress(*compression.compress(grad))\n"
            "for step in (11, np.int64(4), 12, 3, -1, True, 2.5, '3'):\n"
            "    try:\n"
            "        s = compression.stats(step=step)\n"
            "        print('STEP', json.dumps([s['step'], s['sent_bytes'], s['compress_seconds'] > 0]))\n"
            "    except (TypeError, ValueError) as e:\n"
            "        print('STEP', type(e).__name__, e)\n")
    assert one_rank(code, "FRESH", "STEP") == [
        "FRESH 0",
        "STEP [11, 800, true]", "STEP [4, 800, true]", "STEP [12, 0, false]",
        "STEP ValueError step 3 is not kept: the statistics keep the last 8 steps (4..11); 'total' "
        "counts every step",
        "STEP ValueError step must be >= 0, got -1", "STEP TypeError step must be an int, got True",
        "STEP TypeError step must be an int, got 2.5", "STEP TypeError step must be an int, got '3'"]


def test_make_train_step_scales_the_loss_as_keras_train_step_does():
    """Keras optimizers divide what they apply by their loss scale (loss_scale_factor=, a
    LossScaleOptimizer's dynamic scale): make_train_step multiplies the loss by optimizer.scale_loss
    as Keras's own train step does, so that the update is the same as that of train_on_batch, and
    returns the unscaled loss."""
    code = ("import numpy as np, tensorflow as tf, keras, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import make_train_step\n"
            "hvd.init()\n"
            "x, y = np.random.default_rng(0).random((16, 8), np.float32), np.arange(16) % 4\n"
            "loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)\n"
            "def model():\n"
            "    keras.utils.set_random_seed(0)\n"
            "    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])\n"
            "def update(train, optimizer):\n"
            "    m = model()\n"
            "    before = m.get_weights()\n"
            "    loss_value = float(train(m, optimizer))\n"
            "    return [b - a for b, a in zip(before, m.get_weights())], loss_value\n"
            "def keras_step(m, optimizer):\n"
            "    m.compile(optimizer=optimizer, loss=loss, jit_compile=False)\n"
            "    return m.train_on_batch(x, y)\n"
            "def helper_step(m, optimizer):\n"
            "    return make_train_step(m, optimizer, loss)(x, y)\n"
            "unscaled = float(loss(y, model()(x)))\n"
            "for label, make in [('plain', lambda: keras.optimizers.SGD(0.1)),\n"
            "                    ('factor', lambda: keras.optimizers.SGD(0.1, loss_scale_factor=128.0)),\n"
            "                    ('dynamic', "
            "lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))]:\n"
            "    (expected, _), (got, loss_value) = update(keras_step, make()), update(helper_step, make())\n"
            "    same = all(np.allclose(g, e, rtol=1e-6, atol=1e-9) for g, e in zip(got, expected))\n"
            "    print(label, same, np.abs(expected[0]).sum() > 0.01, loss_value == unscaled)\n")
    assert one_rank(code, "plain", "factor", "dynamic") == [
        "plain True True True", "factor True True True", "dynamic True True True"]


def one_rank(code, *prefixes):
    """Runs ``code`` in the tests' shared Python (tests/shared_python.py: a one-rank Horovod job after
    its first ``hvd.init()``); returns the lines it printed that start with one of ``prefixes``."""
    from shared_python import run_snippet

    return [ln for ln in run_snippet(code).splitlines() if ln.startswith(prefixes)]


def test_a_gradient_that_bypasses_compress_is_an_error_at_the_next_step():
    """Horovod sends an IndexedSlices gradient to its allgather without calling compress; the
    gradients after it would be matched to the wrong variables. With three variables of one shape
    (so no shape check can notice), the first step goes through, the third gradient going to the
    second variable, and the second step raises, changing no variable's counter, tally or memory."""
    code = ("import json, numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "rng = np.random.default_rng(0)\n"
            "variables = [tf.Variable(rng.standard_normal([16, 100]), dtype=tf.float32) for _ in range(3)]\n"
            "compression = ScaleCom(variables, ratio=0.01, beta=0.5, min_numel=10)\n"
            "@tf.function\n"
            "def step():  # as DistributedGradientTape.gradient reduces: one allreduce per gradient\n"
            "    sparse = tf.IndexedSlices(tf.ones([1, 100]), tf.constant([0]), tf.constant([16, 100]))\n"
            "    return (hvd.allreduce(tf.fill([16, 100], 1.0), compression=compression),\n"
            "            hvd.allreduce(sparse, compression=compression),\n"
            "            hvd.allreduce(tf.fill([16, 100], 2.0), compression=compression))\n"
            "def state():\n"
            "    return ([int(s.numpy()) for s in compression.steps],\n"
            "            [s.tally.numpy().tolist() for s in compression._slots],\n"
            "            [float(np.abs(m.numpy()).sum()) for m in compression.memories], compression.stats())\n"
            "step()\n"
            "before = state()\n"
            "print('STEPS', before[0], 'MEMORIES', [m > 0 for m in before[2]])\n"
            "try:\n"
            "    step()\n"
            "except tf.errors.InvalidArgumentError as e:\n"
            "    print('REFUSED', 'did not reach compress' in e.message and 'sparse_as_dense=True' in e.message)\n"
            "print('UNCHANGED', json.dumps(state() == before))\n")
    assert one_rank(code, "STEPS", "MEMORIES", "REFUSED", "UNCHANGED") == [
        "STEPS [1, 1, 0] MEMORIES [True, True, False]", "REFUSED True", "UNCHANGED true"]


def test_an_eager_step_refused_part_way_is_refused_until_a_restore():
    """``hvd.allreduce(g, compression=...)`` eagerly, one gradient at a time: a gradient refused at
    variable #2 comes after #0 and #1 were reduced, so every later step is refused, saying why, until
    a state is restored by ``load_state_dict`` or a ``tf.train.Checkpoint`` (before, each later
    gradient went to the variable after the last taken, and was refused or, of a fitting shape,
    misplaced); the restored ScaleCom then steps as one that never saw the refused step. A gradient refused at
    variable #0 leaves the next step to begin there."""
    code = ("import numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "variables = [tf.Variable(tf.zeros([2000])), tf.Variable(tf.zeros([2000])), "
            "tf.Variable(tf.zeros([30, 10]))]\n"
            "good = [tf.fill([2000], 1.0), tf.range(2000, dtype=tf.float32), tf.fill([30, 10], 3.0)]\n"
            "compression, twin = (ScaleCom(variables, ratio=0.05, beta=0.5, min_numel=100) for _ in range(2))\n"
            "def reduce_all(sc, grads):\n"
            "    return [hvd.allreduce(g, compression=sc).numpy() for g in grads]\n"
            "try:\n"
            "    reduce_all(compression, [tf.ones([7])] + good[1:])\n"
            "except ValueError as e:\n"
            "    print('FIRST', 'gradient #0' in str(e), [int(s) for s in compression.steps])\n"
            "reduce_all(compression, good), reduce_all(twin, good)\n"
            "saved = compression.state_dict()\n"
            "try:\n"
            "    reduce_all(compression, good[:2] + [tf.ones([300])])\n"
            "except ValueError as e:\n"
            "    print('PART', 'gradient #2' in str(e), [int(s) for s in compression.steps])\n"
            "for _ in range(2):\n"
            "    try:\n"
            "        reduce_all(compression, good)\n"
            "    except RuntimeError as e:\n"
            "        print('STALLED', 'refused gradient #2 of an eager step after variables #0 to #1' in str(e))\n"
            "compression.load_state_dict(saved)\n"
            "got, expected = reduce_all(compression, good), reduce_all(twin, good)\n"
            "print('RESUMED', all(np.array_equal(g, e) for g, e in zip(got, expected)),\n"
            "      [int(s) for s in compression.steps],\n"
            "      all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(compression.memories, twin.memories)))\n"
            "import tempfile\n"  # the same through a tf.train.Checkpoint, refused at variable #1
            "checkpoint = tf.train.Checkpoint(compression=compression)\n"
            "path = checkpoint.write(tempfile.mkdtemp() + '/ckpt')\n"
            "try:\n"
            "    reduce_all(compression, good[:1] + [tf.ones([300])])\n"
            "except ValueError:\n"
            "    try:\n"
            "        reduce_all(compression, good)\n"
            "    except RuntimeError as e:\n"
            "        print('STALLED', 'refused gradient #1 of an eager step after variables #0 to #0' in str(e))\n"
            "checkpoint.read(path).assert_consumed()\n"
            "got, expected = reduce_all(compression, good), reduce_all(twin, good)\n"
            "print('RESTORED', all(np.array_equal(g, e) for g, e in zip(got, expected)),\n"
            "      [int(s) for s in compression.steps],\n"
            "      all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(compression.memories, twin.memories)))\n")
    assert one_rank(code, "FIRST", "PART", "STALLED", "RESUMED", "RESTORED") == [
        "FIRST True [0, 0, 0]", "PART True [2, 2, 1]", "STALLED True", "STALLED True", "RESUMED True [2, 2, 2] True",
        "STALLED True", "RESTORED True [3, 3, 3] True"]


tf_run("tf_np2", "tf_refusals", {},
       ["test_refused_steps_through_the_tape_change_nothing_and_grouped_fp16_values_are_refused"],
       worker="tf_refusals.py", timeout=600)


def test_refused_steps_through_the_tape_change_nothing_and_grouped_fp16_values_are_refused(horovod_jobs):
    """2 ranks, hvd.DistributedGradientTape, which compresses each gradient in a tf.cond branch of
    its own: a step refused because a sparse gradient bypassed compress leaves every variable's
    counter, tally, memory and stats() as they were, on every rank, and Horovod works on after it.
    groups=1 with fp16 values and a variable below min_numel (reduced densely in float32) would put
    two dtypes in one grouped allreduce: every rank gets a ValueError naming both arguments.
    groups= as lists of variables out of ScaleCom's order (Horovod reduces group by group) is refused
    naming groups, before anything changes; lists in its order train. A tape
    with op=hvd.Sum around a ScaleCom that averages is refused at its warm-up step, eager or traced.
    A step compiled by XLA (jit_compile=True) is refused naming jit_compile, and a Keras model whose
    trainable variables changed (a layer frozen) after a make_train_step step or a model.fit step
    with DistributedOptimizer is refused at the next step, before anything changes. A Keras model with a
    layer the loss does not use (None gradients) is refused at its first step by both helpers, before
    anything changes."""
    results = horovod_jobs("tf_np2").completed("tf_refusals")
    assert len(results) == 2
    for rank, r in enumerate(results):
        assert "did not reach compress" in str(r["bypass/error"]), f"rank {rank}"
        assert list(r["bypass/steps/first"]) == [1, 1, 1, 0]
        for what in ("steps", "tallies", "memories"):
            np.testing.assert_array_equal(r[f"bypass/{what}/refused"], r[f"bypass/{what}/first"],
                                          err_msg=f"rank {rank}: {what}")
        assert np.abs(r["bypass/memories/first"][1]).sum() > 0  # (the second variable's changed)
        assert json.loads(str(r["bypass/stats/refused"])) == json.loads(str(r["bypass/stats/first"]))
        assert list(r["bypass/after"]) == [1.0]  # 0 + 1
        error = str(r["groups/error"])
        assert error.startswith("ValueError") and "value_dtype='float16' does not go with groups=" in error
        assert "variable #1 ('Variable#1') travels as float32 (dense: 10 entries, below " \
               "min_numel=100)" in error, error
        for label in ("swapped", "partial"):  # (before: a shape error naming neither groups nor order)
            for mode in ("eager", "function"):
                error = str(r[f"groups_order/{label}/{mode}/error"])
                assert error.startswith("ValueError") and "matches gradients to them by position" in error \
                    and "groups= of hvd.DistributedGradientTape or hvd.DistributedOptimizer given as lists" \
                    in error, f"rank {rank}, {label}, {mode}: {error}"
        assert list(r["groups_order/refused_steps"]) == [0, 0, 0, 0]
        assert list(r["groups_order/in_order_steps"]) == [1, 1, 1, 1]
        # (the same gradient 2w on both ranks: the reduced one is 2w at the top 60 of |w|, zero elsewhere)
        weight, grad = r["groups_order/weight"].reshape(-1), r["groups_order/grad"].reshape(-1)
        top = np.argsort(-np.abs(weight), kind="stable")[:60]
        expected = np.zeros_like(weight)
        expected[top] = 2 * weight[top]
        np.testing.assert_allclose(grad, expected, rtol=1e-6)
        for mode in ("eager", "function"):  # (before: the warm-up step applied the average, silently)
            error = str(r[f"op/{mode}/error"])
            assert "ScaleCom was built with op=Average but Horovod reduced its tensors with the other op" in error, \
                f"rank {rank}, {mode}: {error}"
        error = str(r["xla/error"])  # (before: XLA's error naming ScaleCom's Timestamp op)
        assert error.startswith("ValueError") and "jit_compile=True" in error and \
            "Use jit_compile=False" in error, f"rank {rank}: {error}"
        assert list(r["xla/steps"]) == [0, 0] and not r["xla/moved"]
        for how, changed in (("step", "4 then, 2 now"), ("fit", "built for 4 variables, got 2")):
            error = str(r[f"frozen/{how}/error"])  # (before: the step trained the frozen layer; fit
            # went one step on, then blamed a sparse or None gradient)
            assert error.startswith("ValueError") and changed in error, f"rank {rank}, {how}: {error}"
            assert not r[f"frozen/{how}/moved"].any(), f"rank {rank}, {how}"
            assert list(r[f"frozen/{how}/steps"]) == [1, 1, 1, 1], f"rank {rank}, {how}"
        for how in ("step", "fit"):  # (before: the step went through, the last layer's gradients
            # compressed with the unused layer's memories; the next step was refused)
            error = str(r[f"unused/{how}/error"])
            assert error.startswith("ValueError") and "ScaleCom needs a gradient for every variable" in error \
                and re.search("#2 '[^']*kernel', #3 '[^']*bias' got none", error), f"rank {rank}, {how}: {error}"
            assert not r[f"unused/{how}/moved"].any(), f"rank {rank}, {how}"
            assert list(r[f"unused/{how}/steps"]) == [0] * 6, f"rank {rank}, {how}"


PROCESS_SET = {"ratio": 0.01, "beta": 0.3, "min_numel": 600, "steps": 5, "leader": "staggered",
               "value_dtype": "float16", "index_dtype": "int32", "selection": "threshold",
               "hidden": 1400, "mode": "function", "process_set": [0, 2]}
tf_run("tf_np3", "tf_process_set", PROCESS_SET, ["test_staggered_leader_fp16_values_threshold_selection_process_set"],
       first=True)  # (its hvd.init registers the process set: first in the job)


def test_staggered_leader_fp16_values_threshold_selection_process_set(horovod_jobs):
    """3 ranks, training on the process set {0, 2} (broadcast roots are global ranks), a hidden
    layer of 67,200 entries (so "threshold" runs its sampled path). Rank 1, outside the set, runs the
    same steps: Horovod's tape hands it its own gradients, as it does without ScaleCom."""
    opts = PROCESS_SET
    job = horovod_jobs("tf_np3")
    results = job.completed("tf_process_set", size=2)
    tmp_path = job.root / "tf_process_set"
    assert len(results) == 2  # ranks 0 and 2
    # (before: rank 1 failed in ScaleCom's agreement allgather, "Rank 1 is not a member of the provided process set")
    outsider = dict(np.load(tmp_path / "outsider1.npz", allow_pickle=False))
    assert list(outsider["steps"]) == [0] * 4
    for t in range(5):
        for n in NAMES:
            np.testing.assert_allclose(outsider[f"applied/{t}/{n}"], outsider[f"raw/{t}/{n}"], rtol=1e-5,
                                       atol=1e-6, err_msg=f"step {t}, {n}")  # (traced and eager sums)
    check_against_reference(results, opts, steps=5, rtol=2e-3, atol=2e-4, value_dtype=np.float16)
    check_identical_weights(results)
    stats = json.loads(str(results[0]["stats"]))
    k = {n: math.ceil(0.01 * math.prod(s)) for n, s in shapes(1400).items()}
    compressed = k["hidden.weight"] + k["hidden.bias"] + k["out.weight"]  # 1,400 >= min_numel too
    assert stats["value_bytes"] == 2 * compressed
    assert stats["index_bytes"] == 4 * compressed
    assert stats["dense_bytes"] == 4 * 10


KERAS_HELPERS = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 7,
                 "mode": "keras", "lr": 1.0, "eager_from": 3, "fit_from": 5, "tensorboard": True,
                 "loss_scale_factor": 128.0}
tf_run("tf_np2", "tf_keras_helpers", KERAS_HELPERS, ["test_keras_helpers_match_reference"])


def test_keras_helpers_match_reference(horovod_jobs):
    """One Keras 3 model and one ScaleCom: make_train_step as a tf.function (steps 0-2), eagerly
    (3-4), then model.fit with DistributedOptimizer (5-6). The applied update is the reference's.
    The LogStats callback writes stats() during fit, at the optimizer's iterations 1 and 2. The
    optimizers have loss_scale_factor=128: the gradients ScaleCom compresses are the loss-scaled
    ones, and the optimizer's apply divides the scale out again."""
    opts = KERAS_HELPERS
    job = horovod_jobs("tf_np2")
    results = job.completed("tf_keras_helpers")
    tmp_path = job.root / "tf_keras_helpers"
    check_against_reference(results, opts, steps=7, rtol=1e-4, atol=2e-6)
    check_identical_weights(results)
    check_logged_stats(results, tmp_path, [1, 2])


def per_execution_opts(per_execution, pipelined):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 5, "mode": "keras",
            "lr": 1.0, "fit_from": 0, "steps_per_execution": per_execution, "pipelined": pipelined}


for ranks, per_execution, pipelined, _ in [(2, 2, False, 3), (3, 3, True, 2)]:
    tf_run(f"tf_np{ranks}", f"tf_per_execution_{per_execution}", per_execution_opts(per_execution, pipelined),
           ["test_keras_fit_with_steps_per_execution_matches_reference"])


@pytest.mark.parametrize("ranks, per_execution, pipelined, executions",
                         [(2, 2, False, 3), (3, 3, True, 2)])
def test_keras_fit_with_steps_per_execution_matches_reference(horovod_jobs, ranks, per_execution,
                                                             pipelined, executions):
    """model.fit with DistributedOptimizer and steps_per_execution > 1, which runs the steps of an
    execution in a tf.while_loop: 5 steps in executions of 2, 2 and 1 (2 ranks) or of 3 and 2
    (3 ranks, pipelined); the model keeps its weights after each step: each update is the reference's."""
    opts = per_execution_opts(per_execution, pipelined)
    results = horovod_jobs(f"tf_np{ranks}").completed(f"tf_per_execution_{per_execution}")
    assert all(len(r["fit_executions"]) == executions for r in results)
    applied, _ = check_against_reference(results, opts, steps=5, rtol=1e-4, atol=2e-6)
    with pytest.raises(AssertionError):  # (control: the check tells exact from pipelined ScaleCom)
        check_against_reference(results, {**opts, "pipelined": not pipelined}, steps=5)
    check_identical_weights(results)
    assert [density(applied[t], "hidden.weight") == 1.0 for t in range(5)] == [True] + [False] * 4
    assert all(list(r["steps"]) == [5] * 4 for r in results)


def loss_scale_opts(policy):
    return {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "steps": 4, "mode": "keras",
            "lr": 1.0, "fit_from": 0, "loss_scale": 1024.0, "policy": policy, "state_round_trip": True}


for policy in [None, "mixed_float16"]:
    tf_run("tf_np2", f"tf_loss_scale_{policy}", loss_scale_opts(policy),
           ["test_keras_fit_with_a_loss_scale_optimizer_matches_reference"])


@pytest.mark.parametrize("policy", [None, "mixed_float16"])
def test_keras_fit_with_a_loss_scale_optimizer_matches_reference(horovod_jobs, policy):
    """model.fit with DistributedOptimizer(LossScaleOptimizer(SGD), ScaleCom), 2 ranks, under a
    float32 or a mixed_float16 policy (which then adds no LossScaleOptimizer of its own): the updates
    are the reference's, and ScaleCom's memories hold the gradients of the scaled loss, the
    reference's times the scale (1024 all along)."""
    opts = loss_scale_opts(policy)
    results = horovod_jobs("tf_np2").completed(f"tf_loss_scale_{policy}")
    applied, memories = check_against_reference(results, opts, steps=4, rtol=1e-4, atol=2e-6)
    check_identical_weights(results)
    assert density(applied[3], "hidden.weight") == pytest.approx(0.05, abs=0.002)
    for rank, r in enumerate(results):
        assert float(r["dynamic_scale"]) == 1024.0
        expected = 1024.0 * memories[rank]["hidden.weight"]
        assert np.abs(expected).max() > 1.0
        np.testing.assert_allclose(r["memory/hidden.weight"], expected, rtol=1e-4, atol=1e-3,
                                   err_msg=f"rank {rank}")


def test_checkpoint_round_trip_continues_identically(horovod_jobs, straight_run):
    """10 steps straight equal 5 steps, a tf.train.Checkpoint, new processes, and 5 more steps."""
    straight, _, _ = straight_run
    resumed = horovod_jobs("tf_np2").completed("tf_resumed")
    # Dense reductions may be fused differently from run to run: sums may differ in the last bit.
    for rank in range(2):
        for n in NAMES:
            np.testing.assert_allclose(resumed[rank][f"final/{n}"], straight[rank][f"final/{n}"],
                                       rtol=1e-5, atol=1e-7, err_msg=f"{n}, rank {rank}")
        assert list(resumed[rank]["steps"]) == [10, 10, 10, 10]
    # Control: the same continuation without the residue memories and step counters differs.
    diff = np.abs(resumed[0]["forgetful/final/hidden.weight"] - straight[0]["final/hidden.weight"])
    assert diff.max() > 1e-4


# -- bad input: checked in this process, no Horovod job needed ------------------------------------

@pytest.fixture(scope="module")
def tf_modules():
    tf = pytest.importorskip("tensorflow")
    from hvd_scalecom.tensorflow import ScaleCom
    return tf, ScaleCom


def test_a_misspelt_selection_is_refused_at_every_size():
    """TensorFlow's select_top_k checks ``selection`` before any size decides the path: a misspelt
    value is a ValueError for small tensors (which take the exact top-k) and for k >= numel too."""
    tf = pytest.importorskip("tensorflow")
    from hvd_scalecom.tensorflow import clt_k
    for numel, k in [(100, 5), (3, 5), (1 << 17, 50)]:
        with pytest.raises(ValueError, match="selection must be one of .* got 'threshhold'"):
            clt_k.select_top_k(tf.zeros([numel]), k, "threshhold")


def test_the_step_equations_match_numpy_bit_for_bit_and_threshold_indices_ascend():
    """TensorFlow's clt_k against NumPy, exactly: the sampled threshold finds the exact top-k set, in
    ascending order; take, filter_memory (fp32 and fp64 memories, values sent in fp16 or not) and
    scatter_dense (a -0.0 stays -0.0) give NumPy's bits."""
    tf = pytest.importorskip("tensorflow")
    from hvd_scalecom.tensorflow import clt_k
    rng = np.random.default_rng(3)
    numel, k = 1 << 17, 1311  # (the sampled path: numel >= 65,536 and k <= numel / 16)
    p = rng.standard_normal(numel).astype(np.float32)
    expected = np.sort(np.argsort(-np.abs(p), kind="stable")[:k])
    for selection in ("threshold", "exact"):
        got = clt_k.select_top_k(tf.constant(p), k, selection).numpy()
        np.testing.assert_array_equal(np.sort(got), expected, err_msg=selection)
    np.testing.assert_array_equal(clt_k.select_top_k(tf.constant(p), k, "threshold").numpy(), expected)
    for memory_dtype, sent, beta in [(np.float32, np.float32, 0.1), (np.float32, np.float16, 0.3),
                                     (np.float64, np.float64, 1.0 / 3)]:
        m0 = (rng.standard_normal(numel) * 10.0).astype(memory_dtype)
        g = rng.standard_normal(numel).astype(np.float32)
        memory = tf.Variable(m0)
        indices = tf.constant(expected.astype(np.int32))
        at, values = clt_k.take(memory, tf.constant(g), indices)
        np.testing.assert_array_equal(at.numpy(), m0[expected])
        np.testing.assert_array_equal(values.numpy(), m0[expected] + g[expected].astype(memory_dtype))

        tf.function(lambda: [clt_k.filter_memory(memory, tf.constant(g), indices, at, values, beta,
                                                 tf.as_dtype(sent)), None][1], autograph=False)()  # (traced)
        want = m0 + memory_dtype(beta) * g.astype(memory_dtype)
        kept = memory_dtype(1.0 - beta) * m0[expected]
        if sent != memory_dtype:
            v = values.numpy()
            kept = kept + memory_dtype(beta) * (v - v.astype(sent).astype(memory_dtype))
        want[expected] = kept
        np.testing.assert_array_equal(memory.numpy(), want, err_msg=f"{memory_dtype.__name__}, {sent.__name__}")
    values = np.array([1.5, -0.0, np.nan], np.float32)
    dense = clt_k.scatter_dense(tf.constant(values), tf.constant([3, 7, 11]), (3, 4), tf.float32).numpy()
    assert dense.shape == (3, 4) and np.count_nonzero(dense) == 2 and dense[0, 3] == 1.5
    assert np.isnan(dense[2, 3]) and dense[1, 3] == 0 and np.signbit(dense[1, 3])


def test_bad_arguments_name_the_argument(tf_modules):
    tf, ScaleCom = tf_modules
    ok = [tf.Variable(tf.zeros([40, 30])), tf.Variable(tf.zeros([5]))]
    cases = [
        (dict(ratio=0.0), ValueError, "ratio"), (dict(ratio=1.5), ValueError, "ratio"),
        (dict(beta=0.0), ValueError, "beta"), (dict(beta="x"), ValueError, "beta"),
        (dict(warmup_steps=-1), ValueError, "warmup_steps"),
        (dict(warmup_steps=1.5), TypeError, "warmup_steps"),
        (dict(warmup_steps=2 ** 63), ValueError, "warmup_steps must be below 2\\*\\*63"),  # int64 counters
        (dict(min_numel=-3), ValueError, "min_numel"), (dict(leader="random"), ValueError, "leader"),
        (dict(selection="approx"), ValueError, "selection"), (dict(op=2), ValueError, "op"),
        (dict(op=True), ValueError, "op"),
        (dict(value_dtype=tf.int8), ValueError, "value_dtype"),
        (dict(value_dtype=tf.bfloat16), ValueError, "value_dtype"),  # (no Horovod TF kernel for it)
        (dict(index_dtype=tf.float32), ValueError, "index_dtype"),
        (dict(process_set=0), TypeError, "process_set"),
        (dict(index_exchange="gather"), ValueError, "index_exchange"),
        (dict(check_every=0), ValueError, "check_every"), (dict(check_every=2.5), TypeError, "check_every"),
        (dict(fallback="dense"), ValueError, "needs check_every"),
        (dict(check_every=4, fallback="sparse"), ValueError, "fallback"),
        (dict(check_every=4, min_captured=1.5), ValueError, "min_captured"),
        (dict(check_every=4, patience=0), ValueError, "patience"),
        (dict(check_every=4, fallback="dense", pipelined=True), ValueError,
         "fallback='dense' does not go with pipelined"),
    ]
    for kwargs, error, word in cases:
        with pytest.raises(error, match=word):
            ScaleCom(ok, **kwargs)
    for variables, error, word in [
            (None, TypeError, "variables"), (tf.zeros([3]), TypeError, "variables"),
            ([], ValueError, "variables is empty"), ([tf.zeros([3])], TypeError, "variables\\[0\\]"),
            ([tf.Variable([1, 2])], TypeError, "floating-point"),
            ([ok[0], ok[0]], ValueError, "twice")]:
        with pytest.raises(error, match=word):
            ScaleCom(variables)
    # tf and NumPy dtypes and names are accepted alike.
    assert ScaleCom(ok, value_dtype=tf.float16, index_dtype=np.int64).config.index_dtype == "int64"


def test_gradients_that_do_not_match_the_variables(tf_modules):
    tf, ScaleCom = tf_modules
    compression = ScaleCom([tf.Variable(tf.zeros([40, 30])), tf.Variable(tf.zeros([5]))],
                           min_numel=100)
    with pytest.raises(ValueError, match="shape \\(5,\\).*variable #0"):
        compression.compress(tf.zeros([5]))  # gradients in the wrong order
    with pytest.raises(TypeError, match="sparse_as_dense"):
        compression.compress(tf.IndexedSlices(tf.zeros([2, 30]), tf.constant([0, 1]),
                                              tf.constant([40, 30])))
    with pytest.raises(TypeError, match="floating-point"):
        compression.compress(tf.zeros([40, 30], tf.int32))
    with pytest.raises(ValueError, match="variable #0"):  # the refused gradients took no variable's place
        compression.compress(tf.zeros([5]))
    with pytest.raises(ValueError, match="built for 2 variables, got 1"):
        compression.check_variables([tf.Variable(tf.zeros([40, 30]))])


def test_load_state_dict_checks_everything_first(tf_modules):
    tf, ScaleCom = tf_modules
    variables = [tf.Variable(tf.zeros([40, 30]), name="w"), tf.Variable(tf.zeros([5]), name="b")]
    compression = ScaleCom(variables, min_numel=100)
    state = compression.state_dict()
    assert set(state["params"]) == {"w", "b"} and state["params"]["b"]["memory"] is None
    assert state["params"]["w"]["shape"] == [40, 30]
    good_memory = np.arange(1200, dtype=np.float32)
    key = hash(compression)  # part of Horovod's function cache key: a load must not change it (no retrace)
    bad = [
        ("not a dict", "state must be a dict"),
        ({**state, "config": {**state["config"], "beta": 0.5}}, "config"),
        ({**state, "params": {"w": state["params"]["w"]}}, "missing \\['b'\\]"),
        ({**state, "params": {"w": {"step": 3, "memory": good_memory},
                              "b": {"step": 3, "memory": np.zeros(5)}}}, "never compressed"),
        ({**state, "params": {"w": {"step": 3, "memory": np.zeros(7)},
                              "b": {"step": 3, "memory": None}}}, "7 entries"),
        ({**state, "params": {"w": {"step": 3, "memory": good_memory},
                              "b": {"step": -1, "memory": None}}}, "step of 'b'"),
        ({**state, "params": {"w": {"step": 3, "memory": good_memory},
                              "b": {"step": 2 ** 63, "memory": None}}}, "step of 'b' must be below 2\\*\\*63"),
        ({**state, "params": {"b": {"step": 3, "memory": None},
                              "w": {"step": 3, "memory": np.array(["x"] * 1200)}}}, "memory of 'w'"),
        ({**state, "params": {"b": {"step": 3, "memory": None},  # (1e39 becomes inf in fp32)
                              "w": {"step": 3, "memory": np.full(1200, 1e39)}}}, "memory of 'w' holds non-finite"),
        ({**state, "params": {"w": {"step": 3, "memory": good_memory},  # (every step reduces every variable)
                              "b": {"step": 2, "memory": None}}}, "steps differ between variables"),
        ({**state, "params": {"b": {"step": 3, "memory": None},  # (a transposed variable: as many entries)
                              "w": {"step": 3, "shape": [30, 40], "memory": good_memory}}},
         "'w' was saved for a variable of shape \\(30, 40\\), this one has shape \\(40, 30\\)"),
    ]
    for candidate, word in bad:
        with pytest.raises((ValueError, TypeError), match=word):
            compression.load_state_dict(candidate)
        # Nothing changed by a rejected state.
        assert [int(s.numpy()) for s in compression.steps] == [0, 0]
        assert not np.any(compression.memories[0].numpy())
    compression.load_state_dict({**state, "params": {"w": {"step": 3, "memory": good_memory},
                                                     "b": {"step": 3, "memory": None}}})
    assert [int(s.numpy()) for s in compression.steps] == [3, 3]
    np.testing.assert_array_equal(compression.memories[0].numpy(), good_memory)
    assert hash(compression) == key
    # Indices chosen ahead (pipelined) are checked too, and restored.
    with pytest.raises(ValueError, match="never selects ahead"):
        compression.load_state_dict({**state, "params": {
            "w": {"step": 3, "memory": good_memory, "next_indices": (3, np.arange(12))},
            "b": {"step": 3, "memory": None}}})
    pipelined = ScaleCom(variables, min_numel=100, pipelined=True)
    key = hash(pipelined)
    state = pipelined.state_dict()
    assert "next_indices" not in state["params"]["w"]  # nothing chosen ahead yet
    for indices, step in [(np.arange(11), 3), (np.arange(12) + 1190, 3), (np.arange(12.0), 3),
                          (np.arange(12), -2), (np.zeros(12, np.int64), 3),  # (repeated: scatter_nd would add)
                          (np.arange(12) * 7, 4)]:  # (for another step than the counters': a hang, or other I)
        with pytest.raises(ValueError, match="next_indices of 'w'"):
            pipelined.load_state_dict({**state, "params": {
                "w": {"step": 3, "memory": good_memory, "next_indices": (step, indices)},
                "b": {"step": 3, "memory": None}}})
        assert [int(s.numpy()) for s in pipelined.steps] == [0, 0]
    pipelined.load_state_dict({**state, "params": {
        "w": {"step": 3, "memory": good_memory, "next_indices": (3, np.arange(12) * 7)},
        "b": {"step": 3, "memory": None}}})
    saved = pipelined.state_dict()["params"]["w"]["next_indices"]
    assert saved[0] == 3 and list(saved[1]) == list(np.arange(12) * 7)
    assert hash(pipelined) == key


def test_keras_distributed_optimizer_refuses_an_apply_that_skips_the_reduction(tf_modules):
    """A mixed_float16 policy's LossScaleOptimizer calls the inner optimizer's apply() directly,
    which would train every rank alone: a clear error instead."""
    keras = pytest.importorskip("keras")
    from hvd_scalecom.tensorflow import DistributedOptimizer
    tf, ScaleCom = tf_modules
    variable = keras.Variable(np.ones(3, np.float32))
    inner = DistributedOptimizer(keras.optimizers.SGD(0.1), ScaleCom([variable], min_numel=100))
    scaled = keras.optimizers.LossScaleOptimizer(inner)
    with pytest.raises(RuntimeError, match="without Horovod's reduction") as refused:
        scaled.apply([tf.ones(3)], [variable])
    assert "put one inside instead: DistributedOptimizer(keras.optimizers.LossScaleOptimizer(optimizer), " \
        "compression)" in str(refused.value)
    np.testing.assert_array_equal(variable.numpy(), np.ones(3))


def test_keras_helpers_refuse_gradient_accumulation_with_scalecom(tf_modules):
    """An optimizer with gradient_accumulation_steps (its own, or a LossScaleOptimizer's inner one)
    would have ScaleCom compress and exchange every micro-batch: both helpers refuse it with ScaleCom,
    before building or broadcasting anything; a dense reduction takes it."""
    keras = pytest.importorskip("keras")
    from hvd_scalecom.tensorflow import DistributedOptimizer, make_train_step
    tf, ScaleCom = tf_modules
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    compression = ScaleCom(model.trainable_variables, min_numel=4)

    def accumulating():
        return keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)

    for optimizer in (accumulating(), keras.optimizers.LossScaleOptimizer(accumulating())):
        message = "optimizer has gradient_accumulation_steps=3, which ScaleCom does not support"
        with pytest.raises(ValueError, match=message):
            DistributedOptimizer(optimizer, compression)
        with pytest.raises(ValueError, match=message):
            make_train_step(model, optimizer, "mse", compression)
        assert not optimizer.built
    assert [int(s.numpy()) for s in compression.steps] == [0, 0, 0, 0]
    assert DistributedOptimizer(accumulating()).gradient_accumulation_steps == 3


def test_keras_helpers_reject_bad_input(tf_modules):
    keras = pytest.importorskip("keras")
    from hvd_scalecom.tensorflow import make_train_step
    tf, ScaleCom = tf_modules
    unbuilt = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="built"):
        make_train_step(unbuilt, keras.optimizers.SGD(0.1), "mse")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    other = ScaleCom([tf.Variable(tf.zeros([3, 4])), tf.Variable(tf.zeros([4]))])
    with pytest.raises(ValueError, match="built for 2 variables, got 4"):
        make_train_step(model, keras.optimizers.SGD(0.1), "mse", other)
    with pytest.raises(TypeError, match="optimizer"):
        make_train_step(model, "sgd", "mse")
    from hvd_scalecom.tensorflow import DistributedOptimizer
    with pytest.raises(TypeError, match="optimizer"):
        DistributedOptimizer("sgd")
    built = keras.optimizers.SGD(0.1)
    built.build(model.trainable_variables)
    with pytest.raises(ValueError, match="not be built"):
        DistributedOptimizer(built)
    from hvd_scalecom.tensorflow import LogStats
    with pytest.raises(TypeError, match="compression"):
        LogStats("scalecom")
    for every in (0, 1.5, True):
        with pytest.raises(ValueError, match="every"):
            LogStats(other, every=every)
    wrapped = DistributedOptimizer(keras.optimizers.SGD(0.25, momentum=0.5))
    assert isinstance(wrapped, keras.optimizers.SGD) and wrapped.get_config()["momentum"] == 0.5
    with pytest.raises(ValueError, match="optimizer is a DistributedOptimizer, which reduces the gradients again"):
        make_train_step(model, wrapped, "mse")  # (each gradient would be reduced and compressed twice)


def test_keras_distributed_optimizer_keeps_weight_decay_exclusions(tf_modules):
    """exclude_from_weight_decay() is not in an optimizer's config: the copy keeps it (the inner
    optimizer's too under a LossScaleOptimizer), where it used to decay the excluded variables."""
    keras = pytest.importorskip("keras")
    from hvd_scalecom.tensorflow import DistributedOptimizer
    kernel, bias = (keras.Variable(np.ones((3, 2), np.float32), name="kernel"),
                    keras.Variable(np.ones(2, np.float32), name="bias"))
    by_name = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    by_name.exclude_from_weight_decay(var_names=["bias"])
    by_variable = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    by_variable.exclude_from_weight_decay(var_list=[kernel])
    inner = keras.optimizers.AdamW(0.01, weight_decay=0.5)
    inner.exclude_from_weight_decay(var_names=["bias"])
    for optimizer, decayed in ((by_name, [True, False]), (by_variable, [False, True])):
        wrapped = DistributedOptimizer(optimizer)
        assert [wrapped._use_weight_decay(v) for v in (kernel, bias)] == decayed
    scaled = DistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner))
    assert [scaled.inner_optimizer._use_weight_decay(v) for v in (kernel, bias)] == [True, False]


def test_keras_helpers_reduce_as_scalecom_expects(tf_modules):
    """Sparse gradients would bypass ScaleCom (and shift the others onto the wrong variables); an op
    or process set other than ScaleCom's would make warm-up and compressed steps disagree."""
    keras = pytest.importorskip("keras")
    import horovod.tensorflow as hvd

    from hvd_scalecom.tensorflow import DistributedOptimizer, make_train_step
    tf, ScaleCom = tf_modules
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    averaging = ScaleCom(model.trainable_variables, min_numel=4)
    summing = ScaleCom(model.trainable_variables, min_numel=4, op=hvd.Sum)
    another_set = type("OtherSet", (), {"process_set_id": 7})()
    for compression, options, word in [(averaging, dict(sparse_as_dense=False), "sparse_as_dense=True"),
                                       (averaging, dict(op=hvd.Sum), "op"), (summing, {}, "op"),
                                       (averaging, dict(process_set=another_set), "process_set")]:
        with pytest.raises(ValueError, match=word):
            make_train_step(model, keras.optimizers.SGD(0.1), "mse", compression, **options)
    with pytest.raises(ValueError, match="sparse_as_dense=True"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), averaging, sparse_as_dense=False)
    with pytest.raises(ValueError, match="process_set"):
        DistributedOptimizer(keras.optimizers.SGD(0.1), averaging, process_set=another_set)
    DistributedOptimizer(keras.optimizers.SGD(0.1), summing)  # reduces with ScaleCom's op


# -- ranks configured differently: one clear error on every rank, in one job per size -------------

AGREEMENT_CASES = {
    2: [{"label": "ratio", "per_rank": {"1": {"ratio": 0.1}}},
        {"label": "shapes", "per_rank": {"1": {"hidden": 65}}},
        {"label": "beta", "per_rank": {"0": {"beta": 0.25}}, "eager": True},
        {"label": "prefix", "per_rank": {"0": {"extra_scalecom": True}}},  # one more ScaleCom built
        {"label": "steps", "per_rank": {"1": {"skew_steps": True}}},  # a state of another step restored
        {"label": "agree", "steps": 2}],
    3: [{"label": "beta", "per_rank": {"2": {"beta": 0.25}}},
        {"label": "shapes", "per_rank": {"0": {"hidden": 65}}, "eager": True},
        {"label": "ratio", "per_rank": {"1": {"ratio": 0.1}, "2": {"index_exchange": "allreduce"}}},
        {"label": "agree", "steps": 2, "eager": True}],
}
EXPECTED_DIFFERENCE = {"ratio": {2: "ratio", 3: "index_exchange, ratio"},
                       "beta": {2: "beta", 3: "beta"},
                       "shapes": {2: "variable_digest", 3: "variable_digest"},
                       "prefix": {2: "collective_prefix"},
                       "steps": {2: "steps"}}


for size in [2, 3]:
    tf_run(f"tf_np{size}", f"tf_agreement_np{size}", {"cases": AGREEMENT_CASES[size]},
           ["test_ranks_that_disagree_all_get_one_clear_error"], worker="tf_agreement.py", timeout=600)


@pytest.mark.parametrize("size", [2, 3])
def test_ranks_that_disagree_all_get_one_clear_error(horovod_jobs, size):
    """Differing ratio, beta, index exchange, variable shapes or ScaleCom objects built before (a
    tf.function step and an eager one): every rank raises the same ValueError at the first step; agreeing ranks
    train on."""
    cases = AGREEMENT_CASES[size]
    results = horovod_jobs(f"tf_np{size}").completed(f"tf_agreement_np{size}")
    assert len(results) == size
    for case in cases[:-1]:
        label = case["label"]
        head = "ScaleCom is configured differently on different ranks"
        errors = [str(r[f"{label}/error"]) for r in results]
        assert all(head in e for e in errors), f"{label}: {errors}"
        # A tf.function step prefixes the traceback of the traced code ("in user code: ...").
        messages = {e[e.index(head):].strip() for e in errors}
        assert len(messages) == 1, f"{label}: ranks disagree about the error: {messages}"
        message = messages.pop()
        assert message.startswith(f"{head} ({EXPECTED_DIFFERENCE[label][size]} differ): rank 0: "), \
            message
        for rank, overrides in case["per_rank"].items():
            for key, value in overrides.items():
                if key not in ("hidden", "extra_scalecom", "skew_steps"):
                    assert f"rank {rank}: " in message and f"{key}={value!r}" in message, message
        if label == "shapes":
            assert "covers the number, order, shapes and dtypes" in message
        elif label == "prefix":  # (the ranks would otherwise wait for collectives of different names)
            assert "build the same ScaleCom objects, in the same order, on every rank" in message
            assert "variable_digest" not in message
        elif label == "steps":
            assert "rank 0: steps=[0]; rank 1: steps=[1]." in message and "from a state of the same step" in message
        else:
            assert "variable_digest" not in message
    # The agreeing case trains, and its updates are the reference's.
    assert all(str(r["agree/error"]) == "" for r in results)
    opts = {"ratio": 0.05, "beta": 0.5, "min_numel": 600}
    applied, _ = check_against_reference(results, opts, steps=2, label="agree/")
    assert density(applied[1], "hidden.weight") == pytest.approx(0.05, abs=0.002)


SKEWED_CASES = [{"label": exchange, "steps": 3, "eager": exchange == "allgather",
                 "per_rank": {"0": {"index_exchange": exchange},
                              "1": {"index_exchange": exchange, "skew_steps_at": 1}}}
                for exchange in ("allreduce", "allgather")]
tf_run("tf_np2", "tf_skewed_counters", {"cases": SKEWED_CASES},
       ["test_step_counters_that_part_mid_job_stop_every_rank_alike"], worker="tf_agreement.py")


def test_step_counters_that_part_mid_job_stop_every_rank_alike(horovod_jobs):
    """Rank 1 restores a state one step ahead at step 1, after the first step's comparison: no rank
    then leads step 1 (rank 0 takes rank 1 for its leader, rank 1 rank 0). The allreduce's count of
    leaders and the allgather's length show it, and every rank raises the same error (a broadcast
    from two roots is Horovod's own error)."""
    cases = SKEWED_CASES
    results = horovod_jobs("tf_np2").completed("tf_skewed_counters")
    for case in cases:
        errors = [str(r[f"{case['label']}/error"]) for r in results]
        found = [re.search(r"\[ScaleCom: the index exchange of (\S+) found this many leaders of the step, not "
                           r"one:\] \[(\d+)\] \[the step counters of the ranks differ \(restore every rank from "
                           r"a state of the same step\)\]", e) for e in errors]
        assert all(found), errors
        assert {f.groups() for f in found} == {(found[0][1], "0")}, errors
        assert all(f"{case['label']}/applied/1/hidden.weight" not in r for r in results)


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                       "tensorflow_scalecom.py")


def example_run(name, *extra, job="ex_tf_np2", fails=False):
    """A run of examples/tensorflow_scalecom.py in ``job``, writing ``<root>/tf_example/<name>.json``."""
    def arguments(root):
        folder = root / "tf_example"
        folder.mkdir(exist_ok=True)
        return ["--compression", "scalecom", "--ratio", "0.01", "--beta", "0.5", "--warmup-steps", "3",
                "--pipelined", "--result", str(folder / f"{name}.json"),
                *(str(folder / "ckpt") if e == "{ckpt}" else e for e in extra)]
    add_run(job, f"tf_example_{name}", EXAMPLE, arguments,
            ["test_example_checkpoint_resume_continues_identically"], fails=fails, timeout=600)


example_run("straight", "--epochs", "2")
example_run("first", "--epochs", "1", "--checkpoint", "{ckpt}")
example_run("resumed", "--epochs", "2", "--checkpoint", "{ckpt}", "--resume", job="ex_tf_np2_b")  # (new processes)
example_run("other", "--epochs", "3", "--checkpoint", "{ckpt}", "--resume", "--compression", "fp16",
            job="ex_tf_np2_b", fails=True)


def test_example_checkpoint_resume_continues_identically(horovod_jobs):
    """examples/tensorflow_scalecom.py: 2 epochs straight equal 1 epoch, --checkpoint, then --resume
    in new processes for the second (per-rank ScaleCom memories, model and optimizer restored, and,
    pipelined, the indices chosen for the first step after the checkpoint)."""
    job, resuming = horovod_jobs("ex_tf_np2"), horovod_jobs("ex_tf_np2_b")

    def result(job, name):
        job.completed(f"tf_example_{name}", 0)  # (the example writes no npz)
        with open(job.root / "tf_example" / f"{name}.json") as f:
            return json.load(f)

    straight = result(job, "straight")
    first = result(job, "first")
    assert sorted(os.listdir(job.root / "tf_example" / "ckpt")) == ["rank0", "rank1"]
    resumed = result(resuming, "resumed")
    output = resuming.output_of("tf_example_resumed")
    assert "after epoch 1" in output and first["epochs"] == 1 and resumed["epochs"] == 2
    # Dense reductions may be fused differently from run to run: sums may differ in the last bit.
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)
    assert resumed["weights_l2"] == pytest.approx(straight["weights_l2"], rel=1e-6)
    assert resumed["accuracy"] == straight["accuracy"]
    assert resumed["loss"] != pytest.approx(first["loss"], rel=1e-3)  # it did train on
    from devtools.launch import HorovodRunError  # another --compression would drop the memories
    assert isinstance(resuming.error, HorovodRunError)
    report = resuming.failure("tf_example_other")
    assert re.search("--compression fp16: the checkpoint in .* was trained with --compression scalecom; "
                     "resume with that", report), report[-3000:]


for poisoned, pipelined in [(0, False), (1, False), (0, True)]:
    tf_run("tf_np2", f"tf_nonfinite_{poisoned}_{pipelined}",
           {"steps": 6, "poison": {"rank": poisoned, "step": 3}, "skip_nonfinite": True, "pipelined": pipelined},
           ["test_nonfinite_gradient_skips_the_memory_update_on_every_rank"])


@pytest.mark.parametrize("poisoned, pipelined", [(0, False), (1, False), (0, True)])
def test_nonfinite_gradient_skips_the_memory_update_on_every_rank(horovod_jobs, poisoned, pipelined):
    """A rank gets a NaN input at step 3, so all its gradients are NaN: every rank's reduction of the
    compressed tensors is NaN, every rank skips their memory update (counted in stats()), the worker
    skips that step's update as a loss scaler would, and training then goes on exactly as the
    reference with those two memory updates skipped. Rank 1 leads step 3, and pipelined, rank 0
    selects step 4's indices in step 3: such a leader selects the top-k of its memory (top_k of
    |m + g| is not defined: the step's NaN made step 4's indices arbitrary)."""
    opts = {"steps": 6, "poison": {"rank": poisoned, "step": 3}, "skip_nonfinite": True, "pipelined": pipelined}
    results = horovod_jobs("tf_np2").completed(f"tf_nonfinite_{poisoned}_{pipelined}")
    for r in results:
        assert not np.isfinite(r["applied/3/hidden.weight"]).all()
        assert json.loads(str(r["stats"]))["nonfinite_skips"] == 2  # hidden.weight, out.weight
        for n in NAMES:
            assert np.isfinite(r[f"final/{n}"]).all()
    check_against_reference(results, opts, steps=6, skip={(3, "hidden.weight"), (3, "out.weight")})
    np.testing.assert_array_equal(results[0]["final/hidden.weight"], results[1]["final/hidden.weight"])


# -- the health check and the dense fallback (hvd_scalecom.health) --------------------------------
# Gradients made to order (tests/workers/tf_model.designed_batch): before step 4 each rank's largest
# entries are its own, so the leader's top-k carries 0.4-0.8 of the global top-k's energy (below
# min_captured = 0.9), from step 4 on every rank's are the same (1.0). With one warm-up step and a
# check every 2 steps: checks at 1 and 3 are low (dense from step 4), at 5 and 7 good (compressed
# again from step 8), at 9 good. After step 6 (mid-fallback) a new ScaleCom loads the state_dict().
HEALTH = {"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600, "mode": "function", "steps": 10,
          "designed": {"low_until": 4}, "record_stats": True, "reload_at": 6, "state_round_trip": True,
          "health": {"check_every": 2, "fallback": "dense", "min_captured": 0.9, "patience": 2}}
for ranks in (2, 3):
    tf_run(f"tf_np{ranks}", f"tf_health_np{ranks}", HEALTH,
           ["test_health_check_and_dense_fallback_match_reference"])

TF_NAMES = {n: n.replace(".", "_") for n in NAMES}  # the worker's tf.Variable names


@pytest.mark.parametrize("ranks", [2, 3])
def test_health_check_and_dense_fallback_match_reference(horovod_jobs, ranks):
    """compressed -> check -> fallback (dense) -> check -> compressed again, on 2 and 3 ranks: applied
    gradients, memories and stats()["health"] after every step as the reference's, the bytes of check
    and fallback steps, a state_dict() round trip mid-fallback, and the warning once on rank 0."""
    opts = HEALTH
    results = horovod_jobs(f"tf_np{ranks}").completed(f"tf_health_np{ranks}")
    log = []
    _, memories = check_against_reference(results, opts, steps=10, health_log=log)
    check_identical_weights(results)
    compressed = ["hidden.weight", "out.weight"]
    assert [(t, name, dense) for t, name, *_, dense in log] == [
        (t, name, dense) for t, dense in [(1, False), (3, True), (5, True), (7, False), (9, False)]
        for name in compressed]
    for rank, r in enumerate(results):
        np.testing.assert_allclose(r["memory/hidden.weight"], memories[rank]["hidden.weight"], rtol=1e-4, atol=1e-6)
        # the state saved mid-fallback (after step 5: dense, one good check)
        saved = json.loads(str(r["reloaded_state"]))
        assert {n: (e["dense"], e["good"], e["low"], e["checks"], e["dense_steps"]) for n, e in saved.items()} == \
            {TF_NAMES[n]: (True, 1, 0, 3, 2) for n in compressed}

    # stats()["health"] after every step: each tensor's latest check, as the reference's log
    for t in range(10):
        for rank, r in enumerate(results):
            health = json.loads(str(r[f"stats/{t}"]))["health"]
            latest = {name: entry for entry in log for name in [entry[1]] if entry[0] <= t}
            assert set(health["by_tensor"]) == {TF_NAMES[n] for n in latest}, (t, rank)
            for name, (step, _, hits, k, selected, topk, total, dense) in latest.items():
                got = health["by_tensor"][TF_NAMES[name]]
                assert (got["step"], got["dense"], got["checks"]) == \
                    (step, dense, sum(e[0] <= t and e[1] == name for e in log)), (t, rank, name)
                assert got["overlap"] == hits / k, (t, rank, name)
                assert got["captured"] == pytest.approx(selected / topk, rel=1e-5), (t, rank, name)
                assert got["selected_share"] == pytest.approx(selected / total, rel=1e-5)
                assert got["topk_share"] == pytest.approx(topk / total, rel=1e-5)
            assert health["dense_tensors"] == (2 if 3 <= t < 7 else 0)
            assert health["dense_steps"] == 2 * sum(4 <= s <= 7 for s in range(t + 1))  # fallback, dense checks
            assert health.get("captured") == (pytest.approx(
                sum(e[4] for e in latest.values()) / sum(e[5] for e in latest.values()), rel=1e-5) if latest else None)

    # bytes: a check sends p densely as its values (with the indices), a fallback step densely
    small, big, k, item = 4 * (64 + 10), 3072 + 640, 154 + 32, 4
    expected = {0: (0, 0, item * (big + k) + small)}  # warm-up (and the k placeholders)
    for t in range(1, 10):
        check = t % 2 == 1
        if 4 <= t <= 6 and not check:  # fallback
            expected[t] = (0, 0, item * big + small)
        else:
            expected[t] = (item * k, item * (big if check else k), small)
    for r in results:
        stats = {t: json.loads(str(r[f"stats/{t}"])) for t in range(10)}
        for t, (index, value, dense) in expected.items():
            assert (stats[t]["index_bytes"], stats[t]["value_bytes"], stats[t]["dense_bytes"]) == \
                (index, value, dense), t
        for last, steps in [(5, range(0, 6)), (9, range(6, 10))]:  # (totals restart at the reload)
            assert [stats[last]["total"][key] for key in ("index_bytes", "value_bytes", "dense_bytes")] == \
                [sum(expected[t][i] for t in steps) for i in range(3)], last

    # the warning: once, on rank 0, at the first stats() after the checks stayed low (step 3)
    for rank, r in enumerate(results):
        given = {t: list(r[f"warnings/{t}"]) for t in range(10) if len(r[f"warnings/{t}"])}
        if rank:
            assert given == {}
            continue
        assert list(given) == [3] and len(given[3]) == 1
        _, _, hits, k, selected, topk, _, _ = next(e for e in log if e[:2] == (3, "hidden.weight"))
        assert f"for 'hidden_weight' the leader's top-k carried {selected / topk:.2f}" in given[3][0]
        assert f"(overlap {hits / k:.2f}) at step 3" in given[3][0] and "sent densely" in given[3][0]


def test_the_graph_follows_the_health_monitors_rule_and_measures_as_torch():
    """tensorflow/health.py runs hvd_scalecom.health.next_streaks as graph ops (tf.where): over random
    sequences of checks it decides as HealthMonitor.record; its measures are torch's, bit for bit
    (the k-sums in ascending order), ties and fp16 included."""
    tf = pytest.importorskip("tensorflow")
    torch = pytest.importorskip("torch")
    from hvd_scalecom.health import HealthCheck, HealthMonitor, Measures, next_streaks
    from hvd_scalecom.tensorflow import health as tf_health
    from hvd_scalecom.torch.health import measure as torch_measure

    for fallback, patience in [("dense", 1), ("dense", 3), (None, 2)]:
        monitor = HealthMonitor(HealthCheck(check_every=1, fallback=fallback, patience=patience), ["w"], warn=False)
        rule = tf.function(lambda dense, low, good, is_low, p=patience, f=fallback: next_streaks(
            dense, low, good, is_low, p, f, tf_health._where))
        state = (tf.constant(False), tf.constant(0, tf.int64), tf.constant(0, tf.int64))
        for t, is_low in enumerate(np.random.default_rng(patience).random(60) < 0.5):
            before = monitor.state_dict()["w"]
            *state, stays_low = rule(*state, tf.constant(bool(is_low)))
            monitor.record("w", t, Measures(1, 1, 0.1 if is_low else 0.9, 1.0, 1.0))
            entry = monitor.state_dict()["w"]
            assert (bool(state[0]), int(state[1]), int(state[2])) == (entry["dense"], entry["low"], entry["good"])
            # (HealthMonitor warns where its checks stay low: patience low ones in a row while compressed)
            assert bool(stays_low) == (not before["dense"] and bool(is_low) and before["low"] + 1 >= patience)

    rng = np.random.default_rng(0)
    for numel, k, dtype in [(3000, 150, np.float32), (1000, 10, np.float16), (500, 25, np.float32)]:
        reduced = rng.standard_normal(numel).astype(dtype)
        if numel == 500:
            reduced = np.round(reduced)  # many ties at the k-th magnitude
        indices = rng.permutation(numel)[:k].astype(np.int32)
        got = [x.numpy() for x in tf_health.measure(tf.constant(reduced), tf.constant(indices), k, numel)]
        want = torch_measure(torch.from_numpy(reduced.astype(np.float32) if dtype == np.float16 else reduced)
                             .to(torch.float16 if dtype == np.float16 else torch.float32), torch.from_numpy(indices), k)
        assert (int(got[0]), float(got[1]), float(got[2])) == (want.hits, want.selected, want.topk)
        assert float(got[3]) == pytest.approx(want.total, rel=1e-12)


def test_the_health_state_saves_restores_and_is_checked_first(tf_modules):
    """state_dict() holds "health" with check_every only (stats() too); load_state_dict checks it before
    changing anything, and a state without one starts the checks afresh."""
    tf, ScaleCom = tf_modules
    variables = [tf.Variable(tf.zeros([40, 30]), name="w"), tf.Variable(tf.zeros([5]), name="b")]
    plain = ScaleCom(variables, min_numel=100)
    assert "health" not in plain.state_dict() and "health" not in plain.stats()
    checked = ScaleCom(variables, min_numel=100, check_every=4, fallback="dense")
    state = checked.state_dict()
    fresh = {"step": None, "measures": None, "low": 0, "good": 0, "dense": False, "checks": 0, "dense_steps": 0}
    assert state["health"] == {"w": fresh}  # (the compressed variables)
    assert checked.stats()["health"] == {"checks": 0, "dense_steps": 0, "dense_tensors": 0, "by_tensor": {}}
    measures = {"hits": 7, "k": 12, "selected": 1.0, "topk": 2.0, "total": 4.0}
    mid_fallback = {"w": {**fresh, "step": 9, "measures": measures, "good": 1, "dense": True, "checks": 4,
                          "dense_steps": 3}}
    for bad, words in [({"x": fresh}, "an entry for each of \\['w'\\]"),
                       ({"w": {**fresh, "dense": 1}}, "'w' is malformed: dense must be a bool"),
                       ({"w": {**fresh, "low": -1}}, "'w' is malformed")]:
        with pytest.raises(ValueError, match=words):
            checked.load_state_dict({**state, "health": bad,
                                     "params": {n: {**e, "step": 10} for n, e in state["params"].items()}})
        assert [int(s.numpy()) for s in checked.steps] == [0, 0]  # nothing changed
    checked.load_state_dict({**state, "health": mid_fallback})
    assert checked.state_dict()["health"] == mid_fallback
    summary = checked.stats()["health"]
    assert (summary["dense_tensors"], summary["checks"], summary["dense_steps"]) == (1, 4, 3)
    assert summary["by_tensor"]["w"] == {"step": 9, "overlap": 7 / 12, "captured": 0.5, "selected_share": 0.25,
                                         "topk_share": 0.5, "dense": True, "checks": 4}
    checked.load_state_dict(plain.state_dict())  # (no "health": fresh)
    assert checked.state_dict()["health"] == {"w": fresh}


def test_a_checkpoint_carries_the_fallback_and_eager_steps_follow_it():
    """One rank, eager compress/decompress: a state loaded mid-fallback sends the variable densely (a
    check while dense returns it to compressed steps with patience=1); tf.train.Checkpoint saves the
    health state with the steps and restores it."""
    code = ("import json, numpy as np, tensorflow as tf, horovod.tensorflow as hvd\n"
            "from hvd_scalecom.tensorflow import ScaleCom\n"
            "hvd.init()\n"
            "compression = ScaleCom([tf.Variable(tf.zeros([2000]), name='w')], ratio=0.05, min_numel=100,\n"
            "                       warmup_steps=1, check_every=3, fallback='dense', patience=1)\n"
            "state = compression.state_dict()\n"
            "state['health']['w'].update(dense=True, good=0)\n"
            "state['params']['w']['step'] = 2  # (checks at steps 1, 4, 7)\n"
            "compression.load_state_dict(state)\n"
            "checkpoint = tf.train.Checkpoint(compression=compression)\n"
            "path = checkpoint.write(__import__('tempfile').mkdtemp() + '/ckpt')\n"
            "density = []\n"
            "for t in range(2, 8):\n"
            "    grad = tf.constant(np.random.default_rng(t).standard_normal(2000), tf.float32)\n"
            "    out = compression.decompress(*compression.compress(grad))\n"
            "    density.append(round(float(np.count_nonzero(out.numpy())) / 2000, 3))\n"
            "health = compression.stats()['health']\n"
            "print('RUN', density, health['dense_steps'], health['dense_tensors'], health['checks'])\n"
            "checkpoint.read(path).assert_consumed()\n"
            "health = compression.stats()['health']\n"
            "print('RESTORED', health['dense_steps'], health['dense_tensors'], health['checks'],\n"
            "      [int(s) for s in compression.steps])\n")
    # steps 2, 3 fallback (dense); 4 a check while dense (dense), good: compressed from 5; 7 a check
    assert one_rank(code, "RUN ", "RESTORED ") == ["RUN [1.0, 1.0, 1.0, 0.05, 0.05, 0.05] 3 0 2",
                                                   "RESTORED 0 1 0 [2]"]
