"""ScaleCom's per-tensor compute (compress + decompress) against the memory-bandwidth floor; writes
the "Kernels" section of docs/performance.md and docs/kernels.png (the ratios to the floor).

    .venv/bin/python -m benchmarks.kernels            # 1M and 25M entries, ratios 0.01 and 0.001
    .venv/bin/python -m benchmarks.kernels --environments default 'without AVX-512'   # the page's run
    .venv/bin/python -m benchmarks.kernels --smoke    # two small tensors (1e5 and 2^19), two rounds

One thread (as each Horovod worker here), fp32 gradient ``g`` and residue memory ``m``:

* floor: ``m.add_(g, alpha=beta)``, one pass reading g and m and writing m (12 bytes per entry),
  the least any error-feedback scheme must do;
* fused pass: ``m = m + beta g`` and ``g = 0`` in one pass (``hsc_fused_pass``, a plain C loop the
  compiler vectorizes), reading m and g and writing both (16 bytes per entry): the least any
  compress + decompress moves under Horovod's contract, which also hands back a dense gradient;
* leader / non-leader: the ``clt_k`` calls ``ScaleCom.compress`` and ``decompress`` make for one
  tensor, without the communication. The leader: ``select_and_take`` (threshold top-k with ``p[I]``
  and the finiteness of g, one read-only pass), then ``filter_and_scatter_`` (the memory update and
  the reduced values written over zeros into g, one pass in place, I found again from the
  selection's cut from 2^22 entries on). A non-leader, on
  tensors of ``clt_k._ADVANCE_MIN_NUMEL`` entries or more: ``take_advancing_`` (the new memory
  written over g as m and g are read), then ``filter_and_scatter_advanced`` (the buffers traded,
  the reduced values written over zeros into the old memory's); on smaller ones, and in the *in
  place* column at every size, ``take_checking`` then ``filter_and_scatter_``. With the C kernels
  (the default on contiguous fp32 CPU tensors) and with torch operations
  (``HVD_SCALECOM_NATIVE=0``, and CUDA).

Each variant runs once per round (15 rounds; 60 for tensors of up to 2^22 entries), in turn, on the
same inputs (restored before every call, untimed), each timed call right after an untimed one of
the same variant (so that none starts from caches another variant left: see
``benchmarks._report.interleaved``); a ratio is taken to the floor of the same round, and the
table gives medians over rounds. Each environment of ``--environments`` measures the sizes in a
child process: ``default``; ``THP_MEM_ALLOC_ENABLE=1`` (PyTorch's CPU allocator then uses
transparent huge pages); ``without AVX-512`` (the C kernels built with ``-mno-avx512f``, through
``HVD_SCALECOM_CFLAGS``: the loops CPUs without AVX-512 run).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

import torch

from benchmarks._report import (
    COUNT,
    RATIO,
    interleaved,
    number,
    output_file,
    output_path,
    replace_section,
    shown_arguments,
)
from hvd_scalecom import native
from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.native import torch_operations
from hvd_scalecom.torch import clt_k

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BETA = 0.1
FUSED = "fused pass"  # the second floor: m += beta g and g = 0 in one pass (hsc_fused_pass, in C)
ENVIRONMENTS = {"default": {}, "THP_MEM_ALLOC_ENABLE=1": {"THP_MEM_ALLOC_ENABLE": "1"},
                "without AVX-512": {"HVD_SCALECOM_CFLAGS": "-mno-avx512f"}}


def make_inputs(numel, seed=0):
    """Gradient-like data: Gaussian entries whose scale is log-normal per block of 256 (rows of a
    layer differ), and a residue memory drawn the same way at half the scale."""
    gen = torch.Generator().manual_seed(seed)

    def draw(scale):
        blocks = torch.exp(0.7 * torch.randn(numel // 256 + 1, generator=gen))
        return scale * torch.randn(numel, generator=gen) * blocks.repeat_interleave(256)[:numel]

    return draw(1.0), draw(0.5)


def measure(numel, ratio, rounds, with_exact=True):
    lib = native.library()
    if lib is None:
        raise RuntimeError("benchmarks.kernels measures the C kernels: none could be built (or HVD_SCALECOM_NATIVE=0)")
    k = ScaleComConfig(ratio=ratio).num_selected(numel)
    g0, m0 = make_inputs(numel)
    g, m = g0.clone(), m0.clone()
    scratch = torch.empty(numel)

    def restore():
        m.copy_(m0)
        g.copy_(g0)

    p0 = m0 + g0
    exact = clt_k.select_top_k(p0, k, "exact")
    fast = clt_k.select_top_k(p0, k, "threshold")
    with torch_operations():
        torch_fast = clt_k.select_top_k(p0, k, "threshold")
    assert torch.equal(fast.sort().values, torch_fast.sort().values), "the C and torch selections differ"
    overlap = torch.isin(fast, exact).sum().item() / k
    received = fast.to(torch.int32)  # as a non-leader receives them
    marks = clt_k.Marks(numel)  # kept by ScaleCom per parameter, from compress to decompress

    def leader(selection="threshold", cut=True):
        # I in the broadcast's dtype, as ScaleCom asks for it
        indices, taken = clt_k.select_and_take(m, g, k, selection, scratch=scratch, index_dtype=torch.int32)
        if not cut:  # decompress marks I from the indices, as without AVX-512
            taken = taken._replace(cut=None)
        return clt_k.filter_and_scatter_(m, g, indices, taken.values, taken, taken.values, BETA)

    def non_leader(received=received, in_place=False):
        """As ScaleCom does on a rank that did not select (the buffers of m and g traded where
        ``may_advance``; ``m`` and ``g`` are restored before every call, whichever buffer is which)."""
        if not in_place and clt_k.may_advance(m, g):  # the int32 indices as received
            taken = clt_k.take_advancing_(m, g, received, BETA, marks)
            return clt_k.filter_and_scatter_advanced(m, g, received, taken.values, taken, taken.values, BETA, marks)
        indices = received.to(torch.int64)
        taken = clt_k.take_checking(m, g, indices)
        return clt_k.filter_and_scatter_(m, g, indices, taken.values, taken, taken.values, BETA)

    advancing = clt_k.may_advance(m, g)
    passes = (m.data_ptr(), g.data_ptr(), received.data_ptr(), marks.bits.data_ptr(), torch.empty(k))
    # (the timed calls below do not check hsc_mark's status: the indices must be marked as they are)
    assert not advancing or lib.hsc_mark(passes[2], 0, k, numel, passes[3]) == 0, "unmarkable indices"

    def non_leader_c_passes():
        """The non-leader's three C calls with their pointers resolved once: no Python around them."""
        mp, gp, ip, bits, values = passes
        lib.hsc_mark(ip, 0, k, numel, bits)
        lib.hsc_take_advancing(mp, gp, numel, BETA, 1.0 - BETA, bits, values.data_ptr())
        lib.hsc_scatter_if_finite(mp, gp, numel, bits, values.data_ptr(), k)

    def with_torch_operations(run, *args):
        def wrapped():
            with torch_operations():
                return run(*args)
        return wrapped

    def torch_selection():
        with torch_operations():
            return clt_k.select_top_k(p0, k, "threshold")

    variants = {
        "floor": lambda: m.add_(g, alpha=BETA),
        FUSED: lambda: lib.hsc_fused_pass(m.data_ptr(), g.data_ptr(), numel, BETA),
        "leader": leader,
        "leader, I from the indices": lambda: leader(cut=False),
        "non-leader": non_leader,
        "non-leader, k = 0": lambda: non_leader(received[:0]),
        **({"non-leader, C passes alone": non_leader_c_passes} if advancing else {}),
        "gradient write alone": lambda: g.zero_(),
        "non-leader, in place": lambda: non_leader(in_place=True),
        "leader, torch operations": with_torch_operations(leader),
        "non-leader, torch operations": with_torch_operations(non_leader),
        "selection (threshold, C)": lambda: clt_k.select_top_k(p0, k, "threshold"),
        "selection (threshold, torch)": torch_selection,
    }
    if with_exact:
        variants["leader, torch operations, exact top-k"] = with_torch_operations(leader, "exact")
        variants["selection (exact)"] = lambda: clt_k.select_top_k(p0, k, "exact")
    results = interleaved(variants, rounds, ("floor", FUSED), prepare=restore)
    floor_seconds = results["floor"][0]
    best_floor, best_fused = results["floor"][2], results[FUSED][2]
    return {"numel": numel, "ratio": ratio, "k": k, "overlap": overlap, "floor_ms": 1e3 * floor_seconds,
            "floor_gbps": 12 * numel / floor_seconds / 1e9,
            "ms": {name: 1e3 * s for name, (s, _, _) in results.items()},
            "x": {name: r["floor"] for name, (_, r, _) in results.items()},
            "best_x": {name: b / best_floor for name, (_, _, b) in results.items()},
            "x_fused": {name: r[FUSED] for name, (_, r, _) in results.items()},
            "best_x_fused": {name: b / best_fused for name, (_, _, b) in results.items()}}


