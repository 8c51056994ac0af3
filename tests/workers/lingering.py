"""A failing rank prints its error, then waits a moment before exiting: horovodrun stops the other
ranks when the first one exits, and the tests read every rank's own error.

Where the run's output folder is known (``folder``: tests/workers/sequence.py sets it for each run),
each failing rank marks there that it has printed its error, and the wait ends 1 s (for the launcher
to pass the output on) after every rank of the job has: a refusal that every rank raises costs about
a second, not the whole wait."""

import os
import sys
import time
import traceback

WAIT = 6  # seconds at most (2 s was too short once: a rank slowed by a loaded machine raised later)
FORWARD = 1  # seconds for the launcher to pass on the output once every rank has printed its error
folder = None  # the output folder of the run in progress (None: wait the whole WAIT)
RANK = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
SIZE = os.environ.get("HOROVOD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE"))


def report_and_linger(kind, value, tb):
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    if folder is None or RANK is None or SIZE is None:
        time.sleep(WAIT)
        return
    open(os.path.join(folder, f"reported.rank{RANK}"), "w").close()
    marks = [os.path.join(folder, f"reported.rank{rank}") for rank in range(int(SIZE))]
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline and not all(map(os.path.exists, marks)):
        time.sleep(0.05)
    time.sleep(min(FORWARD, max(0.0, deadline - time.monotonic())))


def install():
    """Every uncaught exception of this process reported, then up to 6 s before the exit."""
    sys.excepthook = report_and_linger
