"""The PyTorch and TensorFlow examples side by side over several seeds: does ScaleCom on TensorFlow
reach the accuracy and traffic of ScaleCom on PyTorch, within the seed-to-seed noise? Writes
``docs/frontends.md``.

    .venv/bin/python -m benchmarks.frontends                 # seeds 0-4, ScaleCom, 2 workers
    .venv/bin/python -m benchmarks.frontends --dense         # and each dense, for comparison
    .venv/bin/python -m benchmarks.frontends --smoke         # one seed, 1 epoch, ScaleCom only
    .venv/bin/python -m benchmarks.frontends --report-only   # rewrite docs/frontends.md from its JSON

Each job is ``horovodrun -np 2`` of ``examples/pytorch_scalecom.py`` or
``examples/tensorflow_scalecom.py`` with its defaults (25 epochs of the digits MLP) and ``--seed``.
The two frameworks draw different initial weights and batch orders from the same seed, so a pair
of runs is not expected to agree; the seeds give the spread to compare the difference against.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks._report import NON_NEGATIVE, command_line, output_file, output_path, write_text
from devtools.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {"pytorch": "pytorch_scalecom.py", "tensorflow": "tensorflow_scalecom.py"}


def run_example(framework, compression, seed, epochs):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        args = [os.path.join(ROOT, "examples", EXAMPLES[framework]), "--compression", compression,
                "--seed", str(seed), "--result", path]
        if epochs is not None:
            args += ["--epochs", str(epochs)]
        run(args, np=2, timeout=1800)
        with open(path) as f:
            return json.load(f)


def summary(values):
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else float("nan")
    return mean, sd


def markdown(rows, seeds, command, epochs=25):
    by = {}
    for r in rows:
        by.setdefault((r["framework"], r["compression"]), []).append(r)
    lines = [
        "# ScaleCom on PyTorch and on TensorFlow",
        "",
        f"Made by `{command}`: `horovodrun -np 2` of each example with its defaults (digits MLP, "
        f"167,178 parameters, {epochs} epoch{'s' if epochs > 1 else ''}, ratio 0.01, beta 0.5), "
        f"seeds {', '.join(map(str, seeds))}. "
        "The frameworks draw different initial weights and batch orders from the same seed, so runs "
        "are compared through their spread over seeds, not pair by pair.",
        "",
        "| framework | compression | test accuracy per seed | mean | sd | gradient bytes, fewer than dense |",
        "|---|---|---|---:|---:|---:|",
    ]
    for (framework, compression), runs in sorted(by.items()):
        accs = [100 * r["accuracy"] for r in runs]
        mean, sd = summary(accs)
        reductions = sorted({round(r["reduction"], 1) for r in runs})
        lines.append(f"| {framework} | {compression} | {', '.join(f'{a:.2f}%' for a in accs)} | "
                     f"{mean:.2f}% | {sd:.2f} | {', '.join(f'{x:.1f}x' for x in reductions)} |")
    pt = [100 * r["accuracy"] for r in by.get(("pytorch", "scalecom"), [])]
    tf = [100 * r["accuracy"] for r in by.get(("tensorflow", "scalecom"), [])]
    if len(pt) > 1 and len(tf) > 1:
        diff = statistics.fmean(tf) - statistics.fmean(pt)
        se = (statistics.variance(tf) / len(tf) + statistics.variance(pt) / len(pt)) ** 0.5
        lines += ["", f"ScaleCom, TensorFlow minus PyTorch: {diff:+.2f} points of mean accuracy, with a "
                      f"standard error of {se:.2f} points ({abs(diff) / se:.1f} standard errors)."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="seed 0, 1 epoch (unless --seeds; --dense still adds dense)")
    ap.add_argument("--seeds", type=NON_NEGATIVE, nargs="+", default=None,
                    help="default 0 1 2 3 4; 0 with --smoke")
    ap.add_argument("--dense", action="store_true", help="also run each example dense")
    ap.add_argument("--report-only", action="store_true", help="rewrite the page from its JSON")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/frontends.md (a temporary file in --smoke)")
    args = ap.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "frontends.md")
    # (--smoke sets what is not given: an option given with it is not ignored)
    seeds = args.seeds or ([0] if args.smoke else [0, 1, 2, 3, 4])
    epochs = 1 if args.smoke else None
    schemes = ("scalecom", "dense") if args.dense else ("scalecom",)
    json_path = os.path.splitext(args.out)[0] + ".json"
    if args.report_only:
        with open(json_path) as f:
            saved = json.load(f)
        write_text(args.out, markdown(saved["rows"], saved["seeds"], saved["command"], saved.get("epochs") or 25))
        print(f"wrote {args.out} from {json_path}")
        return saved["rows"]
    rows = []
    start = time.perf_counter()
    for seed in seeds:
        for framework in EXAMPLES:
            for compression in schemes:
                r = run_example(framework, compression, seed, epochs)
                r.update(framework=framework, seed=seed)
                rows.append(r)
                print(f"seed {seed} {framework:10s} {compression:8s} accuracy {100 * r['accuracy']:6.2f}%"
                      f"  {r['reduction']:5.1f}x fewer bytes  ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    command = command_line("frontends", argv)
    write_text(args.out, markdown(rows, seeds, command, epochs or 25))  # (None: the example's default, 25)
    write_text(json_path, json.dumps({"command": command, "seeds": seeds, "epochs": epochs or 25, "rows": rows},
                                     indent=1))
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
