"""Running a benchmark in its --smoke mode from the tests."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_smoke(module, out, timeout, extra=()):
    """``python -m MODULE --smoke --out OUT [EXTRA...]`` from the repository root; asserts it succeeded
    and returns its standard output."""
    proc = subprocess.run([sys.executable, "-m", module, "--smoke", "--out", str(out), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout
