"""One Python process that runs the tests' one-process snippets one after another (each in fresh
globals), instead of a fresh Python (and a fresh import of TensorFlow and Horovod) per snippet.

:func:`run_snippet` returns what a snippet printed, or fails the test with its traceback and the
process's stderr. A snippet that ends the process (a crash, or past its time limit) fails its own test
and the next snippet starts a new process; a snippet that raises leaves the process running.
"""

import atexit
import json
import os
import select
import subprocess
import sys
import tempfile

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "snippets.py")
_PROCESSES = {}


def _process(timeout):
    proc = _PROCESSES.get(timeout)
    if proc is None or proc.poll() is not None:
        stderr = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, WORKER, str(timeout)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, text=True)
        proc.stderr_file = stderr
        _PROCESSES[timeout] = proc
    return proc


def _stderr_tail(proc):
    proc.stderr_file.seek(0)
    return proc.stderr_file.read()[-3000:]


def run_snippet(code, timeout=600):
    """What ``code`` printed, run in the shared process; the test fails if it raised or ended the
    process (the process ends itself past ``timeout`` seconds)."""
    proc = _process(timeout)
    proc.stdin.write(json.dumps({"code": code}) + "\n")
    proc.stdin.flush()
    ready, _, _ = select.select([proc.stdout], [], [], timeout + 30)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"the snippet ended its Python process (exit {proc.returncode}):\n{_stderr_tail(proc)}")
    answer = json.loads(line)
    assert not answer["error"], answer["error"] + "\n" + _stderr_tail(proc)
    return answer["stdout"]


@atexit.register
def _close():
    for proc in _PROCESSES.values():
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
