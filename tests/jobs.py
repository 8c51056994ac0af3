"""The one launcher of the multi-process tests: runs of tests/workers scripts share ``horovodrun`` jobs.

Starting ``horovodrun`` and importing torch or TensorFlow and Horovod on every rank costs far more than
most runs the tests check, so runs that can share a set-up (ranks, controller, environment, framework)
follow one another in the same processes of one job: tests/workers/sequence.py runs each worker script
through runpy with the argv it takes on its own (``<options JSON> <output folder>``). A job holds only
the runs of the tests selected in the session, starts at the first test that reads it and runs once.

* :func:`define_job` names a job: ranks, controller, environment, a Horovod timeline of rank 0 (which
  the job's runs share), the jobs that must run before it (whose outputs its runs read).
* :func:`add_run` adds a run to a job: ``fails=True`` for a run that must fail, which ends the job, so
  it runs last (one per job); ``raises="Type: message"`` for a run that must raise that error on every
  rank where no Horovod collective is left in flight (e.g. ScaleCom's configuration check at the first
  compress, which all ranks pass or fail together after blocking allgathers): each rank prints its
  traceback and goes on to the job's next run, so such runs share jobs like passing ones;
  ``first=True`` for runs that must come first (those that start Horovod with a process set, which
  only the first ``hvd.init`` of a process can register).
* the ``horovod_jobs`` fixture (tests/conftest.py) runs a job and returns its :class:`JobResult`:
  :meth:`JobResult.completed` gives a run's per-rank npz dicts (the test fails, with the job's
  per-rank output, if the run did not complete on every rank), :meth:`JobResult.raised` each rank's
  output of a run that must raise (the test fails if a rank did not raise it), :meth:`JobResult.failure`
  the report of a run that must fail (its ranks' output from that run on).

Nothing hangs: every run has a time limit on every rank (past it the rank prints every thread's stack
and exits, which ends the job), and the job as a whole the sum of its runs' limits.
"""

import json
import os
import re
from dataclasses import dataclass, field

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "workers")
SEQUENCE = os.path.join(WORKERS, "sequence.py")
MARK = "[horovod job] run "  # what sequence.py prints on every rank before each run


@dataclass
class Job:
    name: str
    np: int
    controller: str = "gloo"
    env: dict = field(default_factory=dict)
    timeline: bool = False
    after: tuple = ()
    runs: list = field(default_factory=list)


@dataclass
class Run:
    part: str
    worker: str
    opts: object
    tests: tuple
    fails: bool
    first: bool
    timeout: int
    raises: str = None


JOBS = {}
_DONE = {}


def define_job(name, np, controller="gloo", env=None, timeline=False, after=()):
    """A job of ``np`` ranks under ``controller`` with ``env`` for every rank; ``timeline``: Horovod
    records one (``HOROVOD_TIMELINE``) for the whole job; ``after``: the jobs whose outputs its runs
    read (they run first, whatever the tests' order)."""
    if name in JOBS:
        raise ValueError(f"job {name!r} is defined twice")
    JOBS[name] = Job(name, np, controller, dict(env or {}), timeline, tuple(after))


def add_run(job, part, worker, opts, tests, fails=False, first=False, timeout=300, raises=None):
    """Add to ``job`` a run of ``tests/workers/<worker>`` (or of the script at the absolute path
    ``worker``) writing to ``<root>/<part>``. ``opts``: its JSON options (a dict), or its arguments (a
    list of strings, for a script that takes no options JSON), or a function of ``root`` (a
    ``pathlib.Path``) returning either; ``tests``: the names of the test functions that read it (the run
    is left out when none of them is selected); ``timeout``: its limit in seconds on every rank;
    ``raises``: the start of ``"<exception type>: <message>"`` of the error the run must raise on
    every rank, only where no collective can be in flight when it does (the job's next run would meet
    it): that error alone is caught (tests/workers/sequence.py)."""
    if not re.fullmatch(r"[\w.-]+", part):
        raise ValueError(f"a run's part names its folder: letters, digits, '_', '.', '-', got {part!r}")
    if any(r.part == part for j in JOBS.values() for r in j.runs):
        raise ValueError(f"run {part!r} is added twice")
    if isinstance(tests, str):
        raise TypeError(f"tests must be a list of test names, got the string {tests!r}")
    if fails and raises:
        raise ValueError(f"run {part!r}: fails=True ends the job, raises= goes on to its next run; not both")
    if raises is not None and not re.match(r"\w+: \S", raises):
        raise ValueError(f"run {part!r}: raises is the start of '<exception type>: <message>', got {raises!r}")
    JOBS[job].runs.append(Run(part, worker, opts, tuple(tests), fails, first, timeout, raises))


