"""A failing rank prints its error, then waits a moment before exiting: horovodrun stops the other
ranks when the first one exits, and the tests read every rank's own error."""

import sys
import time
import traceback


def report_and_linger(kind, value, tb):
    traceback.print_exception(kind, value, tb)
    sys.stderr.flush()
    time.sleep(6)  # (2 s was too short once: a rank slowed by a loaded machine raised later)


def install():
    """Every uncaught exception of this process reported, then 6 s before the exit."""
    sys.excepthook = report_and_linger
