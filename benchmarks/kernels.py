"""ScaleCom's per-tensor compute (compress + decompress) against the memory-bandwidth floor; writes
the "Kernels" section of docs/performance.md.

    .venv/bin/python -m benchmarks.kernels            # 1M and 25M entries, ratios 0.01 and 0.001
    .venv/bin/python -m benchmarks.kernels --smoke    # one small tensor, two rounds

One thread (as each Horovod worker here), fp32 gradient ``g`` and residue memory ``m``:

* floor: ``m.add_(g, alpha=beta)``, one pass reading g and m and writing m (12 bytes per entry),
  the least any error-feedback scheme must do;
* leader: ``p = m + g`` (reused scratch buffer), top-k indices of ``|p|``, ``v = p[I]``, the
  finiteness check, the low-pass memory update, and the values written over zeros into the
  gradient's storage (``clt_k`` as the compressor calls it);
* non-leader: the same without ``p`` and the selection.

Each variant runs once per round, in turn, on the same inputs (restored before every call, untimed);
a ratio is taken to the floor of the same round, and the table gives medians over rounds. Fresh
dense tensors of 100 MB page-fault on every allocation with glibc's default malloc, so every size is
also measured in a child process started with ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator
then uses transparent huge pages), and the variants that allocate (as the compressor once did)
are kept for comparison.
"""

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from benchmarks import _native
from benchmarks._report import interleaved, replace_section
from hvd_scalecom.torch import clt_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA = 0.1
ENVIRONMENTS = {"default": {}, "THP_MEM_ALLOC_ENABLE=1": {"THP_MEM_ALLOC_ENABLE": "1"}}


