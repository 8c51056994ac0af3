"""Per-tensor cost: what ScaleCom adds to each parameter's reduction on models of many small tensors,
and writes its section of docs/performance.md.

    .venv/bin/python -m benchmarks.per_tensor            # full run (about two minutes)
    .venv/bin/python -m benchmarks.per_tensor --smoke    # a few steps of a few tensors

A ``horovodrun -np 2`` job (Gloo, one thread per worker, no shaped link) times the backward pass and
``synchronize()`` of models of ``--tensors`` parameters of each size under dense, Horovod's fp16,
ScaleCom (its indices shared by an allgather, the default, or by a broadcast) and pipelined ScaleCom
(``benchmarks/_per_tensor_worker.py``), side by side in one job (taking turns step by step), and reads
ScaleCom's compute
per tensor from its ``stats()``. Then, in this process, ``benchmarks.kernels`` times the ``clt_k``
calls a leader and a non-leader make for one tensor of each size (warm, in a loop: what the
compressor costs before its bookkeeping and Horovod's collectives) and the floor, ``m.add_(g)``.
"""

import argparse
import json
import os
import sys
import tempfile

import torch

from benchmarks import kernels
from benchmarks._report import COUNT, NON_NEGATIVE, command_line, cpu, output_file, output_path, replace_section
from devtools.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_per_tensor_worker.py")
SIZES = [4096, 65536, 1 << 19]
TENSORS = [64, 32, 8]


def kernel_times(sizes, ratio, rounds):
    """``{numel: {"leader": us, "non-leader": us, "floor": us}}``: medians of the clt_k calls for one
    tensor (``benchmarks.kernels.measure``)."""
    torch.set_num_threads(1)
    out = {}
    for numel in sizes:
        ms = kernels.measure(numel, ratio, rounds, with_exact=False)["ms"]
        out[numel] = {name: 1e3 * ms[name] for name in ("leader", "non-leader", "floor")}
    return out


def markdown(result, command):
    lines = [
        "## Per-tensor cost: many small tensors",
        "",
        f"Made by `{command}`: one `horovodrun -np {result['size']}` job (Gloo, one thread per worker, "
        f"loopback, a {os.cpu_count()}-core {cpu()}), ratio {result['ratio']}, "
        f"{result['steps']} timed steps after {result['warmup']}.",
        "A step is the backward pass and `synchronize()` of a model of that many parameters of that",
        "size (each gradient a fixed random tensor), the slowest rank's time, median over the steps;",
        "the compressions take turns step by step, in a rotating order.",
        "*ScaleCom* shares the leader's indices by an allgather (the default), *ScaleCom, broadcast* by",
        "a broadcast from the leader (`index_exchange=\"broadcast\"`); in brackets the ratio to dense.",
        "*Compute per tensor*: ScaleCom's `compress` and `decompress` (from `stats()`, the waits for",
        "the leader's indices excluded), median over the steps the rank led or did not; *index wait*:",
        "a non-leader's wait for the leader's indices inside its gradient hooks, per tensor.",
        "*clt_k calls alone*: the calls each side makes for one such tensor, warm, in a loop in one",
        "process (`benchmarks.kernels`); the floor is `m.add_(g)` there.",
        "",
        "| entries | tensors | dense (ms) | fp16 | ScaleCom | ScaleCom, broadcast | ScaleCom, pipelined | "
        "compute per tensor, leader / non-leader (µs) | clt_k calls alone, leader / non-leader (µs) | "
        "floor (µs) | index wait per tensor, non-leader, allgather / broadcast (µs) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r["numel"], r["scheme"]): r for r in result["rows"]}
    for numel, tensors in zip(result["sizes"], result["tensors"]):
        dense = by_key[(numel, "dense")]["step_ms"]

        def step(scheme):
            ms = by_key[(numel, scheme)]["step_ms"]
            return f"{ms:.2f} ({ms / dense:.2f}x)"

        roles = by_key[(numel, "scalecom")]["per_tensor"]
        alone = result["kernels"][str(numel)]
        compute = " / ".join(f"{roles[r]['compute_us']:.0f}" if r in roles else "-" for r in ("leader", "non-leader"))
        wait = " / ".join(f"{by_key[(numel, s)]['per_tensor']['non-leader']['wait_us']:.0f}"
                          if "non-leader" in by_key[(numel, s)]["per_tensor"] else "-"
                          for s in ("scalecom", "scalecom, broadcast"))
        lines.append(f"| {numel:,} | {tensors} | {dense:.2f} | {step('fp16')} | {step('scalecom')} | "
                     f"{step('scalecom, broadcast')} | {step('scalecom, pipelined')} | {compute} | "
                     f"{alone['leader']:.1f} / "
                     f"{alone['non-leader']:.1f} | {alone['floor']:.1f} | {wait} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="4 tensors of 4,096 entries, 3 steps, into a temp dir")
    ap.add_argument("--steps", type=COUNT, default=None, help="timed steps (default 40; 3 with --smoke)")
    ap.add_argument("--warmup", type=NON_NEGATIVE, default=None, help="untimed steps first (default 5; 1 with --smoke)")
    ap.add_argument("--rounds", type=COUNT, default=None, help="rounds of the clt_k timing (default 400)")
    ap.add_argument("--out", type=output_file, default=None, help="markdown file (default docs/performance.md)")
    args = ap.parse_args(argv)
    sizes, tensors = ([4096], [4]) if args.smoke else (SIZES, TENSORS)
    steps = args.steps or (3 if args.smoke else 40)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    rounds = args.rounds or (5 if args.smoke else 400)
    ratio = 0.01
    with tempfile.TemporaryDirectory(prefix="per_tensor-") as tmp:
        path = os.path.join(tmp, "result.json")
        run([WORKER, path, "--sizes", *map(str, sizes), "--tensors", *map(str, tensors), "--steps", str(steps),
             "--warmup", str(warmup), "--ratio", str(ratio)], np=2, timeout=1800)
        with open(path) as f:
            result = json.load(f)
    result.update(sizes=sizes, tensors=tensors, steps=steps, warmup=warmup, ratio=ratio,
                  kernels={str(n): v for n, v in kernel_times(sizes, ratio, rounds).items()})
    text = markdown(result, command_line("per_tensor", argv))
    out = output_path(args.out, args.smoke, "performance.md")
    replace_section(out, "per_tensor", text)
    print(text, flush=True)
    print(f"per_tensor: wrote {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
