"""Shared by the performance benchmarks: timing side by side, and one section of a markdown file each.

``docs/performance.md`` has a section from each of ``kernels``, ``per_tensor``, ``gpu_kernels``,
``slow_link`` and ``sketch_kernels``; each owns the
text between its ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers and leaves the rest alone.
"""

import argparse
import atexit
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = """# Performance

Each section names the command that made it and what it ran on; its timings are medians of repeated
runs taken side by side in one process or job.
"""


def cpu():
    """The CPU's model name from ``/proc/cpuinfo`` and whether it has AVX-512 (the native kernels run
    other loops without it), e.g. ``"AMD EPYC, AVX-512"``; ``platform.processor()`` elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    field = {}
    for line in lines:
        key, _, value = line.partition(":")
        field.setdefault(key.strip(), value.strip())
    flags = field.get("flags", "").split()
    return f"{field.get('model name', platform.processor() or 'unknown CPU')}, " + \
        ("AVX-512" if "avx512f" in flags else "without AVX-512")


def number(kind=int, *, minimum=None, above=None, maximum=None):
    """An argparse ``type``: a ``kind`` (int or float) within the bounds given, so that a value out of
    them is refused with argparse's error naming the option, before anything runs (a 0 given for a
    count is not taken for "the default")."""
    bounds = [f">= {minimum}" if minimum is not None else None, f"> {above}" if above is not None else None,
              f"<= {maximum}" if maximum is not None else None]
    wanted = " and ".join(b for b in bounds if b)

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if (isinstance(value, float) and not math.isfinite(value)) or \
                (minimum is not None and value < minimum) or (above is not None and value <= above) or \
                (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be a finite number {wanted}, got {text}"
                                             if kind is float else f"must be an integer {wanted}, got {text}")
        return value

    parse.__name__ = kind.__name__  # (argparse names the kind in its own messages)
    return parse


COUNT = number(int, minimum=1)
NON_NEGATIVE = number(int, minimum=0)
RATIO = number(float, above=0, maximum=1)
SECONDS = number(float, above=0)


def output_file(text):
    """An argparse ``type``: a file a benchmark will write (its missing directories are made then), so
    that a path that cannot be one is refused, naming the option, before anything runs and not when
    the results are written: an existing directory, or a path under a file."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not writable")
    return text


def smoke_directory(prefix="hvd_scalecom_smoke-"):
    """A new temporary directory for a smoke run's output, removed at exit if nothing was written
    into it (a run that skips, fails or is interrupted leaves no empty directory behind)."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(_remove_if_empty, path)
    return path


def _remove_if_empty(path):
    try:
        os.rmdir(path)
    except OSError:  # (not empty: the run's output; or gone already)
        pass


def output_path(given, smoke, *default):
    """Where a benchmark writes: ``given`` if not None; else ``docs/<default...>``, except for a smoke
    run, which writes into a new temporary directory (a smoke run never replaces a published page;
    see :func:`smoke_directory`)."""
    if given is not None:
        return given
    if smoke:
        return os.path.join(smoke_directory(), *default)
    return os.path.join(ROOT, "docs", *default)


def write_text(path, text):
    """Write ``text`` to ``path``, making its directory if missing; the file is replaced whole, so an
    interrupted write leaves it as it was (no half-written file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    partial = f"{path}.partial"
    try:
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def replace_section(path, name, body):
    """Write ``body`` between ``name``'s markers in ``path`` (created, with a header, if missing)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = open(path).read() if os.path.exists(path) else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    write_text(path, text)  # (replaced whole: an interrupted write leaves the page as it was)


def interleaved(variants, rounds, references, prepare=None):
    """Time every callable of ``variants`` once per round, in turn, ``rounds`` times.

    ``prepare()`` (not timed) runs before each call. Every timed call directly follows an untimed
    call of the same variant (and a ``prepare()``), so each variant, the reference included, starts
    from the caches its own work leaves: otherwise the variant after a heavy one (large temporaries)
    starts colder than the others, and a ratio to it is skewed. Returns ``{name: (median seconds,
    {reference: median ratio to that variant within the same round}, best seconds)}`` for the names
    in ``references``: a ratio taken round by round cancels much of the noise that other processes
    on the machine add, and the best round shows the cost without preemption (on a loaded machine a
    call of a few ms is often descheduled).
    """
    times = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            for timed in (False, True):
                if prepare:
                    prepare()
                start = time.perf_counter()
                fn()
                if timed:
                    times[name].append(time.perf_counter() - start)
    return {name: (statistics.median(ts),
                   {ref: statistics.median(t / r for t, r in zip(ts, times[ref])) for ref in references},
                   min(ts))
            for name, ts in times.items()}


def shown_arguments(argv):
    """The command-line arguments worth printing with a benchmark's results (not where they go, nor
    whether earlier runs were reused)."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--plot", "--out-dir", "--json"):
            skip = True
        elif a != "--resume" and not a.startswith(("--out=", "--plot=", "--out-dir=", "--json=")):
            shown.append(a)
    return shown


def command_line(module, argv):
    """``python -m benchmarks.MODULE`` and the :func:`shown_arguments` of ``argv`` (None: the
    process's), quoted as a shell would need them."""
    arguments = shown_arguments(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", "-m", f"benchmarks.{module}", *arguments])
