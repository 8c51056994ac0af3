"""Start local Horovod jobs from Python (tests, benchmarks): ``horovodrun`` with a timeout, one
thread per worker, and each rank's output collected on failure."""

import os
import re
import signal
import subprocess
import sys

_RANK_PREFIX = re.compile(r"^\[(?:\d+,)?(\d+)\]<(stdout|stderr)>:(.*)$")
# Open MPI tags every write, and an unbuffered print may be several writes: tags inside a line
_MPI_TAG = re.compile(r"\[\d+,\d+\]<(?:stdout|stderr)>:")
# horovodrun's launcher, checking the build through Horovod's PyTorch extension first (seconds sooner)
HOROVODRUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovodrun.py")


class HorovodRunError(RuntimeError):
    """A ``horovodrun`` job failed or timed out; the message holds each rank's output."""


def horovodrun_command(args, np=2, controller="gloo", start_timeout=120, python=None):
    """The argv of ``horovodrun -np N -H localhost:N --gloo|--mpi python ARGS...``."""
    if controller not in ("gloo", "mpi"):
        raise ValueError(f"controller must be 'gloo' or 'mpi', got {controller!r}")
    if isinstance(args, (str, bytes)):
        raise TypeError(f"args must be a list of arguments (the script first), got the string {args!r}")
    if isinstance(np, bool) or not isinstance(np, int) or np < 1:
        raise ValueError(f"np must be an int >= 1, got {np!r}")
    args = [os.fspath(a) if isinstance(a, os.PathLike) else a for a in args]
    bad = [a for a in args if not isinstance(a, str)]
    if bad:
        raise TypeError(f"args must be strings (or paths), got {bad!r}")
    if isinstance(start_timeout, bool) or not isinstance(start_timeout, int) or start_timeout < 1:
        raise ValueError(f"start_timeout must be an int >= 1 (seconds), got {start_timeout!r}")
    python = python or sys.executable
    runner = os.path.join(os.path.dirname(python), "horovodrun")
    return [runner, "-np", str(np), "-H", f"localhost:{np}", f"--{controller}",
            "--start-timeout", str(start_timeout), python, *args]


def sooner_launcher(cmd):
    """``cmd`` with the ``horovodrun`` beside this Python started as ``devtools/horovodrun.py``: the same
    launcher, which checks Horovod's build through its PyTorch extension before its TensorFlow one."""
    if cmd and os.fspath(cmd[0]) == os.path.join(os.path.dirname(sys.executable), "horovodrun"):
        return [sys.executable, HOROVODRUN, *cmd[1:]]
    return list(cmd)


def split_by_rank(output):
    """``{rank: text}`` from horovodrun's ``[rank]<stdout>:`` prefixed output (rank -1: unprefixed)."""
    ranks = {}
    for line in output.splitlines():
        m = _RANK_PREFIX.match(line)
        rank, text = (int(m.group(1)), _MPI_TAG.sub("", m.group(3))) if m else (-1, line)
        ranks.setdefault(rank, []).append(text)
    return {r: "\n".join(lines) for r, lines in sorted(ranks.items())}


def run(args, np=2, controller="gloo", timeout=300, env=None, cwd=None, check=True, threads=1):
    """Run a Python script under ``horovodrun`` on this machine and return its combined output.

    ``threads`` sets OMP/MKL/torch/TF thread counts per worker. Raises :class:`HorovodRunError` with
    each rank's output when the job fails (``check``) or outlives ``timeout`` seconds.
    """
    return run_command(horovodrun_command(args, np=np, controller=controller), timeout=timeout,
                       env=env, cwd=cwd, check=check, threads=threads)


def run_command(cmd, timeout=300, env=None, cwd=None, check=True, threads=1):
    """:func:`run` for a ``horovodrun`` argv built by the caller (elastic options, say), started
    through :func:`sooner_launcher`."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")
    cmd = sooner_launcher([os.fspath(a) for a in cmd])
    full_env = dict(os.environ)
    full_env.update({
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
        "TF_NUM_INTRAOP_THREADS": str(threads), "TF_NUM_INTEROP_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
    })
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=cwd, start_new_session=True)
    output, _, timed_out = communicate_or_stop(proc, timeout)
    if timed_out:
        raise HorovodRunError(_report(f"timed out after {timeout} s", cmd, output))
    if check and proc.returncode != 0:
        raise HorovodRunError(_report(f"exited with {proc.returncode}", cmd, output))
    return output


def communicate_or_stop(proc, timeout, grace=10):
    """``(stdout, stderr, timed_out)`` of ``proc`` (started with ``start_new_session=True``); past
    ``timeout`` seconds its process group gets SIGTERM, and SIGKILL ``grace`` seconds later. SIGTERM
    first: mpirun then stops its ranks, which Open MPI starts in process groups of their own (SIGKILL
    would leave them running), and a benchmark removes what it made."""
    try:
        return (*proc.communicate(timeout=timeout), False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return (*proc.communicate(timeout=grace), True)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return (*proc.communicate(), True)


def _report(what, cmd, output):
    parts = [f"horovodrun {what}: {' '.join(cmd)}"]
    for rank, text in split_by_rank(output).items():
        label = "launcher" if rank < 0 else f"rank {rank}"
        parts.append(f"----- {label} -----\n{text[-6000:]}")
    return "\n".join(parts)
