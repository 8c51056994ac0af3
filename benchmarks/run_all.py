"""Run every benchmark's full command in turn (``make bench``); each rewrites its part of docs/.

    .venv/bin/python -m benchmarks.run_all                    # all of them (an hour or more)
    .venv/bin/python -m benchmarks.run_all --list             # what it would run
    .venv/bin/python -m benchmarks.run_all --only soak kernels

The commands are the full runs named in each module's docstring. ``slow_link`` needs root and
``ip netns``; without them it says it skipped and exits 0 (``scale`` runs without them, but does
not measure wire bytes); ``gpu_kernels`` needs a CUDA device,
and without one says so and exits 0. The runner stops at the first benchmark
that fails unless ``--keep-going``; its exit status is 1 if any failed.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (module, arguments after ``python -m benchmarks.MODULE``): each page's full run, in running order
BENCHMARKS = {
    "kernels": ("kernels", ["--environments", "default", "without AVX-512"]),
    "sketch_kernels": ("sketch_kernels", []),
    "per_tensor": ("per_tensor", []),
    "overhead": ("overhead", []),
    "gpu_kernels": ("gpu_kernels", ["--rounds", "200"]),
    "slow_link": ("slow_link", []),
    "scale": ("scale", ["--dense"]),
    "scalecom_options": ("scalecom_options", []),
    "convergence": ("convergence", []),
    "frontends": ("frontends", ["--dense"]),
    "tf_index_exchange": ("tf_index_exchange", []),
    "soak": ("soak", ["--steps", "6000"]),
    "soak_tensorflow": ("soak", ["--framework", "tensorflow", "--steps", "6000"]),
}


def command(name, python=None):
    module, arguments = BENCHMARKS[name]
    return [python or sys.executable, "-m", f"benchmarks.{module}", *arguments]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--list", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--only", nargs="+", choices=list(BENCHMARKS), default=None,
                    help="run these (in the usual order)")
    ap.add_argument("--keep-going", action="store_true", help="run the rest after a failure")
    args = ap.parse_args(argv)
    names = [n for n in BENCHMARKS if args.only is None or n in args.only]
    if args.list:
        for name in names:
            print(f"{name:<17} {shlex.join(command(name))}")
        return 0
    failed = []
    for name in names:
        cmd = command(name)
        print(f"== {name}: {shlex.join(cmd)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call(cmd, cwd=ROOT)
        print(f"== {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
            if not args.keep_going:
                break
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
