"""Counts ``horovodrun`` launches: with ``HVD_SCALECOM_LAUNCH_LOG=<file>`` set, every process that has
this folder on its PYTHONPATH (tests/conftest.py puts it there) appends a line to that file for each
``horovodrun`` it starts: the time, the test running (pytest's PYTEST_CURRENT_TEST) and the command."""

import os
import subprocess
import time

_LOG = os.environ.get("HVD_SCALECOM_LAUNCH_LOG")
if _LOG and not getattr(subprocess.Popen, "_launch_logged", False):
    _start = subprocess.Popen.__init__

    def _logged_init(self, args, *rest, **kwargs):
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        names = [os.path.basename(os.fspath(a)) for a in argv[:2]]
        if names[:1] == ["horovodrun"] or names[1:] == ["horovodrun.py"]:  # (devtools/horovodrun.py: the same)
            test = os.environ.get("PYTEST_CURRENT_TEST", "-").rsplit(" ", 1)[0]
            with open(_LOG, "a") as log:
                log.write(f"{time.strftime('%H:%M:%S')}\t{test}\t{' '.join(map(str, argv[:8]))}\n")
        _start(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = _logged_init
    subprocess.Popen._launch_logged = True
