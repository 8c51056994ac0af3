"""One Python process for many of the tests' short runs, instead of a fresh Python (and a fresh import
of torch, TensorFlow and Horovod) for each.

:func:`run_snippet` runs code in one process shared by the tests (each snippet in fresh globals) and
returns what it printed, or fails the test with its traceback and the process's stderr. A snippet that
ends the process (a crash, or past its time limit) fails its own test and the next snippet starts a
new process; a snippet that raises leaves the process running.

:func:`each_argv` runs a script or ``-m module`` with several argument lists in one new process
(tests/workers/each_argv.py), as ``python SCRIPT ARGS`` would each time.
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


def each_argv(target, argument_lists, cwd=None, timeout=None):
    """``{tuple(arguments): (exit code, stdout, stderr)}`` of ``target`` (a script's path, or ``-m
    MODULE``) run with each of ``argument_lists`` in one new Python in ``cwd``."""
    worker = os.path.join(os.path.dirname(WORKER), "each_argv.py")
    done = subprocess.run([sys.executable, worker, target, json.dumps([list(a) for a in argument_lists])],
                          cwd=cwd, capture_output=True, text=True,
                          timeout=timeout or 300 + 60 * len(argument_lists))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return {tuple(a): (code, out, err) for a, code, out, err in json.loads(done.stdout.splitlines()[-1])}


@atexit.register
def _close():
    for proc in _PROCESSES.values():
        if proc.poll() is None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
