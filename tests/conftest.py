"""Shared fixtures: every multi-process test starts Horovod through ``devtools.launch.run``, most
of them through the shared jobs of tests/jobs.py (the ``horovod_jobs`` fixture).

Tiers: a test that starts processes (horovodrun, or Python in a subprocess) is marked ``multiprocess``
(here, from the fixtures it uses, or by its module); ``pytest -m "not multiprocess"`` (``make
test-fast``) runs the others in a few minutes, ``make test`` runs both tiers side by side.
``HVD_SCALECOM_LAUNCH_LOG=<file>`` logs every ``horovodrun`` started (tests/launch_log)."""

import json
import os
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # tests/reference.py, tests/jobs.py
sys.path.insert(1, os.path.dirname(HERE))  # devtools (the repository's tools, not installed)
os.environ.setdefault("OMP_NUM_THREADS", "1")
if os.environ.get("HVD_SCALECOM_LAUNCH_LOG"):  # this process and every one it starts log their launches
    LAUNCH_LOG = os.path.join(HERE, "launch_log")
    os.environ["PYTHONPATH"] = os.pathsep.join([LAUNCH_LOG, *filter(None, [os.environ.get("PYTHONPATH")])])
    sys.path.insert(0, LAUNCH_LOG)
    import sitecustomize  # noqa: F401  (this process started before the folder was on its path)

# The fixtures that start horovodrun jobs, and the tests that start processes themselves (horovodrun,
# a benchmark's or an example's command, Python in a subprocess): a test added that starts processes
# without these fixtures belongs in this table.
MULTIPROCESS_FIXTURES = {"horovod_job", "horovod_jobs", "straight_run"}
# Modules whose tests (all, or all but a few quick ones) start processes: marked whole.
MULTIPROCESS_MODULES = {"test_ddp.py", "test_benchmarks_ddp_smoke.py", "test_benchmarks_links_smoke.py",
                        "test_benchmarks_scale_smoke.py"}
MULTIPROCESS_TESTS = {
    "test_benchmarks_convergence_smoke.py": {"test_convergence_smoke"},
    "test_benchmarks_perf_smoke.py": {
        "test_slow_link_smoke", "test_a_slow_link_job_past_its_timeout_is_reported_and_leaves_nothing_running",
        "test_a_smoke_run_that_writes_nothing_leaves_no_directory", "test_gpu_kernels_smoke_on_the_cpu",
        "test_overhead_smoke"},
    "test_benchmarks_smoke.py": {"test_scalecom_options_smoke", "test_frontends_smoke", "test_tf_index_exchange_smoke"},
    "test_benchmarks_soak_smoke.py": {"test_soak_smoke", "test_soak_smoke_tensorflow",
                                      "test_soak_rejects_bad_arguments",
                                      "test_run_all_list"},
    "test_examples.py": {
        "test_resume_from_checkpoint_matches_an_uninterrupted_run",
        "test_resume_with_other_optimizer_arguments_is_refused",
        "test_progress_bar_on_rank_0", "test_shards_of_different_sizes_take_the_same_steps",
        "test_bad_example_arguments_are_named",
        "test_the_demo_explains_its_arguments_and_refuses_compression_and_outputs"},
    "test_native.py": {
        "test_the_kernels_outputs_are_fp32_whatever_the_default_dtype", "test_disabled_by_the_environment_variable",
        "test_processes_building_at_once_into_an_empty_cache_all_load_one_library",
        "test_a_missing_compiler_warns_and_falls_back_to_torch_operations"},
    "test_tensorflow_scalecom.py": {
        "test_huge_finite_gradients_are_sent_not_taken_for_non_finite",
        "test_an_embedding_gradient_densified_outside_tf_function_is_matched_to_its_variable",
        "test_a_checkpoint_restore_rolls_the_statistics_back_with_the_steps",
        "test_a_checkpoint_restores_only_into_a_scalecom_built_alike",
        "test_a_keras_model_with_the_distributed_optimizer_saves_and_loads_as_documented",
        "test_stats_refuses_bad_steps_as_pytorch_does", "test_make_train_step_scales_the_loss_as_keras_train_step_does",
        "test_a_gradient_that_bypasses_compress_is_an_error_at_the_next_step",
        "test_an_eager_step_refused_part_way_is_refused_until_a_restore",
        "test_example_checkpoint_resume_continues_identically"},
    "test_timeline_launch.py": {"test_a_failed_job_of_path_arguments_reports_its_ranks",
                                "test_a_timed_out_job_leaves_no_worker_running"},
    "test_torch_elastic.py": {"test_the_handler_is_registered_without_importing_the_elastic_module",
                              "test_join_leave_failure_and_join_again"},
}