def previous_threshold(p, k):
    """The "threshold" selection as it was before this benchmark (commit f3b8476), for comparison:
    ``|p|`` materialised, a strided sample, and ``nonzero`` over the whole tensor."""
    magnitude = p.abs()
    stride = p.numel() // 16384
    sample = magnitude[::stride]
    want = min(sample.numel(), max(1, math.ceil(1.3 * k * sample.numel() / p.numel()) + 2))
    threshold = torch.topk(sample, want, sorted=False).values.min()
    candidates = torch.nonzero(magnitude >= threshold).reshape(-1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


def make_inputs(numel, seed=0):
    """Gradient-like data: Gaussian entries whose scale is log-normal per block of 256 (rows of a
    layer differ), and a residue memory drawn the same way at half the scale."""
    gen = torch.Generator().manual_seed(seed)

    def draw(scale):
        blocks = torch.exp(0.7 * torch.randn(numel // 256 + 1, generator=gen))
        return scale * torch.randn(numel, generator=gen) * blocks.repeat_interleave(256)[:numel]

    return draw(1.0), draw(0.5)


def measure(numel, ratio, rounds, with_exact=True):
    k = max(1, math.ceil(ratio * numel))
    g0, m0 = make_inputs(numel)
    g, m = g0.clone(), m0.clone()
    scratch = torch.empty(numel)

    def restore():
        m.copy_(m0)
        g.copy_(g0)

    p0 = m0 + g0
    exact = clt_k.select_top_k(p0, k, "exact")
    fast = clt_k.select_top_k(p0, k, "threshold")
    overlap = torch.isin(fast, exact).sum().item() / k
    previous_overlap = torch.isin(previous_threshold(p0, k), exact).sum().item() / k
    indices = fast.clone()

    def finish(chosen, into):
        """What every rank does after the selection, as ``ScaleCom.compress``/``decompress`` call it:
        k-sized gathers, the finiteness check over g, the memory update, the scatter."""
        chosen = chosen.to(torch.int64)
        memory_at, values = clt_k.take(m, g, chosen)
        finite = torch.isfinite(torch.sum(g, dtype=torch.float32))
        clt_k.filter_memory_(m, g, chosen, memory_at, values, values, BETA)
        if into:
            return clt_k.scatter_dense_(g, values, chosen), finite
        return clt_k.scatter_dense(values, chosen, numel, g.dtype), finite

    def leader(selection, into=True):
        def run():
            if into:
                p = clt_k.error_compensated_into(scratch, m, g)
            else:
                p = clt_k.error_compensated(m, g)
            chosen = previous_threshold(p, k) if selection == "previous" else \
                clt_k.select_top_k(p, k, selection)
            del p
            return finish(chosen, into)
        return run

    def non_leader(into=True):
        def run():
            return finish(indices, into)
        return run

    variants = {
        "floor": lambda: m.add_(g, alpha=BETA),
        "leader": leader("threshold"),
        "leader, fresh dense tensors": leader("threshold", into=False),
        "leader, previous threshold": leader("previous"),
        "non-leader": non_leader(),
        "non-leader, fresh dense tensors": non_leader(into=False),
        "selection (threshold)": lambda: clt_k.select_top_k(p0, k, "threshold"),
        "selection (previous threshold)": lambda: previous_threshold(p0, k),
    }
    lib = _native.load()
    if lib is not None:
        ws = _native.Workspace(numel, k)
        native_indices = _native.leader_select(lib, ws, m0, g0).clone()
        assert torch.equal(native_indices, fast.sort().values), "the C prototype's selection differs"

        def native_leader():
            chosen = _native.leader_select(lib, ws, m, g)
            values = _native.take_and_filter(lib, ws, m, g, chosen, BETA)
            return _native.scatter(lib, g, chosen, values)

        def native_non_leader():
            values = _native.take_and_filter(lib, ws, m, g, native_indices, BETA)
            return _native.scatter(lib, g, native_indices, values)

        variants["leader, C prototype"] = native_leader
        variants["non-leader, C prototype"] = native_non_leader
    if with_exact:
        variants["leader, exact selection"] = leader("exact")
        variants["selection (exact)"] = lambda: clt_k.select_top_k(p0, k, "exact")
    results = interleaved(variants, rounds, "floor", prepare=restore)
    floor_seconds = results["floor"][0]
    best_floor = results["floor"][2]
    return {"numel": numel, "ratio": ratio, "k": k, "overlap": overlap,
            "previous_overlap": previous_overlap, "floor_ms": 1e3 * floor_seconds,
            "floor_gbps": 12 * numel / floor_seconds / 1e9,
            "ms": {name: 1e3 * s for name, (s, _, _) in results.items()},
            "x": {name: r for name, (_, r, _) in results.items()},
            "best_x": {name: b / best_floor for name, (_, _, b) in results.items()}}


def child(args):
    torch.set_num_threads(1)
    rows = [measure(numel, ratio, args.rounds, with_exact=not args.smoke)
            for numel in args.sizes for ratio in args.ratios]
    print("RESULT " + json.dumps(rows), flush=True)


def run_environment(env_name, args):
    env = dict(os.environ, OMP_NUM_THREADS="1", **ENVIRONMENTS[env_name])
    cmd = [sys.executable, "-m", "benchmarks.kernels", "--child", "--rounds", str(args.rounds),
           "--sizes", *map(str, args.sizes), "--ratios", *map(str, args.ratios)]
    if args.smoke:
        cmd.append("--smoke")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    rows = json.loads(line[len("RESULT "):])
    for r in rows:
        r["environment"] = env_name
    return rows


def markdown(rows, command, load):
    def fmt(r, name):
        return f"{r['x'][name]:.2f}x ({r['best_x'][name]:.2f}x)" if name in r["x"] else "n/a"

    lines = [
        "## Kernels: compress + decompress of one tensor against the bandwidth floor",
        "",
        f"Made by `{command}`: one thread, fp32 gradient and memory, beta 0.1, gradient-like synthetic",
        "data (Gaussian entries, log-normal scale per 256-entry block). The floor is `m.add_(g)` (reads",
        "g and m, writes m); ratios are medians of per-round ratios to the floor measured in the same",
        "round. *Leader* and *non-leader* are what `ScaleCom.compress` + `decompress` do for one tensor",
        "(`p = m + g` into a reused scratch buffer, `threshold` top-k of `|p|` on the leader; then on",
        "every rank the k-sized gathers `clt_k.take`, the finiteness check (a sum over g), the memory",
        "update `clt_k.filter_memory_`, and the reduced values written over zeros into the gradient's",
        "own storage with `clt_k.scatter_dense_`), without the communication. *Fresh dense tensors*: the",
        "same with `p` and the dense result allocated at every call, as the compressor did before.",
        "Each cell: the median ratio (the best round's time over the best floor).",
        "*C prototype*: `benchmarks/_native.py`, the same steps as single streaming passes",
        "in C (not part of the package; see its docstring), without the finiteness check. Overlap: share",
        "of the exact top-k (`torch.topk` of `|p|`) that the `threshold` selection finds.",
        f"Load average of this 2-core machine (other jobs ran too): {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end.",
        "",
        "| entries | ratio | allocator | floor | floor GB/s | leader | leader, fresh dense tensors | "
        "leader, previous threshold | leader, exact top-k | leader, C prototype | non-leader | "
        "non-leader, fresh dense tensors | non-leader, C prototype | overlap |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | {r['floor_ms']:.2f} ms | "
            f"{r['floor_gbps']:.1f} | {fmt(r, 'leader')} | {fmt(r, 'leader, fresh dense tensors')} | "
            f"{fmt(r, 'leader, previous threshold')} | {fmt(r, 'leader, exact selection')} | "
            f"{fmt(r, 'leader, C prototype')} | {fmt(r, 'non-leader')} | "
            f"{fmt(r, 'non-leader, fresh dense tensors')} | {fmt(r, 'non-leader, C prototype')} | "
            f"{r['overlap']:.4f} |")
    lines += [
        "",
        "The selection alone (on a given `p`), against the same floor:",
        "",
        "| entries | ratio | allocator | threshold (now) | previous threshold | exact (`torch.topk`) | "
        "previous threshold's overlap |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | "
            f"{fmt(r, 'selection (threshold)')} | {fmt(r, 'selection (previous threshold)')} | "
            f"{fmt(r, 'selection (exact)')} | {r['previous_overlap']:.4f} |")
    lines.append("")
    lines.append("Milliseconds (medians):")
    lines.append("")
    names = [n for n in rows[0]["ms"]]
    lines.append("| entries | ratio | allocator | " + " | ".join(names) + " |")
    lines.append("|---:|---:|---|" + "---:|" * len(names))
    for r in rows:
        lines.append(f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | "
                     + " | ".join(f"{r['ms'][n]:.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one small tensor, two rounds")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "performance.md"))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--environments", nargs="+", default=list(ENVIRONMENTS), choices=list(ENVIRONMENTS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [100_000] if args.smoke else [1_048_576, 25_000_000]
    if args.rounds is None:
        args.rounds = 2 if args.smoke else 15
    if args.child:
        return child(args)
    rows = []
    load = [os.getloadavg()[0]]
    for env_name in (args.environments[:1] if args.smoke else args.environments):
        for r in run_environment(env_name, args):
            rows.append(r)
            print(f"{r['numel']:>11,} ratio {r['ratio']:<6g} {env_name:24s} floor {r['floor_ms']:7.2f} ms "
                  f"({r['floor_gbps']:5.1f} GB/s)  leader {r['x']['leader']:5.2f}x  fresh "
                  f"{r['x']['leader, fresh dense tensors']:5.2f}x  non-leader {r['x']['non-leader']:5.2f}x"
                  f"  fresh {r['x']['non-leader, fresh dense tensors']:5.2f}x"
                  f"  overlap {r['overlap']:.4f}",
                  flush=True)
    command = "python -m benchmarks.kernels" + (" --smoke" if args.smoke else "")
    load.append(os.getloadavg()[0])
    replace_section(args.out, "kernels", markdown(rows, command, load))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
