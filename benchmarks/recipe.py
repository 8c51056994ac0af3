"""Choose a recipe for the digits example: sweep :func:`benchmarks.convergence_horovod.replay`.

The replay runs ``examples/pytorch_scalecom.py`` exactly in the simulator (the same data, shards,
batch order, initial weights, SGD and ScaleCom equations as ``horovodrun -np N``), one thread, a few
CPU seconds per 4-worker run. Every run prints one JSON line; the end, a markdown table of the test
accuracy per configuration and seed, with the mean.

Settings (``--set KEY=VALUE`` fixes one, ``--grid KEY=V1,V2`` sweeps one; the defaults are the
example's): ``compression`` (scalecom, dense; both unless set), ``ratio`` (0.01), ``beta`` (0.5),
``warmup_steps`` (dense steps before ScaleCom compresses, 0), ``lr`` (per worker, 0.0125),
``lr_scaling`` (linear, sqrt), ``lr_warmup`` (steps of a linear learning-rate warm-up, 0; not an
option of the example), ``batch`` (per worker, 16), ``epochs`` (25), ``momentum`` (0.9).

The figures of docs/convergence.md's "Choosing a recipe" section::

    python -m benchmarks.recipe --workers 4 --seeds 0 1 2
    python -m benchmarks.recipe --workers 4 --seeds 0 1 2 --set batch=32 lr=0.05
    python -m benchmarks.recipe --workers 16 --seeds 0 1 2 --set batch=16 epochs=50 lr=0.025 \\
        lr_scaling=sqrt beta=0.1 warmup_steps=25
    python -m benchmarks.recipe --workers 64 --seeds 0 1 --set batch=8 epochs=125 lr=0.0125 \\
        lr_scaling=sqrt beta=0.1 warmup_steps=25

``--smoke``: 2 workers, 1 epoch, seed 0.
"""

import argparse
import itertools
import json
import math
import sys

import torch

from benchmarks._report import COUNT, NON_NEGATIVE, RATIO, number
from benchmarks.convergence_horovod import replay

# The example's defaults (tests/test_benchmarks_recipe_smoke.py checks them against its parser).
DEFAULTS = {"ratio": 0.01, "beta": 0.5, "warmup_steps": 0, "lr": 0.0125, "lr_scaling": "linear",
            "lr_warmup": 0, "batch": 16, "epochs": 25, "momentum": 0.9}


def _choice(*names):
    def parse(text):
        if text not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}")
        return text
    return parse


VALUE = {"compression": _choice("scalecom", "dense"), "ratio": RATIO, "beta": number(float, above=0, maximum=1),
         "warmup_steps": NON_NEGATIVE, "lr": number(float, above=0), "lr_scaling": _choice("linear", "sqrt"),
         "lr_warmup": NON_NEGATIVE, "batch": COUNT, "epochs": COUNT,
         "momentum": number(float, minimum=0, above=None, maximum=1)}


def setting(many):
    """An argparse ``type`` for ``KEY=VALUE`` (``many``: ``KEY=V1,V2,...``): ``(key, [values])``."""
    def parse(text):
        key, eq, values = text.partition("=")
        if not eq or key not in VALUE:
            raise argparse.ArgumentTypeError(f"{text!r}: expected KEY={'V1,V2' if many else 'VALUE'} "
                                             f"with KEY one of {', '.join(VALUE)}")
        parts = values.split(",") if many else [values]
        try:
            parsed = [VALUE[key](v) for v in parts]
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{key}: {e}") from None
        if len(set(parsed)) != len(parsed):
            raise argparse.ArgumentTypeError(f"{key}: a value is repeated in {values!r}")
        return key, parsed
    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--workers", type=COUNT, nargs="+", default=[4], help="worker counts (default: 4)")
    ap.add_argument("--seeds", type=NON_NEGATIVE, nargs="+", default=[0, 1, 2], help="seeds (default: 0 1 2)")
    ap.add_argument("--set", type=setting(False), nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="fix a setting: " + ", ".join(VALUE))
    ap.add_argument("--grid", type=setting(True), nargs="+", action="extend", default=[], metavar="KEY=V1,V2",
                    help="sweep a setting over the values given")
    ap.add_argument("--smoke", action="store_true", help="2 workers, 1 epoch, seed 0")
    args = ap.parse_args(argv)
    keys = [k for k, _ in args.set + args.grid]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        ap.error(f"--set/--grid: {', '.join(repeated)} given more than once")
    if args.smoke:
        args.workers, args.seeds = [2], [0]
        args.set = [s for s in args.set if s[0] != "epochs"] + [("epochs", [1])]
        args.grid = [g for g in args.grid if g[0] != "epochs"]
    return args


def configurations(fixed, grid):
    """Every combination of the grid's values over the fixed settings and the defaults; both
    compressions unless one is set."""
    grid = dict(grid)
    if "compression" not in fixed and "compression" not in grid:
        grid["compression"] = ["scalecom", "dense"]
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        yield {**DEFAULTS, **fixed, **dict(zip(keys, values))}, dict(zip(keys, values))


def run_one(workers, seed, config):
    result = replay(config["compression"], workers, config["epochs"], config["ratio"], config["beta"], seed=seed,
                    batch=config["batch"], lr=config["lr"], momentum=config["momentum"],
                    lr_scaling=config["lr_scaling"], warmup_steps=config["warmup_steps"],
                    lr_warmup=config["lr_warmup"])
    return {"workers": workers, "seed": seed, **config, "accuracy": result["accuracy"], "loss": result["loss"],
            "diverged": not math.isfinite(result["loss"]), "peak_lr": result["peak_lr"], "steps": result["steps"],
            "payload_bytes_total": result["payload_bytes_total"], "cpu_seconds": round(result["cpu_seconds"], 2)}


def summary(rows, fixed, seeds):
    """A markdown table: one line per worker count and configuration, accuracy per seed and mean."""
    varied = list(rows[0]["varied"])
    settings = ", ".join(f"{k}={v}" for k, v in {**DEFAULTS, **fixed}.items() if k not in varied)
    header = ["workers", *varied, *(f"seed {s}" for s in seeds), "mean"]
    lines = [f"Test accuracy (%), {settings}:", "", "| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for (workers, config), group in itertools.groupby(rows, key=lambda r: (r["workers"], r["config"])):
        accuracies = [100 * r["accuracy"] for r in group]
        cells = [str(workers), *(str(dict(config)[k]) for k in varied), *(f"{a:.1f}" for a in accuracies),
                 f"{sum(accuracies) / len(accuracies):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    fixed = {k: v[0] for k, v in args.set}
    rows = []
    for config, varied in configurations(fixed, args.grid):
        for workers in args.workers:
            for seed in args.seeds:
                line = run_one(workers, seed, config)
                print(json.dumps(line), flush=True)
                rows.append({"workers": workers, "accuracy": line["accuracy"], "varied": varied,
                             "config": tuple(varied.items())})
    rows.sort(key=lambda r: args.workers.index(r["workers"]))  # (stable: configurations keep their order)
    print()
    print(summary(rows, fixed, args.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