def child(args):
    torch.set_num_threads(1)
    rows = [measure(numel, ratio, rounds_for(numel, args), with_exact=not args.smoke)
            for numel in args.sizes for ratio in args.ratios]
    print("RESULT " + json.dumps(rows), flush=True)


def rounds_for(numel, args):
    """Tensors that fit in the caches take well under a millisecond and vary the most: 4x the rounds."""
    return args.rounds * (4 if numel <= 1 << 22 and not args.smoke else 1)


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


def markdown(rows, command, load, figure=None):
    def fmt(r, name, against=""):
        x, best = r["x" + against], r["best_x" + against]
        return f"{x[name]:.2f}x ({best[name]:.2f}x)" if name in x else "n/a"

    lines = [
        "## Kernels: compress + decompress of one tensor against the bandwidth floor",
        "",
        f"Made by `{command}`: one thread, fp32 gradient and memory, beta 0.1, gradient-like synthetic",
        "data (Gaussian entries, log-normal scale per 256-entry block). The floor is `m.add_(g)` (reads",
        "g and m, writes m in place); ratios are medians of per-round ratios to the floor measured in the",
        "same round; each cell gives the median ratio (the best round's time over the best floor). Every",
        "call starts from the inputs just restored (the tensors of 1M entries then sit in the caches) and",
        "is timed right after an untimed call of the same variant, the floor's included.",
        "*Leader* and *non-leader* are the `clt_k` calls `ScaleCom.compress` + `decompress` make for one",
        "tensor, without the communication, by default with the C kernels of `hvd_scalecom.native`.",
        "The leader: compress is one read-only pass (the threshold selection takes `p[I]` and checks",
        "that g is finite as it reads m and g), decompress one pass in place (the memory update, and the",
        "reduced values written over zeros into g; I as a bitmap marked from the indices, or from 2^22",
        "entries on, found again from `|m + g|` and the selection's k-th magnitude, no index read). A",
        "non-leader, on tensors of 2^19 entries or",
        "more: compress is one pass that reads m and g, checks g, takes `p[I]` and writes the new",
        "memory over g; decompress writes the reduced values over zeros into m's buffer (streaming",
        "stores from 2^22 entries on), and the two",
        "buffers trade places (12 + 4 bytes per entry). *Non-leader, in place*, and a non-leader on",
        "smaller tensors: compress reads g (finiteness, `m[I]`, `p[I]`), decompress updates m and writes",
        "the gradient into g in place (4 + 16 bytes). *Non-leader, k = 0*: the non-leader's calls with",
        "no indices. *Non-leader, C passes alone*: its three C calls (marking I, the pass of compress,",
        "the pass of decompress) with their pointers resolved once, no Python around them (on tensors of",
        "2^19 entries or more). *Leader, I from the indices*: its decompress marks I from the indices at every",
        "size (as the C kernels built without AVX-512 do). *Gradient write alone*: `g.zero_()`, the writing of a "
        "dense tensor of the",
        "gradient's size that `decompress` owes Horovod on top of the floor's traffic.",
        "*Torch operations*: the same steps as torch calls, the path taken with",
        "`HVD_SCALECOM_NATIVE=0` and on CUDA. All paths give bit-identical results (`tests/test_native.py`).",
        "Overlap: share of the exact top-k (`torch.topk` of `|p|`) that the `threshold` selection finds",
        "(both paths find the same set).",
        f"Load average of this 2-core machine: {load[0]:.1f} at the start, {load[1]:.1f} at the end.",
        "",
        "| entries | ratio | environment | floor | floor GB/s | leader | leader, I from the indices | non-leader | "
        "non-leader, k = 0 | non-leader, C passes alone | gradient write alone | non-leader, in place | "
        "leader, torch operations | non-leader, torch operations | leader, torch operations, exact top-k | "
        "overlap |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | {r['floor_ms']:.2f} ms | "
            f"{r['floor_gbps']:.1f} | {fmt(r, 'leader')} | {fmt(r, 'leader, I from the indices')} | "
            f"{fmt(r, 'non-leader')} | "
            f"{fmt(r, 'non-leader, k = 0')} | {fmt(r, 'non-leader, C passes alone')} | "
            f"{fmt(r, 'gradient write alone')} | {fmt(r, 'non-leader, in place')} | "
            f"{fmt(r, 'leader, torch operations')} | {fmt(r, 'non-leader, torch operations')} | "
            f"{fmt(r, 'leader, torch operations, exact top-k')} | {r['overlap']:.4f} |")
    lines += [
        "",
        "Against the *fused pass* (`m = m + beta g` and `g = 0` in one pass, a plain C loop: reads m and",
        "g and writes both, 16 bytes per entry, the least any compress + decompress moves under",
        "Horovod's contract, which also hands back a dense gradient), measured in the same rounds:",
        "",
        "| entries | ratio | environment | fused pass / floor | leader | non-leader | non-leader, k = 0 |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | {fmt(r, FUSED)} | "
            + " | ".join(fmt(r, name, "_fused") for name in ("leader", "non-leader", "non-leader, k = 0")) + " |")
    lines += [
        "",
        "The selection alone (on a given `p`), against the floor:",
        "",
        "| entries | ratio | environment | threshold, C | threshold, torch | exact (`torch.topk`) |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | "
            f"{fmt(r, 'selection (threshold, C)')} | {fmt(r, 'selection (threshold, torch)')} | "
            f"{fmt(r, 'selection (exact)')} |")
    lines.append("")
    lines.append("Milliseconds (medians):")
    lines.append("")
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    lines.append("| entries | ratio | environment | " + " | ".join(names) + " |")
    lines.append("|---:|---:|---|" + "---:|" * len(names))
    for r in rows:
        lines.append(f"| {r['numel']:,} | {r['ratio']:g} | {r['environment']} | "
                     + " | ".join(f"{r['ms'][n]:.2f}" if n in r["ms"] else "n/a" for n in names) + " |")
    if figure:
        lines += ["", f"![compress + decompress against the floor]({figure})"]
    return "\n".join(lines) + "\n"


