"""Soak: a long ScaleCom job under ``horovodrun`` whose memory must stay flat and whose residue
memories must stay bounded; writes docs/soak.json, docs/soak.png and docs/soak.md.

    nice .venv/bin/python -m benchmarks.soak --steps 6000             # -np 4, the page's run (default 2,000 steps)
    .venv/bin/python -m benchmarks.soak --smoke                       # -np 2, 20 steps, into a temp dir
    .venv/bin/python -m benchmarks.soak --framework tensorflow --steps 6000   # the Keras twin (soak_tensorflow.*)
    .venv/bin/python -m benchmarks.soak --report-only                 # markdown and figure from the JSON

The job is ``benchmarks/_soak_worker.py`` (Gloo, one thread per worker): the digits MLP of
``examples/pytorch_scalecom.py`` with ScaleCom at the example's defaults, each rank walking through
its shard. Every ``--every`` steps each rank records its RSS (``VmRSS``), ``||m||_2`` over its residue
memories (:func:`hvd_scalecom.monitor.residue_norm`), its mean loss since the last record, the count
of objects Python's garbage collector tracks (``gc.get_objects()``) and ``stats()``. Options after the soak's
own go to the example's parser.

The soak sets the example's ``--lr`` to 0.0125 (0.05 over 4 workers, :data:`EXAMPLE_ARGS`; a later
``--lr`` wins): with the example's 0.05 per worker (0.2 at 4 workers) this job diverges within 200
steps (README), and :func:`benchmarks.convergence_horovod.replay` shows the same recipe going to NaN in
the simulator around epoch 19, while 0.0125 trains stably for 2,000 steps there. A soak of a
diverged model says nothing about its residue memories, so the soak also reports whether training
made progress (every rank's final loss finite and below its first).

Figures per rank: RSS after warm-up (the first record at or after ``--warmup`` steps) against the
last one (growth in MB and %), the least-squares slope of RSS over the second half of the run, and
the residue norm's maximum, final value and last-quarter over previous-quarter mean. Verdicts:
RSS is flat when on every rank the growth is at most :data:`MAX_GROWTH_PCT` % and the slope at most
:data:`MAX_SLOPE_MB` MB per 1,000 steps; the residue norm is bounded when it is finite everywhere
and the quarter ratio is at most :data:`MAX_QUARTER_RATIO` on every rank (a norm growing linearly
from zero gives 1.4; one that has settled, about 1). ``--report-only`` derives all of these again
from the records of the JSON and rewrites it, the page and the figure.
"""

import argparse
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time

import numpy as np

from benchmarks import _report
from devtools.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_soak_worker.py")
MB = 1 << 20

MAX_GROWTH_PCT = 2.0  # RSS after warm-up to the end, per rank
MAX_SLOPE_MB = 1.0  # RSS slope over the second half, MB per 1,000 steps (about 1 KB per step)
MAX_QUARTER_RATIO = 1.2  # residue norm: mean of the last quarter over that of the previous one
EXAMPLE_ARGS = ["--lr", "0.0125"]  # put before the user's example options
# the example's options that the soak does not use (it trains ScaleCom for --steps steps, writes its own
# outputs): refused, not ignored
NOT_FOR_THE_SOAK = ("--compression", "--epochs", "--result", "--tensorboard", "--progress", "--checkpoint",
                    "--resume")


def check_example_args(framework, example_args):
    """The example options as the soak's workers will parse them, parsed here first: one the soak does
    not use, or one the example refuses, is named before ``horovodrun`` starts (SystemExit)."""
    for a in example_args:
        name = a.split("=", 1)[0]
        if name in NOT_FOR_THE_SOAK:
            raise SystemExit(f"soak: {name} is an option of the example that the soak does not use (it "
                             f"trains ScaleCom for --steps steps and writes its own outputs): leave it out")
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    if framework == "torch":
        from pytorch_scalecom import parse_args
    else:
        from tensorflow_scalecom import parse_args
    parse_args([*EXAMPLE_ARGS, *example_args])


