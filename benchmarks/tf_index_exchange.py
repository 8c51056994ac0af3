"""What the TensorFlow compressor's three ways of sharing the leader's indices cost in time: one
broadcast per possible root under ``tf.switch_case`` (``index_exchange="broadcast"``, the default)
against a Sum-allreduce where non-leaders contribute zeros (``"allreduce"``: twice the index bytes on
the wire, a ring allreduce of B bytes sending 2 (n - 1) / n B per worker against a broadcast's
(n - 1) / n B on average, as ``hvd_scalecom.traffic`` counts them) and an allgather to which only the
leader contributes (``"allgather"``: a broadcast's bytes, in one op whatever the leader, which
Horovod fuses with the other allgathers ready at the same time). Writes ``docs/tf_index_exchange.md``.

    .venv/bin/python -m benchmarks.tf_index_exchange            # 2 and 3 workers, 3 epochs, 3 repeats
    .venv/bin/python -m benchmarks.tf_index_exchange --smoke    # 2 workers, 1 epoch, 1 repeat

Each job is ``horovodrun -np N`` of ``examples/tensorflow_scalecom.py --epochs E --index-exchange X``
(the digits MLP, ScaleCom at ratio 0.01); the settings alternate, and the table gives the median
training time of each and its ratio to the broadcast's. All compute the same update (the tests check
each against the reference), so the accuracy is printed only as a check.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from benchmarks._report import COUNT, command_line, output_file, output_path, write_text
from devtools.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tensorflow_scalecom.py")
MODES = ("broadcast", "allreduce", "allgather")


def job(workers, mode, epochs):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        run([EXAMPLE, "--compression", "scalecom", "--epochs", str(epochs), "--index-exchange", mode,
             "--result", path], np=workers, timeout=1800)
        with open(path) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="2 workers, 1 epoch, 1 repeat (where not given)")
    ap.add_argument("--workers", type=COUNT, nargs="+", default=None, help="default 2 3; 2 with --smoke")
    ap.add_argument("--epochs", type=COUNT, default=None, help="default 3; 1 with --smoke")
    ap.add_argument("--repeats", type=COUNT, default=None, help="default 3; 1 with --smoke")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/tf_index_exchange.md (a temporary file in --smoke)")
    args = ap.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "tf_index_exchange.md")
    # (--smoke sets what is not given: an option given with it is not ignored)
    args.workers = args.workers or ([2] if args.smoke else [2, 3])
    args.epochs = args.epochs or (1 if args.smoke else 3)
    args.repeats = args.repeats or (1 if args.smoke else 3)
    rows = []
    for workers in args.workers:
        times = {m: [] for m in MODES}
        results = {}
        for _ in range(args.repeats):
            for mode in MODES:
                r = job(workers, mode, args.epochs)
                times[mode].append(r["seconds"])
                results[mode] = r
                print(f"{workers} workers {mode:9s} {r['seconds']:7.2f} s  accuracy "
                      f"{100 * r['accuracy']:.2f}%", flush=True)
        med = {m: statistics.median(times[m]) for m in MODES}
        rows.append({"workers": workers, "median_seconds": med, "seconds": times,
                     "accuracy": {m: results[m]["accuracy"] for m in MODES}})
    command = command_line("tf_index_exchange", argv)
    lines = [
        "# TensorFlow: broadcast under tf.switch_case against an index allreduce and an allgather",
        "",
        f"Made by `{command}`: `horovodrun -np N` of `examples/tensorflow_scalecom.py --epochs "
        f"{args.epochs}` (digits MLP, ScaleCom at ratio 0.01, one thread per worker, Gloo) with each "
        f"`index_exchange`, alternating, {args.repeats} run(s) of each; training time as the example "
        "measures it (its epochs, evaluation included), median over runs; all settings compute the "
        "same update.",
        "",
        "| workers | broadcast (switch_case), s | allreduce, s | allgather, s | allreduce / broadcast | "
        "allgather / broadcast | runs (broadcast; allreduce; allgather) | accuracy (broadcast, allreduce, allgather) |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        med = r["median_seconds"]
        runs = "; ".join(", ".join(f"{x:.1f}" for x in r["seconds"][m]) for m in MODES)
        accuracy = ", ".join(f"{100 * r['accuracy'][m]:.2f}%" for m in MODES)
        lines.append(f"| {r['workers']} | {med['broadcast']:.2f} | {med['allreduce']:.2f} | {med['allgather']:.2f} | "
                     f"{med['allreduce'] / med['broadcast']:.2f}x | {med['allgather'] / med['broadcast']:.2f}x | "
                     f"{runs} | {accuracy} |")
    write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
