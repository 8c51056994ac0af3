"""Real Horovod jobs from 2 to 64 ranks on one machine: ScaleCom's weights against a single-process
reference of its equations, identical on every rank; bytes per worker per step on the wire; time per
step and memory per rank. Writes the "Scale" section of docs/performance.md.

    sudo .venv/bin/python -m benchmarks.scale                   # 2, 8, 16, 32 and 64 ranks
    sudo .venv/bin/python -m benchmarks.scale --ranks 2 8 --dense
    .venv/bin/python -m benchmarks.scale --smoke                # 2 ranks, few steps, a temporary page

Each job (``horovodrun -np N -H localhost:N --gloo``, one thread per rank) steps three parameters
(1,048,576 and 16,384 entries compressed at ratio 0.01, 64 dense) on synthetic gradients: the loss
of rank r at step t is ``sum_p <p, G_p(r, t)>`` with seeded normal ``G``, so the parent regenerates
every gradient. It runs ``warmup + N + 1`` steps, so every rank leads at least once (leader ``t mod
N``). The parent replays the gradients through ``tests/reference.py``'s NumPy ScaleCom and checks
that the final weights are bitwise equal on all ranks and equal the initial weights minus ``lr``
times the reference's updates (with beta = 1, see :data:`SPEC`, any wrong index at any step shows).
As root, each job runs in
a fresh network namespace whose loopback carries only its traffic: the loopback's byte counter,
read between barriers around the steps after the first compressed one and divided by ranks and
steps, is the wire bytes per worker
per step (TCP/IP headers and Horovod's coordination included). Without root the bytes are not
measured (the table says so). A check that fails ends the run with exit 1, naming the rank count.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks._report import COUNT, SECONDS, command_line, output_file, output_path, replace_section
from benchmarks._scale_worker import SHAPES, gradient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_scale_worker.py")
PREFIX = "hvdsc_scale_"
# beta = 1 (classic error feedback): the memory is then p off I and 0 on I, computed alike by the
# code and the reference to the bit, so the leader's indices match at every step however long the
# run; beta < 1 is checked against the same reference by the tests (2 and 3 ranks).
SPEC = {"ratio": 0.01, "beta": 1.0, "warmup_steps": 1, "min_numel": 1024, "lr": 0.1, "seed": 0}


class CheckFailed(Exception):
    """A job's results differ from the reference, or between ranks."""


def namespaces_usable():
    """True where this process may make network namespaces (root, iproute2)."""
    if os.geteuid() != 0:
        return False
    probe = f"{PREFIX}{os.getpid()}_probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return made.returncode == 0


