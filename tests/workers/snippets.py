"""Runs Python snippets one after another in this one process (tests/shared_python.py): each line of
stdin is a JSON ``{"code": ...}``, run with ``exec`` in fresh globals; each answer is one JSON line,
``{"stdout": what it printed, "error": its traceback or ""}``. Past ``seconds`` (argv[1]) on one
snippet the process prints every thread's stack and exits. Ends at the end of stdin."""

import contextlib
import faulthandler
import io
import json
import os
import sys
import traceback

seconds = int(sys.argv[1])
answers = os.fdopen(os.dup(1), "w")  # (whatever else writes to file descriptor 1 goes to stderr)
os.dup2(2, 1)
for line in sys.stdin:
    code = json.loads(line)["code"]
    printed, error = io.StringIO(), ""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
    except SystemExit as done:  # (as for python -c: exit 0 is a success; the process goes on)
        error = "" if done.code in (None, 0) else traceback.format_exc()
    except BaseException:
        error = traceback.format_exc()
    faulthandler.cancel_dump_traceback_later()
    answers.write(json.dumps({"stdout": printed.getvalue(), "error": error}) + "\n")
    answers.flush()
