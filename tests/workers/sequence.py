"""Several runs, one after another, in the processes of one horovodrun job (tests/jobs.py).

argv: a JSON file listing ``[part, script, arguments, output folder, seconds, raises]``. Each script runs
through runpy with the argv it takes on its own: ``arguments`` (a list), or, for a worker of this
folder, its options JSON (a string) and the output folder. Before each run every rank prints
``[horovod job] run <part>:`` and marks the run's start (and then its end) in its output folder, where
it also keeps a copy of what the run writes to sys.stdout and sys.stderr (``stdout.rank<R>.txt``); ``sys.exit()`` or
``sys.exit(0)`` ends a run, not the job; so does the error ``raises`` names (the start of
``"<exception type>: <message>"``, or null), which alone is caught: the rank prints its traceback and
records it (``raised.rank<R>``) before the next run. Past ``seconds`` a rank prints every thread's stack and exits,
which ends the job (so does a shutdown past 120 s). At the end every queued event of a job's Horovod
timeline is written.
"""

import faulthandler
import json
import os
import runpy
import sys
import traceback

import lingering  # (this folder, the script's, is first on sys.path)

RANK = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))


class Tee:
    """A stream that also writes what it is given to a file (a run's own copy of its output)."""

    def __init__(self, stream, path):
        self.stream, self.copy = stream, open(path, "w")

    def write(self, text):
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self):
        self.copy.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)

lingering.install()  # a failing run's error printed on every rank before horovodrun stops them
with open(sys.argv[1]) as f:
    plan = json.load(f)
for part, script, arguments, out_dir, seconds, raises in plan:
    argv = arguments if isinstance(arguments, list) else [arguments, out_dir]
    print(f"[horovod job] run {part}: {os.path.basename(script)} {' '.join(argv)}", flush=True)
    open(os.path.join(out_dir, f"started.rank{RANK}"), "w").close()
    faulthandler.dump_traceback_later(seconds, exit=True)  # a hang ends the job, with every stack
    lingering.folder = out_dir  # (a failing run's ranks mark there that they have printed their error)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # (as python SCRIPT puts its folder first)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = (Tee(stream, os.path.join(out_dir, f"{name}.rank{RANK}.txt"))
                              for stream, name in zip(streams, ("stdout", "stderr")))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
    except Exception as error:
        said = f"{type(error).__name__}: {error}"
        if raises is None or not said.startswith(raises):
            raise
        traceback.print_exc()
        print(f"[horovod job] run {part} raised the error it must, on to the next run", flush=True)
        with open(os.path.join(out_dir, f"raised.rank{RANK}"), "w") as record:
            record.write(said)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = streams
        sys.path.remove(os.path.dirname(script))
    faulthandler.cancel_dump_traceback_later()
    open(os.path.join(out_dir, f"finished.rank{RANK}"), "w").close()
faulthandler.dump_traceback_later(120, exit=True)  # (Horovod's shutdown at exit too)
for frontend in ("horovod.torch", "horovod.tensorflow"):
    if frontend in sys.modules and sys.modules[frontend].is_initialized():
        sys.modules[frontend].stop_timeline()  # every queued event written (Horovod drops them at shutdown)
