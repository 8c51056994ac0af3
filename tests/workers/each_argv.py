"""Run one script several times in this process, each with its own arguments, as ``python SCRIPT ARGS``
would (its folder first on sys.path; ``-m MODULE`` as ``python -m MODULE ARGS``, the working folder
first), and print, as the last line, a JSON list of ``[arguments, exit code, stdout, stderr]``: what each
run wrote to sys.stdout and to sys.stderr, its exit status (a SystemExit's code; 1 and the traceback for
an uncaught exception). argv: the script (or ``-m MODULE``), a JSON list of argument lists. Each run has
300 s (then every thread's stack is printed and the process exits).
"""

import contextlib
import faulthandler
import io
import json
import os
import runpy
import sys
import traceback

script, argument_lists = sys.argv[1], json.loads(sys.argv[2])
module = script[3:] if script.startswith("-m ") else None
sys.path.insert(0, os.getcwd() if module else os.path.dirname(os.path.abspath(script)))
outcomes = []
for arguments in argument_lists:
    sys.argv = [script, *arguments]
    output, errors = io.StringIO(), io.StringIO()
    faulthandler.dump_traceback_later(300, exit=True)
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(errors):
        try:
            if module:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) or done.code is None else 1
            if not isinstance(done.code, int) and done.code is not None:
                print(done.code, file=sys.stderr)  # (what the interpreter prints for sys.exit("..."))
            code = code or 0
        except BaseException:  # noqa: B902 (a run's uncaught error ends that run, as it would end the process)
            traceback.print_exc()
            code = 1
    faulthandler.cancel_dump_traceback_later()
    outcomes.append([arguments, code, output.getvalue(), errors.getvalue()])
print(json.dumps(outcomes))