# Modules whose jobs measure shaped network links (their rates are asserted): they run last, so that under
# `make test` the tests beside them (the other tier, in a process of its own) have finished by then.
LINK_MODULES = ("test_benchmarks_links_smoke.py", "test_benchmarks_perf_smoke.py", "test_benchmarks_ddp_smoke.py")

# `make test` runs the multi-process tests in streams (``--stream``), each its own pytest process: "torch"
# and "rest" side by side, then "links" (the tests of LINK_MODULES that time shaped links) alone. A
# shared job of tests/jobs.py runs once per process, so every test that reads one is in the same stream:
# "torch" holds the modules of the PyTorch jobs (and test_horovod_smoke's PyTorch cases), "rest" the
# TensorFlow jobs, the examples' jobs and the benchmarks' smoke tests.
TORCH_STREAM = {"test_ddp.py", "test_native.py", "test_sim_horovod.py", "test_timeline_launch.py",
                "test_torch_bad_input.py", "test_torch_elastic.py", "test_torch_health.py", "test_torch_qsparse.py",
                "test_torch_scalecom.py", "test_torch_scalecom_nohang.py", "test_torch_sketched_sgd.py",
                # (no shared jobs: here for the streams' balance)
                "test_benchmarks_convergence_smoke.py", "test_benchmarks_scale_smoke.py"}
# The tests of LINK_MODULES that time no shaped link: they need no quiet machine (the torch stream).
UNTIMED_LINK_MODULE_TESTS = {"test_overhead_smoke", "test_gpu_kernels_smoke_on_the_cpu"}
STREAMS = ("torch", "rest", "links")


def pytest_addoption(parser):
    parser.addoption("--stream", choices=STREAMS, default=None,
                     help="only the tests of one stream (tests/conftest.py); default: every test")


def stream_of(item):
    name = item.path.name
    if name in LINK_MODULES and getattr(item, "originalname", item.name) not in UNTIMED_LINK_MODULE_TESTS:
        return "links"
    if name in TORCH_STREAM or name in LINK_MODULES or \
            name == "test_horovod_smoke.py" and item.callspec.params["framework"] == "torch":
        return "torch"
    return "rest"


def pytest_collection_modifyitems(config, items):
    stream = config.getoption("stream")
    if stream is not None:
        kept = [item for item in items if stream_of(item) == stream]
        config.hook.pytest_deselected(items=[item for item in items if stream_of(item) != stream])
        items[:] = kept
    items.sort(key=lambda item: item.path.name in LINK_MODULES)  # (stable: the order is kept otherwise)
    for item in items:
        name = getattr(item, "originalname", item.name)
        if MULTIPROCESS_FIXTURES & set(getattr(item, "fixturenames", ())) or \
                name in MULTIPROCESS_TESTS.get(item.path.name, ()) or item.path.name in MULTIPROCESS_MODULES:
            item.add_marker(pytest.mark.multiprocess)


@pytest.fixture
def horovod_jobs(request, tmp_path_factory):
    """``horovod_jobs(name)``: the :class:`jobs.JobResult` of the shared job ``name`` (run at its first use
    in the session, with the runs of every selected test that reads it)."""
    import jobs

    return lambda name: jobs.run_job(name, request, tmp_path_factory)


@pytest.fixture
def horovod_job(tmp_path):
    """``horovod_job(worker, opts, np=2, controller="gloo", env=None)`` runs ``tests/workers/<worker>``
    under horovodrun and returns ``(per-rank npz dicts, output)``."""
    from devtools.launch import run

    def launch(worker, opts=None, np=2, controller="gloo", env=None, timeout=300, out_dir=None):
        out_dir = str(out_dir or tmp_path)
        os.makedirs(out_dir, exist_ok=True)
        script = os.path.join(HERE, "workers", worker)
        output = run([script, json.dumps(opts or {}), out_dir], np=np, controller=controller,
                     env=env, timeout=timeout)
        results = []
        for rank in range(np):
            path = os.path.join(out_dir, f"rank{rank}.npz")
            if os.path.exists(path):
                with numpy_load(path) as data:
                    results.append({k: data[k] for k in data.files})
        return results, output

    return launch


def numpy_load(path):
    return np.load(path, allow_pickle=False)