def read_rank(path):
    """A worker's output: its first line with ``records`` (the other lines) added."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return dict(lines[0], records=lines[1:])


def rss_slope(steps, rss_mb):
    """Least-squares slope of ``rss_mb`` against ``steps``, in MB per 1,000 steps."""
    steps, rss_mb = np.asarray(steps, dtype=np.float64), np.asarray(rss_mb, dtype=np.float64)
    if len(steps) < 2:
        return 0.0
    return float(np.polyfit(steps, rss_mb, 1)[0] * 1000)


def summarize_rank(records, steps, warmup):
    """The soak figures of one rank from its records (see the module doc)."""
    at = np.array([r["step"] for r in records])
    rss = np.array([r["rss_bytes"] for r in records], dtype=np.float64) / MB
    norm = np.array([r["residue_norm"] for r in records], dtype=np.float64)
    objects = np.array([r["python_objects"] for r in records])
    warm = int(np.argmax(at >= warmup)) if (at >= warmup).any() else len(at) - 1
    half = at >= steps / 2
    last_q = (at > 3 * steps / 4) & (at <= steps)
    prev_q = (at > steps / 2) & (at <= 3 * steps / 4)
    prev_mean = float(norm[prev_q].mean()) if prev_q.any() else float("nan")
    last_mean = float(norm[last_q].mean()) if last_q.any() else float("nan")
    losses = [r["loss"] for r in records if r["loss"] is not None]
    last = records[-1]["stats"]
    rises = np.diff(rss[warm:])  # between consecutive records after warm-up
    rise_at = int(np.argmax(rises)) + warm if len(rises) else warm
    return {
        "warm_step": int(at[warm]),
        "rss_start_mb": float(rss[0]),
        "rss_warm_mb": float(rss[warm]),
        "rss_end_mb": float(rss[-1]),
        "rss_max_after_warm_mb": float(rss[warm:].max()),
        "rss_growth_mb": float(rss[-1] - rss[warm]),
        "rss_growth_pct": float(100 * (rss[-1] - rss[warm]) / rss[warm]),
        "rss_slope_mb_per_1000_steps": rss_slope(at[half], rss[half]),
        "rss_largest_rise_mb": float(rises.max()) if len(rises) else 0.0,
        "rss_largest_rise_steps": [int(at[rise_at]), int(at[min(rise_at + 1, len(at) - 1)])],
        "residue_norm_max": float(norm.max()),
        "residue_norm_final": float(norm[-1]),
        "residue_norm_quarter_ratio": _ratio(last_mean, prev_mean),
        "residue_norm_finite": bool(np.isfinite(norm).all()),
        "python_objects_warm": int(objects[warm]),
        "python_objects_end": int(objects[-1]),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "sent_bytes_last_step": last["sent_bytes"],
        "uncompressed_bytes_last_step": last["uncompressed_bytes"],
        "ratio_over_run": last["total"]["ratio"],
        "seconds": records[-1]["seconds"],
    }


def _ratio(last, previous):
    """``last / previous``; 0 when both are 0 (nothing compressed yet), inf when only the last is not."""
    if previous > 0 or not math.isfinite(previous):
        return last / previous
    return 0.0 if last == 0 else float("inf")


def verdict(ranks):
    """``(rss_flat, residue_bounded, trained)`` from the per-rank summaries."""
    flat = all(r["rss_growth_pct"] <= MAX_GROWTH_PCT and r["rss_slope_mb_per_1000_steps"] <= MAX_SLOPE_MB
               for r in ranks)
    bounded = all(r["residue_norm_finite"] and r["residue_norm_quarter_ratio"] <= MAX_QUARTER_RATIO
                  for r in ranks)
    trained = all(r["loss_last"] is not None and math.isfinite(r["loss_last"])
                  and r["loss_last"] < r["loss_first"] for r in ranks)
    return flat, bounded, trained


def machine():
    memory = None
    try:
        with open("/proc/meminfo") as f:
            memory = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    return {"cpu": _report.cpu(), "cores": os.cpu_count(), "memory_gib": None if memory is None else memory / (1 << 30),
            "os": platform.platform(), "python": platform.python_version(), "niceness": os.nice(0)}


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(7.5, 8), sharex=True)
    for rank, records in enumerate(result["records"]):
        steps = [r["step"] for r in records]
        axes[0].plot(steps, [r["rss_bytes"] / MB for r in records], label=f"rank {rank}", lw=1)
        axes[1].plot(steps[1:], [r["residue_norm"] for r in records[1:]], label=f"rank {rank}", lw=1)
        axes[2].plot(steps[1:], [r["loss"] for r in records[1:]], label=f"rank {rank}", lw=1)
    for ax in axes:
        ax.axvline(result["warmup"], color="grey", ls=":", lw=1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("RSS (MB)")
    axes[1].set_ylabel("residue norm ||m||")
    axes[1].set_yscale("log")
    axes[2].set_ylabel(f"loss (mean of {result['every']} steps)")
    axes[2].set_yscale("log")
    axes[2].set_xlabel("step")
    axes[0].legend(fontsize=7, ncol=4)
    axes[0].set_title(f"Soak: ScaleCom ({result['framework']}), horovodrun -np {result['np']}, "
                      f"{result['steps']:,} steps (dotted: end of warm-up)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(result, png_name):
    m, ranks = result["machine"], result["ranks"]
    flat, bounded, trained = result["rss_flat"], result["residue_bounded"], result["trained"]
    growth = max(r["rss_growth_mb"] for r in ranks)
    slope = max(r["rss_slope_mb_per_1000_steps"] for r in ranks)
    ratio = max(r["residue_norm_quarter_ratio"] for r in ranks)
    opts = result["options"]
    lines = [
        f"# Soak: {result['steps']:,} steps of ScaleCom ({result['framework_version'].split()[0]}) under "
        f"horovodrun -np {result['np']}",
        "",
        f"Made by `{result['command']}` (run with niceness {m['niceness']}; results in "
        f"`{result['prefix']}.json`, figure `{png_name}`; adding `--report-only` derives the figures "
        f"again from the JSON's records), {result['wall_seconds'] / 60:.1f} minutes wall. "
        f"Machine: {m['cpu']}, {m['cores']} cores"
        + (f", {m['memory_gib']:.0f} GiB" if m["memory_gib"] else "")
        + f", {m['os']}, shared with other jobs (load average {result['load'][0]:.2f} before, "
        f"{result['load'][1]:.2f} after); Python {m['python']}, {result['framework_version']}, "
        f"Horovod {result['horovod']} (Gloo), one thread per worker.",
        "",
        f"The job trains the digits MLP of `examples/{result['framework_example']}` (its model, data "
        f"and defaults, imported): ScaleCom ratio {opts['ratio']}, beta {opts['beta']}, min_numel "
        f"{opts['min_numel']}, {opts['leader']} leader, {opts['selection']} selection, batch "
        f"{opts['batch_size']} per worker, SGD lr {opts['lr']} x "
        f"{'sqrt(' + str(result['np']) + ')' if opts.get('lr_scaling') == 'sqrt' else result['np']}, momentum "
        f"{opts['momentum']}. Every {result['every']} steps each rank records its RSS (`VmRSS`), "
        f"the norm of its residue memories, its loss and `stats()`. Warm-up: the first "
        f"{result['warmup']} steps.",
        "",
        "## Verdict",
        "",
        f"* **RSS: {'flat' if flat else 'NOT flat'}.** Largest growth from the end of warm-up to "
        f"the end on any rank: {growth:+.2f} MB; largest second-half slope: {slope:+.3f} MB per "
        f"1,000 steps (thresholds: {MAX_GROWTH_PCT} % and {MAX_SLOPE_MB} MB per 1,000 steps).",
        f"* **Residue norms: {'bounded' if bounded else 'NOT bounded'}.** Largest last-quarter / "
        f"previous-quarter mean ratio on any rank: {ratio:.3f} (threshold {MAX_QUARTER_RATIO}); "
        f"{'all finite' if all(r['residue_norm_finite'] for r in ranks) else 'non-finite values seen'}.",
        f"* **Training: {'made progress' if trained else 'did NOT make progress'}.** Loss (mean over "
        f"the {result['every']} steps before a record) from the first record to the last, per rank: "
        + ", ".join(f"{r['loss_first']:.4f} to {r['loss_last']:.4g}" for r in ranks)
        + ("." if trained else "; the residue figures describe a diverged model."),
        "",
        "## Figures per rank",
        "",
        "| rank | RSS start (MB) | RSS after warm-up (MB) | RSS end (MB) | growth (MB) | growth (%) "
        "| slope, 2nd half (MB / 1,000 steps) | largest rise between two records (MB, steps) "
        "| residue norm max | final | quarter ratio "
        "| objects the garbage collector tracks, warm / end | loss first / last |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rank, r in enumerate(ranks):
        lines.append(
            f"| {rank} | {r['rss_start_mb']:.1f} | {r['rss_warm_mb']:.1f} | {r['rss_end_mb']:.1f} | "
            f"{r['rss_growth_mb']:+.2f} | {r['rss_growth_pct']:+.2f} | "
            f"{r['rss_slope_mb_per_1000_steps']:+.3f} | {r['rss_largest_rise_mb']:+.2f} "
            f"({r['rss_largest_rise_steps'][0]:,} to {r['rss_largest_rise_steps'][1]:,}) | "
            f"{r['residue_norm_max']:.4g} | "
            f"{r['residue_norm_final']:.4g} | {r['residue_norm_quarter_ratio']:.3f} | "
            f"{r['python_objects_warm']:,} / {r['python_objects_end']:,} | "
            f"{r['loss_first']:.4g} / {r['loss_last']:.4g} |")
    r0 = ranks[0]
    lines += [
        "",
        f"RSS after warm-up is the record at step {r0['warm_step']}; records come every "
        f"{result['every']} steps; the slope is a least-squares fit "
        f"over the records from step {result['steps'] // 2} on; the quarter ratio compares the mean "
        f"residue norm over steps ({3 * result['steps'] // 4}, {result['steps']}] with that over "
        f"({result['steps'] // 2}, {3 * result['steps'] // 4}]. Rank 0 handed "
        f"{r0['sent_bytes_last_step']:,} bytes to Horovod in the last step against "
        f"{r0['uncompressed_bytes_last_step']:,} dense ({r0['ratio_over_run']:.1f}x fewer over the "
        f"run), {result['steps'] / r0['seconds']:.1f} steps per second.",
        "",
        f"![RSS, residue norm and loss per rank]({png_name})",
        "",
        f"Figure made by `{result['command']}`.",
        "",
    ]
    return "\n".join(lines)


def derive(result):
    """``result`` with the per-rank figures, thresholds and verdicts computed from its records."""
    ranks = [summarize_rank(records, result["steps"], result["warmup"]) for records in result["records"]]
    flat, bounded, trained = verdict(ranks)
    derived = {"thresholds": {"max_growth_pct": MAX_GROWTH_PCT, "max_slope_mb_per_1000_steps": MAX_SLOPE_MB,
                              "max_quarter_ratio": MAX_QUARTER_RATIO},
               "rss_flat": flat, "residue_bounded": bounded, "trained": trained, "ranks": ranks}
    records = result["records"]
    return {**{k: v for k, v in result.items() if k != "records"}, **derived, "records": records}


def write_report(result, out_dir):
    """``PREFIX.json``, ``PREFIX.png`` and ``PREFIX.md`` in ``out_dir`` from a derived result."""
    prefix = result["prefix"]
    with open(os.path.join(out_dir, f"{prefix}.json"), "w") as f:
        json.dump(result, f, indent=1, allow_nan=True)
    plot(result, os.path.join(out_dir, f"{prefix}.png"))
    with open(os.path.join(out_dir, f"{prefix}.md"), "w") as f:
        f.write(markdown(result, f"{prefix}.png"))


def _shown(argv):
    """The arguments worth printing (not where the output goes)."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out-dir":
            skip = True
        elif not a.startswith("--out-dir="):
            shown.append(a)
    return shown


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="-np 2, 20 steps, output into a temp dir")
    ap.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
    ap.add_argument("--np", type=_report.COUNT, default=None, help="workers (default 4; 2 with --smoke)")
    ap.add_argument("--steps", type=_report.COUNT, default=None, help="default 2000; 20 with --smoke")
    ap.add_argument("--every", type=_report.COUNT, default=None,
                    help="record every N steps (default 20; 5 with --smoke)")
    ap.add_argument("--warmup", type=_report.NON_NEGATIVE, default=None,
                    help="steps before the RSS reference (default steps / 10)")
    ap.add_argument("--timeout", type=_report.SECONDS, default=3600)
    ap.add_argument("--out-dir", default=None, help="default docs/ (a new temp dir with --smoke)")
    ap.add_argument("--report-only", action="store_true",
                    help="derive every figure again from the JSON's records")
    args, example_args = ap.parse_known_args(argv)
    prefix = "soak" if args.framework == "torch" else "soak_tensorflow"
    if args.report_only:
        out_dir = args.out_dir or os.path.join(ROOT, "docs")
        with open(os.path.join(out_dir, f"{prefix}.json")) as f:
            write_report(derive(json.load(f)), out_dir)
        print(f"soak: rewrote {out_dir}/{prefix}.{{json,png,md}} from the records of {prefix}.json",
              flush=True)
        return 0
    smoke = args.smoke
    args.np = args.np or (2 if smoke else 4)
    args.steps = args.steps or (20 if smoke else 2000)
    args.every = args.every or (5 if smoke else 20)
    args.warmup = args.steps // 10 if args.warmup is None else args.warmup
    if not 0 <= args.warmup < args.steps:
        ap.error("--warmup must be in [0, steps)")
    check_example_args(args.framework, example_args)
    out_dir = args.out_dir or (_report.smoke_directory("soak-") if smoke else os.path.join(ROOT, "docs"))
    os.makedirs(out_dir, exist_ok=True)
    command = " ".join(["python -m benchmarks.soak", *map(shlex.quote, _shown(
        sys.argv[1:] if argv is None else argv))])

    load = [os.getloadavg()[0]]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="soak-ranks-") as rank_dir:
        run([WORKER, rank_dir, "--framework", args.framework, "--steps", str(args.steps),
             "--every", str(args.every), *EXAMPLE_ARGS, *example_args], np=args.np, controller="gloo",
            timeout=args.timeout, threads=1)
        per_rank = [read_rank(os.path.join(rank_dir, f"rank{rank}.jsonl")) for rank in range(args.np)]
    wall = time.perf_counter() - started
    load.append(os.getloadavg()[0])

    example = "pytorch_scalecom.py" if args.framework == "torch" else "tensorflow_scalecom.py"
    result = derive({
        "command": command, "machine": machine(), "framework": args.framework,
        "framework_version": per_rank[0]["framework_version"], "horovod": per_rank[0]["horovod"],
        "framework_example": example, "prefix": prefix,
        "np": args.np, "steps": args.steps, "every": args.every, "warmup": args.warmup,
        "options": per_rank[0]["options"], "wall_seconds": wall, "load": load,
        "records": [r["records"] for r in per_rank],
    })
    flat, bounded, trained = result["rss_flat"], result["residue_bounded"], result["trained"]
    write_report(result, out_dir)
    print(f"soak: RSS {'flat' if flat else 'NOT flat'}, residue norms "
          f"{'bounded' if bounded else 'NOT bounded'}, training "
          f"{'made progress' if trained else 'did NOT make progress'}; "
          f"wrote {out_dir}/{prefix}.{{json,png,md}} "
          f"({wall:.0f} s)", flush=True)
    # a failed verdict fails the run (20 smoke steps judge nothing)
    return 0 if smoke or (flat and bounded and trained) else 1


if __name__ == "__main__":
    sys.exit(main())
