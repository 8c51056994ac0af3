"""Running a benchmark in its --smoke mode from the tests."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_smoke(module, out, timeout, extra=()):
    """``python -m MODULE --smoke --out OUT [EXTRA...]`` from the repository root; asserts it succeeded
    and returns its standard output. Past ``timeout`` seconds the benchmark gets SIGTERM (so that it can
    clean up: the slow-link benchmark removes its namespace), then SIGKILL, and the test fails."""
    with subprocess.Popen([sys.executable, "-m", module, "--smoke", "--out", str(out), *extra], cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                stdout, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
            raise AssertionError(f"{module} --smoke took more than {timeout} s:\n{stdout}{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    return stdout
