"""Overhead where the network is free: ScaleCom's step against dense's on plain loopback (no shaped
link), on PyTorch and on TensorFlow, the schemes taking turns step by step in one job; writes the
"Overhead" section of docs/performance.md.

    .venv/bin/python -m benchmarks.overhead                 # ResNet-18-shaped CNN, 2 workers, both frontends
    .venv/bin/python -m benchmarks.overhead --smoke         # tiny CNN, a few steps, both frontends
    .venv/bin/python -m benchmarks.overhead --frameworks tensorflow --jobs dense 'scalecom:{"ratio": 0.01}'

Each framework is one ``horovodrun -np N`` job (Gloo, one thread per worker, ``HOROVOD_CYCLE_TIME=1``
as in ``benchmarks.slow_link``) of ``benchmarks/_overhead_worker.py``: every job of ``--jobs`` trains
its own copy of the model (``benchmarks.models``), and one more copy with no communication is the
floor. They take turns step by step, so the ratio of two schemes' steps in the same round cancels
most of what the other processes of a shared machine do to both; the table gives the median of those
ratios. On one machine the loopback costs little beside the computation: what a scheme adds here is
the time it costs where the network is free.
"""

import argparse
import json
import os
import sys

from benchmarks._report import COUNT, NON_NEGATIVE, command_line, cpu, output_file, output_path, replace_section
from benchmarks.models import MODELS, SIZES, describe
from devtools.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_overhead_worker.py")
FRAMEWORKS = ("torch", "tensorflow")
SCHEMES = ("dense", "fp16", "scalecom")
SCALECOM_DEFAULTS = {"selection": "threshold"}  # (as benchmarks.slow_link: the exact top-k set, found faster)
DEFAULT_JOBS = ["dense", "fp16", 'scalecom:{"ratio": 0.01}']


def job(text):
    """An argparse ``type``: ``NAME`` or ``NAME:JSON`` (ScaleCom's keyword arguments), NAME one of
    :data:`SCHEMES`."""
    name, colon, raw = text.partition(":")
    if name not in SCHEMES:
        raise argparse.ArgumentTypeError(f"unknown scheme {name!r} in {text!r}: NAME or NAME:JSON, NAME one of "
                                         f"{', '.join(SCHEMES)}")
    kwargs = {}
    if colon:
        try:
            kwargs = json.loads(raw)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"{raw!r} in {text!r} is not JSON ({e})") from None
        if not isinstance(kwargs, dict):
            raise argparse.ArgumentTypeError(f"{raw!r} in {text!r} must be a JSON object of keyword arguments")
        if name != "scalecom" and kwargs:
            raise argparse.ArgumentTypeError(f"{name} takes no options, got {raw}")
    return [name, {**SCALECOM_DEFAULTS, **kwargs} if name == "scalecom" else kwargs]


def label(scheme, kwargs):
    if scheme == "floor":
        return "no communication (floor)"
    if scheme == "scalecom":
        extra = {k: v for k, v in kwargs.items() if k != "ratio" and SCALECOM_DEFAULTS.get(k) != v}
        return f"ScaleCom {kwargs.get('ratio', 0.01):g}" + (f" {json.dumps(extra, sort_keys=True)}" if extra else "")
    return {"dense": "dense", "fp16": "Horovod fp16"}[scheme]


def run_framework(framework, args):
    spec = {"framework": framework, "model": args.model, "size": args.model_size, "batch": args.batch,
            "warmup": args.warmup, "steps": args.steps, "jobs": args.jobs}
    output = run([WORKER, json.dumps(spec)], np=args.workers, timeout=args.timeout,
                 env={"HOROVOD_CYCLE_TIME": "1", "PYTHONPATH": os.pathsep.join(
                     p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)})
    for line in output.splitlines():
        at = line.find("RESULT ")
        if at >= 0:
            return json.loads(line[at + len("RESULT "):])
    raise RuntimeError(f"the {framework} job printed no result:\n{output[-4000:]}")