class JobResult:
    """What a job left: ``error`` (its HorovodRunError, or None), ``results`` ({part: per-rank npz dicts,
    as many as ranks completed the run}), ``root`` (the folder of every part) and ``timeline`` (rank 0's
    Horovod timeline, for a job defined with one)."""

    def __init__(self, job, runs, error, root, output):
        self.job, self.runs, self.error, self.root, self.output = job, runs, error, root, output
        self.timeline = root / f"{job.name}_timeline.json" if job.timeline else None
        self.results = {}
        for run in runs:
            self.results[run.part] = []
            for rank in range(job.np):
                path = root / run.part / f"rank{rank}.npz"
                if path.exists():
                    with np.load(path, allow_pickle=False) as data:
                        self.results[run.part].append({k: data[k] for k in data.files})

    def __getitem__(self, key):  # job["error"], job["results"], job["timeline"], job["root"]
        return getattr(self, key)

    def completed(self, part, size=None):
        """The per-rank results of ``part``, which must have completed on every rank of the job, ``size``
        of them (by default every rank) writing results."""
        results = self.results[part]
        size = self.job.np if size is None else size
        finished = [rank for rank in range(self.job.np) if (self.root / part / f"finished.rank{rank}").exists()]
        assert finished == list(range(self.job.np)) and len(results) == size, \
            f"run {part} of job {self.job.name} did not complete on every rank (finished on {finished}, " \
            f"{len(results)} results of {size}):\n{self.error}"
        return results

    def output_of(self, part, ranks=None):
        """What ``part`` wrote to sys.stdout and sys.stderr on every rank (or on ``ranks``), as horovodrun
        shows it (each line after its ``[rank]<stdout>:`` or ``[rank]<stderr>:``), from the run's own copy
        of its output."""
        lines = []
        for rank in self.started(part) if ranks is None else ranks:
            for stream in ("stdout", "stderr"):
                path = self.root / part / f"{stream}.rank{rank}.txt"
                if path.exists():
                    lines += [f"[{rank}]<{stream}>:{line}" for line in path.read_text().splitlines()]
        return "\n".join(lines)

    def raised(self, part):
        """Each rank's output of ``part``, a run that must raise its ``raises`` error (``[text of rank 0,
        ...]``): the test fails, with the run's output and the job's error, unless every rank raised it.
        Each rank's ``"<exception type>: <message>"`` is in ``<root>/<part>/raised.rank<R>``."""
        run = {r.part: r for r in self.runs}.get(part)
        assert run is not None and run.raises, \
            f"run {part} is no run of job {self.job.name} that must raise (add_run(..., raises=...))"
        missing = [rank for rank in range(self.job.np) if not (self.root / part / f"raised.rank{rank}").exists()]
        assert not missing, f"run {part} of job {self.job.name} did not raise {run.raises!r} on ranks {missing} " \
            f"(started on {self.started(part)}):\n{self.output_of(part)[-6000:]}\n{self.error}"
        return [self.output_of(part, ranks=[rank]) for rank in range(self.job.np)]

    def started(self, part):
        """The ranks on which ``part`` started (sequence.py marks each run's start in its folder)."""
        return [rank for rank in range(self.job.np) if (self.root / part / f"started.rank{rank}").exists()]

    def failure(self, part):
        """The report of ``part``, a run that must fail: the job's error message with each rank's output
        from that run's start on (the format of :class:`devtools.launch.HorovodRunError`)."""
        assert self.error is not None, f"job {self.job.name} did not fail: run {part} must"
        assert self.started(part) == list(range(self.job.np)), \
            f"run {part} did not start on every rank (ranks {self.started(part)}): the job failed before it:\n" \
            f"{self.error}"
        pieces = re.split(r"(----- (?:rank \d+|launcher) -----)", str(self.error))
        start = re.escape(MARK + part + ":") + r"[^\n]*"  # the run's marker line
        return "".join(piece if i % 2 or not i else re.split(start, piece, maxsplit=1)[-1]
                       for i, piece in enumerate(pieces))


def selected_tests(request):
    return {getattr(item, "originalname", item.name) for item in request.session.items}


