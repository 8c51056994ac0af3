"""Sketched SGD's count sketch (:class:`hvd_scalecom.torch.sketch.CountSketch`): ``sketch`` then
``estimate`` of one fp32 vector with the C kernels and with torch operations, side by side in one
process; prints the timings (writes no file).

    .venv/bin/python -m benchmarks.sketch_kernels                # 8,403,978 entries, 5 x 136,000
    .venv/bin/python -m benchmarks.sketch_kernels --smoke        # 100,000 entries, two rounds

One thread (as each Horovod worker here). Each round times, in turn, the kernels' sketch and
estimate, then the torch operations' (``hvd_scalecom.native.torch_operations``), on the same vector
and table, after one untimed round; the table gives medians over rounds, the ratio taken round by
round. Both paths' outputs are checked to be the same floats first.
"""

import argparse
import statistics
import time

import torch

from hvd_scalecom import native
from hvd_scalecom.torch.sketch import CountSketch


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8_403_978)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--columns", type=int, default=136_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="100,000 entries, 2 rounds")
    args = parser.parse_args()
    if args.smoke:
        args.numel, args.columns, args.rounds = 100_000, 2_000, 2
    torch.set_num_threads(1)
    if native.library() is None:
        raise SystemExit("the C kernels are unavailable (HVD_SCALECOM_NATIVE=0 or no compiler)")
    cs = CountSketch(args.numel, args.rows, args.columns, seed=1)
    v = torch.randn(args.numel, generator=torch.Generator().manual_seed(2))
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
    rounds = [one_round() for _ in range(args.rounds)]
    print(f"CountSketch, {args.numel:,} fp32 entries, {args.rows} x {args.columns:,} table, 1 thread, "
          f"{args.rounds} rounds (medians, ms)")
    print(f"{'':18s}{'sketch':>10s}{'estimate':>10s}{'both':>10s}")
    for name, at in (("C kernels", 0), ("torch operations", 1)):
        parts = [statistics.median(r[at][part] for r in rounds) * 1e3 for part in (0, 1)]
        both = statistics.median(sum(r[at]) for r in rounds) * 1e3
        print(f"{name:18s}{parts[0]:10.1f}{parts[1]:10.1f}{both:10.1f}")
    ratio = statistics.median(sum(r[1]) / sum(r[0]) for r in rounds)
    print(f"torch operations / C kernels (sketch + estimate, per round): {ratio:.1f}x")


if __name__ == "__main__":
    main()
