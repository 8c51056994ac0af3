"""Bad input to the PyTorch ScaleCom that needs a model or a Horovod job; the constructor's arguments
and load_state_dict are in the table of tests/test_bad_input_table.py."""

import re

import pytest
import torch
from jobs import add_run, define_job

from hvd_scalecom.torch import ScaleCom


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))


# A run that must fail ends its job: it goes last in a job of passing runs with the same set-up
# (tests/jobs.py) or, where none is left, in a job of its own. Each of these fails while a collective is,
# or may be, in flight on some rank (a wait that times out, a stall shutdown, Horovod's join, a rank
# that raises alone), so no later run could share its processes. An error every rank raises with
# nothing in flight is a run with raises= instead (the disagreeing configurations below).
def failing_run(part, opts, tests, np=2, job=None, env=None):
    """A run of ``torch_scalecom.py`` that must fail: last in ``job``, or alone in a job ``bad_<part>``."""
    if job is None:
        job = f"bad_{part}"
        define_job(job, np, env=env)
    add_run(job, part, "torch_scalecom.py", opts, tests, fails=True, timeout=120)
    FAILING[part] = job


FAILING = {}  # part: its job


def failed_job(horovod_jobs, part):
    """The report of run ``part``, which must end with an error of its own, not a time limit."""
    from devtools.launch import HorovodRunError
    job = horovod_jobs(FAILING[part])
    assert isinstance(job.error, HorovodRunError), f"run {part} did not fail"
    report = job.failure(part)
    assert "timed out" not in report.split("\n", 1)[0], report[:2000]
    assert "Timeout (0:" not in report, report[-4000:]  # (a run's own time limit, tests/workers/sequence.py)
    return report


def section(report, rank):
    """What rank ``rank`` printed, from a failed job's report."""
    return report.split(f"----- rank {rank} -----", 1)[1].split("----- rank ", 1)[0]


def test_accepts_torch_dtypes_and_names():
    a = ScaleCom(model().named_parameters(), value_dtype=torch.float16, index_dtype=torch.int64)
    b = ScaleCom(model().named_parameters(), value_dtype="float16", index_dtype="int64")
    assert a.config == b.config and a.config.value_dtype == "float16"


def test_numpy_numbers_are_taken_as_numbers():
    import numpy as np
    assert ScaleCom(model().named_parameters(), timeout=np.float32(5)).timeout == 5.0
    compression = ScaleCom(model().named_parameters(), min_numel=16)
    state = compression.state_dict()
    for entry in state["params"].values():
        entry["memory"], entry["scale"] = None, np.float32(8)  # (a memory saved without one: 1)
    compression.load_state_dict(state)
    assert all(type(e["scale"]) is float and e["scale"] == 8.0 for e in compression.state_dict()["params"].values())


def test_tensor_that_is_no_parameters_gradient():
    net = model()
    compression = ScaleCom(net.named_parameters())
    with pytest.raises(ValueError, match="not the gradient of any parameter in named_parameters"):
        compression.compress(torch.zeros(30, 40))


def test_densified_sparse_gradients_of_one_shape_and_equal_values_are_refused_naming_both():
    """With sparse_as_dense=True Horovod hands compress ``p.grad.to_dense()``, not ``p.grad``: two
    embeddings summed on the same indices have equal gradients, and which memory goes with which
    cannot be known."""
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"a": torch.nn.Embedding(50, 40, sparse=True),
                               "b": torch.nn.Embedding(50, 40, sparse=True)})
    compression = ScaleCom(net.named_parameters(), min_numel=16)
    idx = torch.tensor([1, 7, 7, 30])
    (net["a"](idx) + net["b"](idx)).pow(2).sum().backward()
    with pytest.raises(ValueError, match=re.escape("cannot tell which of ['a.weight', 'b.weight']")):
        compression.compress(net["a"].weight.grad.to_dense())


def test_a_parameter_handed_over_names_adasum():
    net = model()
    compression = ScaleCom(net.named_parameters())
    with pytest.raises(ValueError, match="handed a parameter, not its gradient.*op=hvd.Adasum"):
        compression.compress(next(net.parameters()))


failing_run("adasum", {"op": "adasum", "steps": 1}, ["test_adasum_is_a_clear_error"], job="torch_np2")


def test_adasum_is_a_clear_error(horovod_jobs):
    report = failed_job(horovod_jobs, "adasum")
    assert all("handed a parameter, not its gradient: hvd.DistributedOptimizer was built with op=hvd.Adasum"
               in section(report, rank) for rank in (0, 1))  # ScaleCom's own error, on every rank


