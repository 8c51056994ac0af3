"""Sketched SGD's count sketch (:class:`hvd_scalecom.torch.sketch.CountSketch`): ``sketch`` then
``estimate`` of one fp32 vector with the C kernels and with torch operations, side by side in one
process; writes the "Count sketch" section of docs/performance.md.

    .venv/bin/python -m benchmarks.sketch_kernels                # 8,398,848 entries, 5 x 25,230
    .venv/bin/python -m benchmarks.sketch_kernels --smoke        # 100,000 entries, two rounds

One thread (as each Horovod worker here). Each round times, in turn, the kernels' sketch and
estimate, then the torch operations' (``hvd_scalecom.native.torch_operations``), on the same vector
and table, after one untimed round; the table gives medians over rounds, the ratio taken round by
round. Both paths' outputs are checked to be the same floats first. By default the vector and the
table are those of the slow-link benchmark's Sketched SGD job (``benchmarks/slow_link.py``: its
model's sketched matrices, its ratio), computed by :func:`slow_link_sketch`.
"""

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks._report import COUNT, command_line, output_file, output_path, replace_section
from benchmarks._slow_link_worker import make_model
from benchmarks.models import DEFAULT_WIDTHS
from benchmarks.slow_link import DEFAULT_JOBS
from hvd_scalecom import native
from hvd_scalecom.sketched_qsparse_config import SketchedSGDConfig
from hvd_scalecom.torch.sketch import CountSketch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def slow_link_sketch():
    """``(entries, rows, columns)`` of the sketched vector and table of the slow-link benchmark's
    Sketched SGD job with its default model, as ``hvd_scalecom.torch.SketchedSGD`` sizes them."""
    job, = (j for j in DEFAULT_JOBS if j.split(":", 1)[0] == "sketched")
    config = SketchedSGDConfig(**json.loads(job.split(":", 1)[1]))
    with torch.device("meta"):
        model = make_model(DEFAULT_WIDTHS)
    numels = [p.numel() for p in model.parameters() if config.is_sketched(p.shape)]
    return sum(numels), config.rows, config.num_columns(config.num_selected(numels))


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(numel, rows, columns, rounds):
    """``{path: (sketch ms, estimate ms, both ms)}`` (medians) and the median per-round ratio of the
    torch operations' time to the kernels'."""
    cs = CountSketch(numel, rows, columns, seed=1)
    v = torch.randn(numel, generator=torch.Generator().manual_seed(2))
    table = cs.sketch(v)
    estimate = cs.estimate(table)
    with native.torch_operations():
        same = (torch.equal(cs.sketch(v).view(torch.int32), table.view(torch.int32))
                and torch.equal(cs.estimate(table).view(torch.int32), estimate.view(torch.int32)))
    if not same:
        raise SystemExit("the kernels and the torch operations disagree")

    def one_round():
        kernels = (timed(lambda: cs.sketch(v)), timed(lambda: cs.estimate(table)))
        with native.torch_operations():
            torch_ops = (timed(lambda: cs.sketch(v)), timed(lambda: cs.estimate(table)))
        return kernels, torch_ops

    one_round()
    results = [one_round() for _ in range(rounds)]
    ms = {}
    for name, at in (("C kernels", 0), ("torch operations", 1)):
        parts = [1e3 * statistics.median(r[at][part] for r in results) for part in (0, 1)]
        ms[name] = (*parts, 1e3 * statistics.median(sum(r[at]) for r in results))
    return ms, statistics.median(sum(r[1]) / sum(r[0]) for r in results)


def markdown(args, ms, ratio, command, load):
    lines = [
        "## Count sketch (Sketched SGD): the C kernels against torch operations",
        "",
        f"Made by `{command}`: `CountSketch.sketch` then `estimate` of one vector of {args.numel:,} fp32",
        f"entries into a {args.rows} x {args.columns:,} table, one thread, {args.rounds} rounds (medians; the",
        "ratio taken round by round). Both paths compute the same floats (checked first, and by",
        "`tests/test_sketch_kernels.py`). Load average of this 2-core machine: "
        f"{load[0]:.1f} at the start, {load[1]:.1f} at the end.",
        "",
        "| path | sketch ms | estimate ms | both ms |",
        "|---|---:|---:|---:|",
    ]
    for name, (sketch, estimate, both) in ms.items():
        lines.append(f"| {name} | {sketch:.1f} | {estimate:.1f} | {both:.1f} |")
    lines += ["", f"Torch operations over the C kernels: **{ratio:.1f}x**."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--numel", type=COUNT, default=None, help="default: the slow-link job's")
    parser.add_argument("--rows", type=COUNT, default=None, help="default: the slow-link job's")
    parser.add_argument("--columns", type=COUNT, default=None, help="default: the slow-link job's")
    parser.add_argument("--rounds", type=COUNT, default=None, help="default 7; 2 with --smoke")
    parser.add_argument("--smoke", action="store_true", help="100,000 entries, 2 rounds")
    parser.add_argument("--out", type=output_file, default=None,
                        help="default: docs/performance.md (a temporary file in --smoke)")
    args = parser.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "performance.md")
    numel, rows, columns = (100_000, 5, 2_000) if args.smoke else slow_link_sketch()
    args.numel, args.rows, args.columns = args.numel or numel, args.rows or rows, args.columns or columns
    args.rounds = args.rounds or (2 if args.smoke else 7)  # (an explicit --rounds wins, also in --smoke)
    torch.set_num_threads(1)
    if native.library() is None:
        raise SystemExit("the C kernels are unavailable (HVD_SCALECOM_NATIVE=0 or no compiler)")
    load = [os.getloadavg()[0]]
    ms, ratio = measure(args.numel, args.rows, args.columns, args.rounds)
    load.append(os.getloadavg()[0])
    for name, (sketch, estimate, both) in ms.items():
        print(f"{name:18s} sketch {sketch:8.1f} ms  estimate {estimate:8.1f} ms  both {both:8.1f} ms")
    print(f"torch operations / C kernels (sketch + estimate, per round): {ratio:.1f}x")
    command = command_line("sketch_kernels", argv)
    replace_section(args.out, "sketch", markdown(args, ms, ratio, command, load))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
