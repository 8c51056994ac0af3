"""Running a benchmark in its --smoke mode from the tests."""

import os
import subprocess
import sys

from devtools.launch import communicate_or_stop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_smoke(module, out, timeout, extra=(), env=None):
    """``python -m MODULE --smoke --out OUT [EXTRA...]`` from the repository root (``env``: variables
    added to its environment); asserts it succeeded and returns its standard output. Past ``timeout``
    seconds the benchmark gets SIGTERM (so that it can clean up: the slow-link benchmark removes its
    namespace), then SIGKILL, and the test fails."""
    with subprocess.Popen([sys.executable, "-m", module, "--smoke", "--out", str(out), *extra], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env=None if env is None else {**os.environ, **env}) as proc:
        stdout, stderr, timed_out = communicate_or_stop(proc, timeout, grace=60)
    assert not timed_out, f"{module} --smoke took more than {timeout} s:\n{stdout}{stderr}"
    assert proc.returncode == 0, stdout + stderr
    return stdout