failing_run("join", {"steps": 3, "join": True, "per_rank": {"0": {"steps": 1}}},
            ["test_hvd_join_ends_with_horovod_s_error_not_a_hang"])


def test_hvd_join_ends_with_horovod_s_error_not_a_hang(horovod_jobs):
    """Rank 0 joins after one step while rank 1 takes two more: Horovod 0.28.1 refuses the allgather of
    ScaleCom's indices once a rank has joined, and the job ends on both ranks."""
    rank1 = section(failed_job(horovod_jobs, "join"), 1)
    assert "Allgather is not supported with Join" in rank1, rank1[-2000:]


failing_run("optimizer_process_set", {"steps": 2, "process_set": [0, 2], "process_set_for_optimizer_only": True},
            ["test_a_process_set_given_to_the_optimizer_alone_ends_with_a_clear_error"], np=3,
            env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "3", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "8"})


def test_a_process_set_given_to_the_optimizer_alone_ends_with_a_clear_error(horovod_jobs):
    """Rank 1, outside the optimizer's process set, never reduces: ScaleCom's comparison over all
    ranks waits for it, warning at Horovod's stall check interval and raising at its shutdown time."""
    report = failed_job(horovod_jobs, "optimizer_process_set")
    sections = [section(report, rank) for rank in (0, 2)]
    for printed in sections:
        # (the seconds as waited, rounded: a loaded machine can print 4)
        assert re.search(r"ScaleCom warning: still waiting after \d+ s for every rank's ScaleCom configuration",
                         printed), printed[-2000:]
        assert "pass it the optimizer's process_set" in printed
        # (a rank may learn of the first error from Horovod's shutdown, the same 8 s later)
        assert "RuntimeError: ScaleCom: still waiting after 8 s" in printed or \
            "Horovod has been shut down" in printed
    assert any("RuntimeError: ScaleCom: still waiting after 8 s" in printed for printed in sections)


DISAGREEING = [
    (2, {"1": {"ratio": 0.02}}, "ratio"),
    (3, {"1": {"ratio": 0.02}}, "ratio"),
    (3, {"2": {"leader": "staggered"}}, "leader"),
    (3, {"0": {"min_numel": 100}, "2": {"beta": 0.25}}, "beta, min_numel"),
    (3, {"1": {"drop_last_param": True}}, "parameter_digest, parameters"),
    (2, {"1": {"skew_steps_at": 0}}, "steps"),  # a state of another step, loaded before the first
    # a model cast on one rank only: Horovod's "Mismatched data types" named no tensor (or, with a
    # value_dtype every rank sends, the ranks trained on in different precisions)
    (2, {"0": {"skip_broadcast": True}, "1": {"skip_broadcast": True, "dtype": "float64"}}, "parameter_dtypes"),
    # a loss_scaler given to one rank's ScaleCom only: its memory did not follow the scale (silently)
    (2, {"0": {"loss_scale_schedule": {"0": 1, "1": 1024}},
         "1": {"loss_scale_schedule": {"0": 1, "1": 1024}, "no_loss_scaler": True}}, "loss_scaler"),
]
# ScaleCom compares the ranks' configurations at the first compress, through blocking allgathers, before
# Horovod's DistributedOptimizer submits any reduction (it calls compress before allreduce_async_): every
# rank raises the same ValueError with no collective in flight, so each case is a run that raises and
# the job goes on to its next run (tests/jobs.py), in the shared jobs torch_np2 and torch_np3.
DISAGREEMENT = "ValueError: ScaleCom is configured differently on different ranks ("
for i, (size, per_rank, _) in enumerate(DISAGREEING):
    add_run(f"torch_np{size}", f"disagreeing_{i}", "torch_scalecom.py", {"steps": 2, "per_rank": per_rank},
            ["test_ranks_that_disagree_all_get_one_clear_error"], timeout=120, raises=DISAGREEMENT)


@pytest.mark.parametrize("case", range(len(DISAGREEING)))
def test_ranks_that_disagree_all_get_one_clear_error(horovod_jobs, case):
    size, per_rank, differing = DISAGREEING[case]
    job = horovod_jobs(f"torch_np{size}")
    printed = job.raised(f"disagreeing_{case}")
    for rank in range(size):
        assert f"{DISAGREEMENT}{differing} differ" in printed[rank], printed[rank][-2000:]
    errors = {(job.root / f"disagreeing_{case}" / f"raised.rank{rank}").read_text() for rank in range(size)}
    assert len(errors) == 1, errors  # one error, word for word, on every rank