def run_job(name, request, tmp_path_factory):
    """Run job ``name`` once per session (the jobs in its ``after`` first) and return its
    :class:`JobResult`."""
    from devtools.launch import HorovodRunError, run

    job = JOBS[name]
    for earlier in job.after:
        run_job(earlier, request, tmp_path_factory)
    if name in _DONE:
        return _DONE[name]
    if "root" not in _DONE:
        _DONE["root"] = tmp_path_factory.mktemp("horovod_jobs")
    root = _DONE["root"]
    selected = selected_tests(request)
    runs = sorted((r for r in job.runs if selected & set(r.tests)), key=lambda r: (not r.first, r.fails))
    assert sum(r.fails for r in runs) <= 1, f"job {name}: more than one run that must fail"
    plan = []
    for r in runs:
        os.makedirs(root / r.part)
        opts = r.opts(root) if callable(r.opts) else r.opts
        plan.append([r.part, os.path.join(WORKERS, r.worker), opts if isinstance(opts, list) else json.dumps(opts),
                     str(root / r.part), r.timeout, r.raises])
    plan_file = root / f"{name}.plan.json"
    plan_file.write_text(json.dumps(plan))
    error, output = None, ""
    if plan:
        try:
            env = {**job.env, **({"HOROVOD_TIMELINE": str(root / f"{name}_timeline.json")} if job.timeline else {})}
            output = run([SEQUENCE, str(plan_file)], np=job.np, controller=job.controller, env=env,
                timeout=60 + sum(r.timeout for r in runs))
        except HorovodRunError as e:
            error = e
    _DONE[name] = JobResult(job, runs, error, root, output)
    return _DONE[name]


def rank_sections(report):
    """``{rank: text}`` from a job's report (one ``----- rank R -----`` section each)."""
    sections = {}
    for chunk in report.split("----- rank ")[1:]:
        rank, _, text = chunk.partition(" -----")
        sections[int(rank)] = text
    return sections


# -- the jobs of tests/workers/torch_scalecom.py (tests/test_torch_*scalecom*.py, test_torch_bad_input.py,
# test_sim_horovod.py, test_horovod_smoke.py) ---------------------------------------------------------------
# Horovod's stall settings, which ScaleCom follows too: a wait for indices that never come ends the job.
FAST_STALL = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}
define_job("torch_np2", 2)
define_job("torch_np3", 3)
define_job("torch_np2_mpi", 2, controller="mpi")
define_job("torch_np3_mpi", 3, controller="mpi")
define_job("torch_np3_native_off", 3, env={"HVD_SCALECOM_NATIVE": "0"})  # torch operations, no C kernels
define_job("torch_np2_stall", 2, env=FAST_STALL)
define_job("torch_np3_stall", 3, env=FAST_STALL, after=["torch_np3"])  # (resumes torch_np3's checkpoints)

# -- the jobs of tests/test_torch_sketched_sgd.py and tests/test_torch_qsparse.py (each with a timeline) ----
define_job("np3", 3, timeline=True)
define_job("np2_first", 2, timeline=True)
define_job("np2_second", 2, timeline=True, after=["np2_first"])  # resumes np2_first's checkpoints
define_job("np2_reload", 2, timeline=True)
define_job("np2_reload_dense", 2, timeline=True)
define_job("np1", 1, timeline=True)
define_job("np3_mpi", 3, controller="mpi", timeline=True)

# -- the jobs of the TensorFlow workers (tests/test_tensorflow_scalecom.py, test_horovod_smoke.py) ----------
define_job("tf_np2_timeline", 2, timeline=True)
define_job("tf_np2", 2, after=["tf_np2_timeline"])  # (resumes tf_np2_timeline's checkpoint)
define_job("tf_np3", 3)
define_job("tf_np2_mpi", 2, controller="mpi")
define_job("tf_np3_mpi", 3, controller="mpi")

# -- the examples' jobs (tests/test_examples.py, test_tensorflow_scalecom.py): ex_*_b and ex_*_c resume, in
# new processes, from ex_*'s checkpoints
for framework in ("torch", "tf"):
    define_job(f"ex_{framework}_np2", 2)
    define_job(f"ex_{framework}_np2_b", 2, after=[f"ex_{framework}_np2"])
    define_job(f"ex_{framework}_np2_c", 2, after=[f"ex_{framework}_np2"])
    define_job(f"ex_{framework}_np4", 4)