def markdown(results, args, command):
    lines = [
        "## Overhead where the network is free: step time on plain loopback",
        "",
        f"Made by `{command}`: for each frontend one `horovodrun -np {args.workers}` job on this machine's "
        f"loopback, not shaped ({cpu()}, {os.cpu_count()} cores; Gloo, one thread per worker, "
        f"`HOROVOD_CYCLE_TIME=1`), batch {args.batch} of synthetic data per worker. Every scheme trains its "
        "own copy of the model, and a copy stepped with no communication at all is the floor; they take "
        f"turns step by step, {args.warmup} untimed rounds, then {args.steps} timed ones. A step's time "
        "is the slowest rank's, each step starting after a barrier; *vs dense* and *vs floor* are the "
        "medians over the rounds of the ratio within a round. ScaleCom runs with "
        f"`{json.dumps(SCALECOM_DEFAULTS)}` plus any options shown. PyTorch: `hvd.DistributedOptimizer`; "
        "TensorFlow: Keras 3 models through `hvd_scalecom.tensorflow.make_train_step` "
        "(`DistributedGradientTape`). Compress and index wait (PyTorch): rank 0's per step, from ScaleCom's "
        "`stats()`; TensorFlow's `stats()` times each tensor's span in the step's graph, where the "
        "tensors' work interleaves, so their sum is not a share of the step and is left out.",
    ]
    for result in results:
        lines += ["", f"### {'PyTorch' if result['framework'] == 'torch' else 'TensorFlow'}: "
                      f"{describe(result['model'], args.model_size)}, {result['workers']} workers", "",
                  "| scheme | ms/step | vs dense | vs floor | compress ms/step | index wait ms/step |",
                  "|---|---:|---:|---:|---:|---:|"]
        for row in result["rows"]:
            vs_dense = f"{row['vs_dense']:.3f}" if "vs_dense" in row else "n/a"
            comp = f"{1e3 * row['compress_seconds']:.1f}" if "compress_seconds" in row else ""
            wait = f"{1e3 * row['index_wait_seconds']:.1f}" if "index_wait_seconds" in row else ""
            lines.append(f"| {label(row['scheme'], row['kwargs'])} | {1e3 * row['median_step_seconds']:.1f} | "
                         f"{vs_dense} | {row['vs_floor']:.2f}x | {comp} | {wait} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny CNN, dense and ScaleCom 0.01, 1 warm-up and 2 timed rounds, into a temp dir")
    ap.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    ap.add_argument("--model", choices=MODELS, default="resnet18")
    ap.add_argument("--model-size", choices=SIZES, default=None, help="default: full (tiny in --smoke)")
    ap.add_argument("--jobs", type=job, nargs="+", default=None,
                    help=f"NAME or NAME:JSON, NAME one of {', '.join(SCHEMES)} (default: {' '.join(DEFAULT_JOBS)})")
    ap.add_argument("--workers", type=COUNT, default=2)
    ap.add_argument("--batch", type=COUNT, default=8, help="per worker")
    ap.add_argument("--warmup", type=NON_NEGATIVE, default=None, help="untimed rounds (default 3; 1 in --smoke)")
    ap.add_argument("--steps", type=COUNT, default=None, help="timed rounds (default 20; 2 in --smoke)")
    ap.add_argument("--timeout", type=COUNT, default=1800, help="seconds per job")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/performance.md (a temporary file in --smoke)")
    args = ap.parse_args(argv)
    args.model_size = args.model_size or ("tiny" if args.smoke else "full")
    args.jobs = args.jobs or [job(j) for j in (["dense", 'scalecom:{"ratio": 0.01}'] if args.smoke else DEFAULT_JOBS)]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    args.steps = args.steps or (2 if args.smoke else 20)
    if len({json.dumps(j, sort_keys=True) for j in args.jobs}) < len(args.jobs):
        ap.error("argument --jobs: a job is given twice")
    results = []
    for framework in args.frameworks:
        result = run_framework(framework, args)
        results.append(result)
        for row in result["rows"]:
            print(f"{framework:10s} {label(row['scheme'], row['kwargs']):28s} "
                  f"{1e3 * row['median_step_seconds']:8.1f} ms/step  vs dense {row.get('vs_dense', float('nan')):.3f}"
                  f"  vs floor {row['vs_floor']:.2f}x", flush=True)
    out = output_path(args.out, args.smoke, "performance.md")
    replace_section(out, "overhead", markdown(results, args, command_line("overhead", argv)))
    print(f"overhead: wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