for size in [2, 3]:
    failing_run(f"skewed_counters_np{size}", {"steps": 3, "per_rank": {"1": {"skew_steps_at": 1}}},
                ["test_step_counters_that_part_after_the_first_step_stop_every_rank_with_one_error"], np=size)


@pytest.mark.parametrize("size", [2, 3])
def test_step_counters_that_part_after_the_first_step_stop_every_rank_with_one_error(horovod_jobs, size):
    """Rank 1 loads a state one step ahead after step 0 (past the configuration check): no rank then
    leads step 1's first compressed tensor in the others' eyes, the index allgather delivers no
    indices, and every rank raises the same ValueError (before, each trained on with zero updates,
    and ranks whose counters made two leaders applied different indices, silently)."""
    report = failed_job(horovod_jobs, f"skewed_counters_np{size}")
    for rank in range(size):
        printed = section(report, rank)
        assert re.search(r"ValueError: ScaleCom: the index exchange of '[\w.]+' delivered 0 indices, not k = \d+: "
                         r"the ranks disagree on this step's leader", printed), printed[-2000:]


failing_run("next_indices_skewed", {"steps": 4, "pipelined": True, "per_rank": {"1": {"skew_next_indices_at": 2}}},
            ["test_pipelined_indices_saved_for_another_step_are_refused_at_the_load"])


def test_pipelined_indices_saved_for_another_step_are_refused_at_the_load(horovod_jobs):
    """Rank 1 loads a state whose next_indices are for the step after its counters' step. It used to
    exchange fresh indices for that step while rank 0 used the ones chosen ahead: rank 1 waited for
    indices that never came, warning about frozen parameters and warm-up (a hang without a timeout).
    The load refuses the state, naming the parameter and both steps, before it changes anything."""
    report = failed_job(horovod_jobs, "next_indices_skewed")
    rank1 = section(report, 1)
    assert "ValueError: state next_indices of 'hidden.weight' are for step 3, but its step counter is 2" in rank1, \
        rank1[-2000:]
    assert "still waiting" not in report


failing_run("next_indices_dropped",
            {"steps": 4, "pipelined": True, "timeout": 8, "per_rank": {"1": {"drop_next_indices_at": 2}}},
            ["test_pipelined_indices_restored_on_some_ranks_only_end_with_the_timeout_s_error_naming_them"])


def test_pipelined_indices_restored_on_some_ranks_only_end_with_the_timeout_s_error_naming_them(horovod_jobs):
    """Rank 1 restores its state without next_indices at step 2 (a state is valid without them: one
    saved before the first compressed step, or after a resync): it exchanges fresh indices while rank 0
    uses those chosen ahead, which no check between ranks can see. Without a timeout both wait for
    good; with one, rank 1's error names this cause, where it named only frozen parameters, hook orders,
    stopped ranks and warm-up."""
    rank1 = section(failed_job(horovod_jobs, "next_indices_dropped"), 1)
    assert "still waiting after 8 s for the leader's indices for 'out.weight'" in rank1, rank1[-2000:]
    assert "the ranks restored states of which only some held this parameter's next_indices" in rank1, rank1[-2000:]


failing_run("warm_up_end_skewed",
            {"steps": 5, "warmup_steps": 3, "timeout": 8, "per_rank": {"0": {"skew_steps_at": 2}}},
            ["test_step_counters_on_either_side_of_warm_up_s_end_end_with_the_timeout_s_error"])


def test_step_counters_on_either_side_of_warm_up_s_end_end_with_the_timeout_s_error(horovod_jobs):
    """Rank 0 loads a state one step ahead at step 2 of a 3-step warm-up: it waits for the indices of
    step 3 while rank 1 reduces step 2 densely. Without a timeout both would wait for good (as the
    README says); with one, rank 0 raises naming warm-up, and the job ends."""
    rank0 = section(failed_job(horovod_jobs, "warm_up_end_skewed"), 0)
    assert "still waiting after 8 s for the leader's indices" in rank0 and "still in warm-up" in rank0, rank0[-2000:]


def one_rank_scalecom(numel, dtype=torch.float32, **kwargs):
    """A parameter and its ScaleCom in this process, Horovod started with one rank (the leader)."""
    import horovod.torch as hvd
    hvd.init()
    param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    return param, ScaleCom([("w", param)], ratio=0.01, min_numel=16, **kwargs)