PLOTTED = {FUSED: ("dimgray", None), "leader": ("tab:red", 3.0), "non-leader": ("tab:blue", 1.5),
           "leader, torch operations": ("salmon", None), "non-leader, torch operations": ("lightblue", None)}


def plot_rows(rows, path):
    """Median ratios to the floor per tensor size and ratio (log scale), with the targets as lines; the
    fused pass's bar is the least a compress + decompress can cost."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5 + 1.7 * len(rows), 4))
    width = 0.8 / len(PLOTTED)
    for i, (name, (color, _)) in enumerate(PLOTTED.items()):
        ax.bar([j + i * width for j in range(len(rows))], [r["x"][name] for r in rows], width, color=color,
               label="fused pass (m and g read and written)" if name == FUSED else name)
    for name, (color, target) in PLOTTED.items():
        if target:
            ax.axhline(target, color=color, linestyle="--", linewidth=1, label=f"{name} target ({target:g}x)")
    ax.axhline(1.0, color="black", linewidth=1, label="floor (m += beta g)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['numel']:,} entries\nratio {r['ratio']:g}"
                        + ("" if r["environment"] == "default" else f"\n{r['environment']}") for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("compress + decompress / floor (median)")
    ax.set_title("One tensor's compute against the bandwidth floor (one thread)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="two small tensors (1e5 and 2^19 entries), two rounds")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/performance.md (a temporary file in --smoke)")
    ap.add_argument("--plot", type=output_file, default=None,
                    help="PNG path (default: docs/kernels.png; none in --smoke)")
    ap.add_argument("--rounds", type=COUNT, default=None)
    ap.add_argument("--sizes", type=number(int, minimum=1024), nargs="+", default=None)
    ap.add_argument("--ratios", type=RATIO, nargs="+", default=[0.01, 0.001])
    ap.add_argument("--environments", nargs="+", default=["default"], choices=list(ENVIRONMENTS))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.sizes is None:
        args.sizes = [100_000, 1 << 19] if args.smoke else [1_048_576, 25_000_000]  # (2^19: buffers traded)
    if args.rounds is None:
        args.rounds = 2 if args.smoke else 15
    if args.child:
        return child(args)
    args.out = output_path(args.out, args.smoke, "performance.md")  # (not in the child: it writes nothing)
    rows = []
    load = [os.getloadavg()[0]]
    for env_name in (args.environments[:1] if args.smoke else args.environments):
        for r in run_environment(env_name, args):
            rows.append(r)
            print(f"{r['numel']:>11,} ratio {r['ratio']:<6g} {env_name:24s} floor {r['floor_ms']:7.2f} ms "
                  f"({r['floor_gbps']:5.1f} GB/s)  leader {r['x']['leader']:5.2f}x  non-leader "
                  f"{r['x']['non-leader']:5.2f}x (k=0 {r['x']['non-leader, k = 0']:4.2f}x, "
                  f"in place {r['x']['non-leader, in place']:4.2f}x)  "
                  f"vs fused pass ({r['x'][FUSED]:4.2f}x): leader {r['x_fused']['leader']:5.2f}x non-leader "
                  f"{r['x_fused']['non-leader']:5.2f}x  torch: leader {r['x']['leader, torch operations']:5.2f}x"
                  f"  non-leader {r['x']['non-leader, torch operations']:5.2f}x  overlap {r['overlap']:.4f}",
                  flush=True)
    shown = shown_arguments(sys.argv[1:] if argv is None else argv)
    command = shlex.join(["python", "-m", "benchmarks.kernels", *shown])
    load.append(os.getloadavg()[0])
    plot = None if args.smoke and args.plot is None else (args.plot or os.path.join(ROOT, "docs", "kernels.png"))
    if plot:
        plot_rows(rows, plot)
    replace_section(args.out, "kernels", markdown(rows, command, load, plot and os.path.basename(plot)))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
