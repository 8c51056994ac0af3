"""Measure ScaleCom's options beyond the paper on the digits example (2 workers) and the selection
kernels, and write docs/options.md.

    .venv/bin/python -m benchmarks.scalecom_options            # full run (a few minutes)
    .venv/bin/python -m benchmarks.scalecom_options --smoke    # one epoch, tiny tensors

Each job runs once under horovodrun; its step time is the example's training time (its epochs,
the per-epoch evaluation included) divided by its steps. The selection kernels are timed in one
process, the two methods alternating round by round on the same tensor: medians, and the speed-up as
the median of the per-round ratios.
"""

import argparse
import inspect
import json
import os
import sys
import tempfile

import torch

from benchmarks._report import command_line, cpu, interleaved, output_file, output_path, write_text
from devtools.launch import run
from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.torch import ScaleCom, clt_k

# the index exchange the example's ScaleCom jobs use: the compressor's default
INDEX_EXCHANGE = "index " + inspect.signature(ScaleCom).parameters["index_exchange"].default
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pytorch_scalecom.py")

# (label, workers, extra arguments). At 2 workers every compressed tensor of this MLP has an even
# parameter index, so the staggered leader coincides with the cyclic one: it is compared at 3.
JOBS = [
    ("dense", 2, ["--compression", "dense"]),
    ("fp16 (Horovod's)", 2, ["--compression", "fp16"]),
    (f"ScaleCom, defaults (int32 indices, fp32 values, cyclic, threshold selection, {INDEX_EXCHANGE})", 2, []),
    ("ScaleCom, int64 indices", 2, ["--index-dtype", "int64"]),
    ("ScaleCom, fp16 values", 2, ["--value-dtype", "float16"]),
    ("ScaleCom, exact selection (torch.topk)", 2, ["--selection", "exact"]),
    ("ScaleCom, pipelined (indices one step stale)", 2, ["--pipelined"]),
    ("dense, 3 workers", 3, ["--compression", "dense"]),
    ("ScaleCom, cyclic leader, 3 workers", 3, []),
    ("ScaleCom, staggered leader, 3 workers", 3, ["--leader", "staggered"]),
]


SMOKE_JOBS = [JOBS[0], JOBS[2]]


def run_jobs(epochs, jobs=JOBS):
    rows = []
    for label, workers, extra in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "r.json")
            args = [EXAMPLE, "--epochs", str(epochs), "--result", path]
            if "--compression" not in extra:
                args += ["--compression", "scalecom"]
            run(args + extra, np=workers, timeout=900)
            with open(path) as f:
                r = json.load(f)
        r["label"] = label
        rows.append(r)
        print(f"{label:66s} accuracy {100 * r['accuracy']:6.2f}%  bytes/step {r['sent_bytes_last_step']:9,}"
              f"  {r['reduction']:5.1f}x fewer  {1e3 * r['seconds'] / r['steps']:6.2f} ms/step", flush=True)
    return rows


def time_selection(sizes, ratio=0.01, repeats=7):
    torch.set_num_threads(1)
    rows = []
    for numel in sizes:
        gen = torch.Generator().manual_seed(0)
        p = torch.randn(numel, generator=gen) + 0.1 * torch.randn(numel, generator=gen)
        k = ScaleComConfig(ratio=ratio).num_selected(numel)  # as the compressor sizes it
        results = interleaved({method: (lambda method=method: clt_k.select_top_k(p, k, method))
                               for method in ("exact", "threshold")}, repeats, ("threshold",))
        exact = set(clt_k.select_top_k(p, k, "exact").tolist())
        fast = set(clt_k.select_top_k(p, k, "threshold").tolist())
        rows.append({"numel": numel, "k": k, "exact_ms": 1e3 * results["exact"][0],
                     "threshold_ms": 1e3 * results["threshold"][0],
                     "speedup": results["exact"][1]["threshold"],  # median of per-round ratios
                     "overlap": len(exact & fast) / k})
        print(f"top-k of {numel:,}: exact {rows[-1]['exact_ms']:.1f} ms, threshold "
              f"{rows[-1]['threshold_ms']:.1f} ms, overlap {rows[-1]['overlap']:.4f}", flush=True)
    return rows


def write_markdown(jobs, selection, path, command, epochs):
    dense = {r["workers"]: r for r in jobs if r["compression"] == "dense"}
    lines = [
        "# ScaleCom options beyond the paper, measured",
        "",
        f"Made by `{command}` (Gloo workers on one {os.cpu_count()}-core machine, {cpu()}, one thread",
        "each; digits MLP of",
        f"167,178 parameters, ratio 0.01, beta 0.5, {epochs} epoch{'s' if epochs > 1 else ''}). Bytes are "
        "what this rank handed to",
        "Horovod in the last step (values + indices + dense small tensors); the reduction is over the",
        "whole run. Step times are one run's training time (per-epoch evaluation included) over its steps,",
        "with the leader's index exchanges; they are noisy on this shared machine and only comparable",
        "within this table; each is also given relative to the dense job with the same number of workers.",
        "",
        "| configuration | workers | test accuracy | bytes/step | fewer bytes than dense | ms/step "
        "| ms/step vs dense |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in jobs:
        ms = r["seconds"] / r["steps"]
        dense_ms = dense[r["workers"]]["seconds"] / dense[r["workers"]]["steps"]
        lines.append(f"| {r['label']} | {r['workers']} | {100 * r['accuracy']:.2f}% | "
                     f"{r['sent_bytes_last_step']:,} | {r['reduction']:.1f}x | {1e3 * ms:.2f} | "
                     f"{ms / dense_ms:.2f}x |")
    lines += ["", "## Selection kernels (one thread, ratio 0.01)", "",
              "`exact` is `torch.topk` of |p|; `threshold` (`clt_k.select_top_k`) keeps the entries "
              "above a threshold estimated from a sample and runs the exact top-k on those candidates "
              "only (falling back to exact if too few pass), so it returns the same set, up to which "
              "entries it takes among ties at the k-th magnitude (the lowest indices), where "
              "`torch.topk` may take others: the two training runs above can differ from the first "
              "such tie on. The two alternate round by round on the same tensor (medians; the "
              "speed-up is the median of the per-round ratios).", "",
              "| entries | k | exact (ms) | threshold (ms) | speed-up | overlap with exact |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in selection:
        lines.append(f"| {r['numel']:,} | {r['k']:,} | {r['exact_ms']:.1f} | {r['threshold_ms']:.1f} | "
                     f"{r['speedup']:.1f}x | {r['overlap']:.4f} |")
    write_text(path, "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="one epoch and small tensors")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/options.md (a temporary file in --smoke)")
    args = ap.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "options.md")
    epochs = 1 if args.smoke else 25
    jobs = run_jobs(epochs=epochs, jobs=SMOKE_JOBS if args.smoke else JOBS)
    selection = time_selection([70_000] if args.smoke else [1 << 20, 4_200_000, 25_000_000],
                               repeats=1 if args.smoke else 7)
    command = command_line("scalecom_options", argv)
    write_markdown(jobs, selection, args.out, command, epochs)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