def test_stats_refuses_a_step_no_longer_kept_only_where_one_is_asked_for():
    """After a rollback (load_state_dict of an earlier state) the default step, the last complete
    one, may lie before the steps kept: stats() then gives its zeros; stats(step=) of it raises."""
    param, compression = one_rank_scalecom(4096)
    for t in range(10):
        param.grad = torch.randn(4096)
        values, ctx = compression.compress(param.grad)
        compression.decompress(values, ctx)
        if t == 2:
            state = compression.state_dict()
    assert compression.stats(step=9)["value_bytes"] == 4 * 41
    compression.load_state_dict(state)
    assert (compression.stats()["step"], compression.stats()["value_bytes"]) == (2, 0)
    with pytest.raises(ValueError, match=r"step 2 is not kept: the statistics keep the last 5 steps \(5\.\.9\)"):
        compression.stats(step=2)


class FixedScale:
    """A loss scaler of a fixed scale (torch.amp.GradScaler's get_scale())."""

    def __init__(self, scale):
        self.scale = scale

    def get_scale(self):
        return self.scale


def test_a_state_loads_with_or_without_a_loss_scaler_in_the_units_it_is_used_in():
    """With a loss_scaler the memory is kept in the units of the current scale, without one unscaled:
    a state saved with one (scale 2**16) and loaded without one is divided by its scale, and one saved
    without a scaler and loaded with one is multiplied by the scale at the next step. Loaded into a
    ScaleCom like its own it is unchanged."""
    scale = 2.0 ** 16
    param, scaled = one_rank_scalecom(4096, loss_scaler=FixedScale(scale))
    other = torch.nn.Parameter(torch.zeros(4096))
    unscaled = ScaleCom([("w", other)], ratio=0.01, min_numel=16)

    def step(compression, p, grad):
        p.grad = grad
        return compression.decompress(*compression.compress(p.grad))

    grads = [torch.randn(4096, generator=torch.Generator().manual_seed(t)) for t in range(3)]
    for g in grads[:2]:
        step(scaled, param, g * scale)
        step(unscaled, other, g.clone())
    saved_scaled, saved_unscaled = scaled.state_dict(), unscaled.state_dict()
    memory = saved_unscaled["params"]["w"]["memory"]
    assert saved_scaled["params"]["w"]["scale"] == scale and saved_unscaled["params"]["w"]["scale"] is None
    torch.testing.assert_close(saved_scaled["params"]["w"]["memory"], memory * scale)  # (scale a power of 2)
    unscaled.load_state_dict(saved_scaled)
    assert torch.equal(unscaled.state_dict()["params"]["w"]["memory"], saved_scaled["params"]["w"]["memory"] / scale)
    assert unscaled.state_dict()["params"]["w"]["scale"] is None
    scaled.load_state_dict(saved_unscaled)
    assert scaled.state_dict()["params"]["w"]["scale"] == 1.0
    out_scaled = step(scaled, param, grads[2] * scale)
    out_unscaled = step(unscaled, other, grads[2].clone())
    torch.testing.assert_close(out_scaled, out_unscaled * scale)
    torch.testing.assert_close(scaled.state_dict()["params"]["w"]["memory"],
                               unscaled.state_dict()["params"]["w"]["memory"] * scale)
    scaled.load_state_dict(saved_scaled)
    assert torch.equal(scaled.state_dict()["params"]["w"]["memory"], saved_scaled["params"]["w"]["memory"])