def run_job(ranks, spec, namespace, timeout):
    """The job's rank-0 RESULT dict; raises HorovodRunError (with each rank's output) on failure."""
    from devtools.launch import horovodrun_command, run_command

    cmd = horovodrun_command([WORKER, json.dumps(spec)], np=ranks, start_timeout=max(120, 6 * ranks))
    if namespace:
        subprocess.run(["ip", "netns", "add", namespace], check=True, capture_output=True)
        subprocess.run(["ip", "netns", "exec", namespace, "ip", "link", "set", "lo", "up"], check=True)
        cmd = ["ip", "netns", "exec", namespace, *cmd]
    try:
        # (Gloo's connections wait 30 s by default: too short for 64 ranks starting on 2 cores)
        output = run_command(cmd, timeout=timeout, env={"HOROVOD_CYCLE_TIME": "1",
                                                        "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout))})
    finally:
        if namespace:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
    line = next(x for x in output.splitlines() if "RESULT " in x)
    return json.loads(line[line.index("RESULT ") + len("RESULT "):])


class SyntheticGradients:
    """``raw_grads[t][rank][name]`` of a job, regenerated step by step when the reference asks (a
    64-rank job's would not fit in memory at once)."""

    def __init__(self, ranks, steps, seed):
        self.ranks, self.steps, self.seed = ranks, steps, seed

    def __len__(self):
        return self.steps

    def __getitem__(self, t):
        if not 0 <= t < self.steps:
            raise IndexError(t)
        return [{n: gradient(n, r, t, self.seed).numpy() for n in SHAPES} for r in range(self.ranks)]


def check_against_reference(ranks, spec, out_dir):
    """The final weights of every rank: bitwise equal to rank 0's, and equal to the initial weights
    minus ``lr`` times the reference's updates (round-off of the averaging's order allowed)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from reference import scalecom_reference

    results = []
    for r in range(ranks):
        with np.load(os.path.join(out_dir, f"rank{r}.npz")) as data:
            results.append({k: data[k] for k in data.files})
    grads = SyntheticGradients(ranks, spec["steps"], spec["seed"])
    if spec["compression"] == "scalecom":
        applied, _ = scalecom_reference(grads, list(SHAPES), ranks, spec["ratio"], spec["beta"],
                                        spec["warmup_steps"], spec["min_numel"])
    else:
        applied = [{n: np.sum([g[n] for g in step], axis=0) / ranks for n in SHAPES} for step in grads]
    for n in SHAPES:
        for r, res in enumerate(results):
            if not np.array_equal(res[f"final/{n}"], results[0][f"final/{n}"]):
                raise CheckFailed(f"{ranks} ranks: {n} differs between rank 0 and rank {r}")
        expected = results[0][f"initial/{n}"] - spec["lr"] * np.sum([a[n] for a in applied], axis=0)
        got = results[0][f"final/{n}"]
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise CheckFailed(f"{ranks} ranks: final {n} differs from the reference's weights "
                              f"(largest difference {np.abs(got - expected).max():.3g})")


def measure(args):
    rows = []
    in_namespace = namespaces_usable()
    for compression in ["scalecom"] + (["dense"] if args.dense else []):
        for ranks in args.ranks:
            spec = {**SPEC, "compression": compression, "steps": SPEC["warmup_steps"] + ranks + 1}
            if args.smoke:
                spec["steps"] = SPEC["warmup_steps"] + ranks
            with tempfile.TemporaryDirectory(prefix="hvd_scalecom_scale-") as out_dir:
                spec["out_dir"] = out_dir
                started = time.perf_counter()
                namespace = f"{PREFIX}{os.getpid()}_{compression}_{ranks}" if in_namespace else None
                result = run_job(ranks, spec, namespace, args.timeout)
                check_against_reference(ranks, spec, out_dir)
            leaders = len({t % ranks for t in range(spec["warmup_steps"], spec["steps"])})
            wire = result["wire_bytes"]
            rows.append({**result, "compression": compression, "leaders": leaders,
                         "wire_bytes_per_worker_step":
                             None if wire is None else wire / ranks / result["measured_steps"],
                         "job_seconds": time.perf_counter() - started})
            print(f"{compression} {ranks} ranks: reference matched, {leaders} leaders, "
                  f"{rows[-1]['step_seconds'] * 1e3:.1f} ms/step, "
                  f"{rows[-1]['wire_bytes_per_worker_step'] or 0:,.0f} wire bytes/worker/step", flush=True)
    return rows, in_namespace


def markdown(rows, in_namespace, command):
    lines = [
        "## Scale: real Horovod jobs up to 64 ranks", "",
        f"Made by `{command}`: every rank of a real `horovodrun` job on one 2-core machine, Gloo, one "
        "thread per rank; synthetic gradients of a 1,048,576-entry and a 16,384-entry tensor (ScaleCom "
        "ratio 0.01, beta 1) and a 64-entry one (dense), one dense warm-up step, then one step more than "
        "there are ranks, so that every rank leads; time, bytes and stats() are those of the steps after the "
        "first compressed one. *Reference*: the final weights were bitwise equal on "
        "all ranks and matched the NumPy reference of the equations. Wire bytes: the job's own loopback, "
        "per worker per step, with TCP/IP headers and "
        "Horovod's coordination messages" + ("" if in_namespace else " (not measured: needs root)") + ". "
        "All ranks share 2 cores, so the step time grows with the ranks: it shows the cost of many "
        "processes on one machine, not of a cluster.", "",
        "| scheme | ranks | leaders | reference | step (ms) | wire bytes / worker / step | stats() bytes "
        "/ step | dense bytes | RSS per rank, max (MB) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        wire = "-" if r["wire_bytes_per_worker_step"] is None else f"{r['wire_bytes_per_worker_step']:,.0f}"
        stats = "-" if r["stats_sent_bytes"] is None else f"{r['stats_sent_bytes']:,.0f}"
        lines.append(f"| {r['compression']} | {r['ranks']} | {r['leaders']} | matched | "
                     f"{r['step_seconds'] * 1e3:.1f} | {wire} | {stats} | {r['dense_bytes']:,} | "
                     f"{max(r['rss_mb']):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--ranks", type=COUNT, nargs="+", default=None, help="default: 2 8 16 32 64")
    ap.add_argument("--dense", action="store_true", help="also run dense jobs, for their wire bytes")
    ap.add_argument("--smoke", action="store_true", help="2 ranks, few steps, a temporary page")
    ap.add_argument("--timeout", type=SECONDS, default=1800, help="seconds per job")
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/performance.md (a temporary file in --smoke)")
    ap.add_argument("--json", type=output_file, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    if any(r < 2 for r in args.ranks or []):
        ap.error("argument --ranks: each must be at least 2 (ScaleCom reduces nothing on one rank)")
    args.ranks = args.ranks or ([2] if args.smoke else [2, 8, 16, 32, 64])
    args.out = output_path(args.out, args.smoke, "performance.md")
    try:
        rows, in_namespace = measure(args)
    except CheckFailed as why:
        print(f"scale: check failed: {why}", file=sys.stderr, flush=True)
        return 1
    replace_section(args.out, "scale", markdown(rows, in_namespace, command_line("scale", argv)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