def test_a_parameter_that_changed_size_is_refused_before_anything_changes():
    """Its memory no longer fits the gradient (the C passes would read past one of them)."""
    param, compression = one_rank_scalecom(4096)
    param.grad = torch.randn(4096)
    values, ctx = compression.compress(param.grad)
    compression.decompress(values, ctx)
    before = compression.state_dict()["params"]["w"]
    param.data = torch.zeros(8192)
    param.grad = torch.randn(8192)
    with pytest.raises(ValueError, match="'w' has 8192 entries, its residue memory 4096"):
        compression.compress(param.grad)
    after = compression.state_dict()["params"]["w"]
    assert after["step"] == before["step"] == 1 and torch.equal(after["memory"], before["memory"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # the C passes, torch operations
def test_gradients_that_require_grad_leave_no_graph_in_the_memory(dtype):
    """backward(create_graph=True) gives gradients that require grad: the residue memory must not
    chain one step's graph to the next (it would grow without bound)."""
    param, compression = one_rank_scalecom(4096, dtype)
    x = torch.randn(4096, dtype=dtype)
    for _ in range(3):
        param.grad = None
        (param * param * x + param * x).sum().backward(create_graph=True)
        assert param.grad.requires_grad
        values, ctx = compression.compress(param.grad)
        out = compression.decompress(values, ctx)
        memory = compression._slots[0].memory
        assert memory.grad_fn is None and not memory.requires_grad and out.grad_fn is None
    assert compression.state_dict()["params"]["w"]["step"] == 3


def posing_as_a_non_leader(compression, numel):
    """``compression`` behaving as rank 1 of a large job (never the leader), handed ascending indices
    as a leader's broadcast would bring them: the non-leader's own paths, in this process."""
    k = compression.config.num_selected(numel)
    compression._size_rank = lambda: (10**6, 10**6 - 1)
    compression._post_receives = lambda t, rank, size: None
    compression._wait = lambda slot, t, rank, size: torch.randperm(
        numel, generator=torch.Generator().manual_seed(t))[:k].sort().values.to(torch.int32)


@pytest.mark.parametrize("numel, non_leader", [(4096, False), (4096, True), ((1 << 19) + 5, True)])
def test_a_gradient_changed_in_place_before_synchronize_is_an_error_on_every_path(numel, non_leader):
    """Between compress (the gradient's hook) and decompress (synchronize()) a gradient is in flight:
    from 2**19 entries a non-leader has written its new memory over it. A change then (e.g. clipping
    before synchronize()) is refused on every path alike, the memory left as it was."""
    param, compression = one_rank_scalecom(numel)
    if non_leader:
        posing_as_a_non_leader(compression, numel)
    param.grad = torch.randn(numel)
    values, ctx = compression.compress(param.grad)
    compression.decompress(values, ctx)  # unchanged in between: fine
    memory = compression._slots[0].memory.clone()
    param.grad = torch.randn(numel)
    values, ctx = compression.compress(param.grad)
    if numel > (1 << 19):  # (the path that writes the new memory over the gradient)
        assert ctx.traded, "the large non-leader case did not take the buffer-trading path"
    torch.nn.utils.clip_grad_norm_([param], 1e-3)
    with pytest.raises(RuntimeError, match="gradient of 'w' was changed in place between backward"):
        compression.decompress(values, ctx)
    assert torch.equal(compression._slots[0].memory, memory)


def test_gradients_that_are_views_of_one_buffer_are_not_taken_for_changed():
    """Views of a shared gradient buffer share its version counter: another parameter's accumulation
    between one's hook and synchronize() moves it without changing that gradient."""
    import horovod.torch as hvd
    hvd.init()
    a, b = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4096))
    compression = ScaleCom([("a", a), ("b", b)], ratio=0.01, min_numel=16)
    flat = torch.randn(8192)
    a.grad, b.grad = flat[:4096], flat[4096:]
    values, ctx = compression.compress(a.grad)
    b.grad.add_(1.0)  # (b's backward accumulating into its view)
    out = compression.decompress(values, ctx)
    assert torch.count_nonzero(out) == compression.config.num_selected(4096)


def test_pipelined_index_bytes_count_both_exchanges_of_a_fresh_step_also_after_resync():
    """Pipelined, a step shares the next one's indices; the first step, and the first after resync()
    (an elastic world change forgets what was shared), also exchanges its own: two broadcasts."""
    param, compression = one_rank_scalecom(4096, pipelined=True)
    k = compression.config.num_selected(4096)

    def step():
        param.grad = torch.randn(4096)
        param.grad.set_(compression.decompress(*compression.compress(param.grad)))

    for _ in range(2):
        step()
    compression.resync()
    step()
    assert [compression.stats(t)["index_bytes"] for t in range(3)] == [8 * k, 4 * k, 8 * k]
    assert compression.stats()["total"]["index_bytes"] == 20 * k


@pytest.mark.parametrize("numel", [4096, (1 << 19) + 5])  # in place, and the buffers traded
def test_a_second_reduction_of_the_same_step_is_refused(numel):
    """optimizer.step() after optimizer.synchronize() without skip_synchronize() makes Horovod reduce
    every gradient again: ScaleCom refuses the gradient it gave back (it would count another step),
    and accepts the next step's, a new tensor or the same one zeroed and accumulated into."""
    param, compression = one_rank_scalecom(numel)
    param.grad = torch.randn(numel)
    param.grad.set_(compression.decompress(*compression.compress(param.grad)))
    with pytest.raises(RuntimeError, match="reducing it a second time.*skip_synchronize"):
        compression.compress(param.grad)
    assert compression.state_dict()["params"]["w"]["step"] == 1
    param.grad.zero_()  # zero_grad(set_to_none=False), then backward accumulating into it
    param.grad.add_(torch.randn(numel))
    param.grad.set_(compression.decompress(*compression.compress(param.grad)))
    param.grad = torch.randn(numel)  # zero_grad() (to None), then backward
    param.grad.set_(compression.decompress(*compression.compress(param.grad)))
    assert compression.state_dict()["params"]["w"]["step"] == 3
