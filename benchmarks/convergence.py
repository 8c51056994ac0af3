"""Convergence of ScaleCom and the schemes it is compared with, on two real tasks, at 4, 16 and 64
simulated workers; write docs/convergence.md, its figures and docs/convergence.json.

    .venv/bin/python -m benchmarks.convergence                 # everything (about 50 CPU minutes, an hour)
    .venv/bin/python -m benchmarks.convergence --smoke         # tiny: dense and ScaleCom, n = 4, 8 steps
    .venv/bin/python -m benchmarks.convergence --report-only   # markdown and figures from the JSON
    .venv/bin/python -m benchmarks.convergence --resume        # reuse finished runs of the JSON

Parts:

1. main grid: each task (digits MLP, character-level LM on the standard library's source) x each
   scheme of :data:`benchmarks.convergence_schemes.SCHEMES` x n in (4, 16, 64), seeds 0 and 1, one recipe
   per task shared by every scheme (:data:`RECIPES`); bytes-matched schemes get their knob per
   (task, n) from :func:`benchmarks.convergence_schemes.match_knob`;
2. the n = 64 digits criterion (ScaleCom within 1 point of dense): three more seeds of both, ScaleCom
   with the exact (``torch.topk``) selection on all five, and the sensitivity of both to the recipe (no
   compression warm-up, smaller batch, learning-rate scaling)
   and of ScaleCom to beta; on the language model, a 4x larger per-worker batch;
3. dense and ScaleCom on digits under ``horovodrun -np 4`` against the simulator's replay.

Every run goes through :class:`hvd_scalecom.sim.Simulator` on one thread; progress goes to stdout.
"""

import argparse
import dataclasses
import json
import os
import platform
import resource
import sys
import time

import torch

from benchmarks import convergence_report
from benchmarks._report import COUNT, command_line, output_path
from benchmarks.convergence_schemes import SCHEMES, Recipe, match_knob, scalecom_bytes, train
from benchmarks.convergence_tasks import TASKS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = (4, 16, 64)

# One recipe for both tasks and all schemes: per-worker batch 16 (digits' shards hold 22 images at
# n = 64), SGD momentum 0.9, peak lr 0.1 * sqrt(n / 4) after a 32-step linear warm-up, cosine decay,
# the first 32 steps dense for every compressing scheme (the paper's warm-up), 320 steps.
RECIPES = {
    "digits": Recipe(steps=320, batch=16, lr=0.1, scaling=0.5, reference_n=4, warmup=32,
                     compression_warmup=32, eval_every=16),
    "charlm": Recipe(steps=320, batch=16, lr=0.1, scaling=0.5, reference_n=4, warmup=32,
                     compression_warmup=32, eval_every=16),
}
SMOKE_RECIPE = Recipe(steps=8, batch=8, lr=0.1, scaling=0.5, warmup=2, compression_warmup=2, eval_every=4)

SEEDS = (0, 1)
CRITERION_SEEDS = (2, 3, 4)  # more seeds of dense and ScaleCom at n = 64 on digits
# ScaleCom with selection="exact" (torch.topk) at n = 64 on digits, every criterion seed: the same
# top-k as the default "threshold" selection except which of several entries tied at the k-th
# magnitude it takes, a measure of how much a run's outcome depends on such details.
EXACT_SELECTION_SEEDS = SEEDS + CRITERION_SEEDS

# Part 2 at n = 64: (task, variant name, what changes, recipe changes, schemes).
SENSITIVITY = (
    ("digits", "no compression warm-up", "every scheme compresses from step 0",
     {"compression_warmup": 0}, ("scalecom", "scalecom_b1")),
    ("digits", "compression warm-up 64 steps", "every scheme dense for the first 64 steps, not 32",
     {"compression_warmup": 64}, ("scalecom", "scalecom_b1")),
    ("digits", "per-worker batch 8", "global batch 512 instead of 1,024",
     {"batch": 8}, ("dense", "scalecom")),
    ("digits", "lr not scaled with n", "peak lr 0.1 at every n",
     {"scaling": 0.0}, ("dense", "scalecom")),
    ("digits", "lr scaled linearly with n", "peak lr 0.1 * n / 4 = 1.6 at n = 64",
     {"scaling": 1.0}, ("dense", "scalecom")),
    ("digits", "beta sweep", "ScaleCom's low-pass filter (0.1 and 1 are in the main grid)",
     {}, ("scalecom_beta0.03", "scalecom_beta0.3", "scalecom_beta0.5")),
    ("digits", "pipelined indices", "ScaleCom's pipelined mode: the indices selected a step ahead",
     {}, ("scalecom_pipelined",)),
    ("charlm", "pipelined indices", "ScaleCom's pipelined mode: the indices selected a step ahead",
     {}, ("scalecom_pipelined",)),
    ("charlm", "per-worker batch 64", "global batch 4,096 instead of 1,024",
     {"batch": 64}, ("dense", "scalecom", "scalecom_b1")),
)


def log(message):
    print(message, flush=True)


class Runner:
    """Runs configurations in order, reusing those a previous JSON already holds (``--resume``)."""

    def __init__(self, results, path, previous=()):
        self.results, self.path = results, path
        self.previous = {self.key(r): r for r in previous}
        self.started = time.perf_counter()
        self.cpu = time.process_time()

    @staticmethod
    def key(record):
        """What defines a run (its group does not: the same run may serve two parts)."""
        return json.dumps([record["variant"], record["task"], record["scheme"], record["n"], record["seed"],
                           record["recipe"]], sort_keys=True)

    def run(self, index, total, task, key, n, recipe, group="main", variant="main", seed=0, knob=None):
        record = {"group": group, "variant": variant, "task": task.name, "scheme": key, "n": n,
                  "seed": seed, "recipe": dataclasses.asdict(recipe)}
        old = self.previous.get(self.key(record))
        if old is not None and old.get("knob") == knob:
            old = dict(old, group=group)
            self.results["runs"].append(old)
            log(f"[{index}/{total}] {task.name} n={n} {key} ({variant}, seed {seed}): reused")
            return old
        out = train(task, key, n, recipe, seed=seed, knob=knob)
        out.update(group=group, variant=variant, recipe=dataclasses.asdict(recipe))
        self.results["runs"].append(out)
        self.save()
        final = out["final"]
        figure = (f"accuracy {100 * final['accuracy']:6.2f}%" if task.name == "digits"
                  else f"valid loss {final['valid_loss']:.4f} ({final['bits_per_char']:.3f} bpc)")
        overlap = [v for v in out["overlap"] if v is not None]
        extra = f", overlap {sum(overlap) / len(overlap):.3f}" if overlap else ""
        elapsed = time.perf_counter() - self.started
        log(f"[{index}/{total}] {task.name} n={n} {key} ({variant}, seed {seed}): {figure}"
            f"{' DIVERGED' if out['diverged'] else ''}, {out['bytes_per_step']:,.0f} B/worker/step{extra}; "
            f"{out['cpu_seconds']:.0f} s CPU; total {elapsed / 60:.1f} min wall, "
            f"{(time.process_time() - self.cpu) / 60:.1f} min CPU")
        return out

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.results, f, indent=1)


def matching(task, recipe, n, results):
    """Knobs of the bytes-matched schemes for (task, n), recorded in ``results['matching']``."""
    model = task.model(0)
    target = scalecom_bytes(recipe, n, model)
    entry = {"scalecom_bytes": target}
    for spec in SCHEMES:
        if spec.matched == "bytes":
            knob, cost = match_knob(spec.key, recipe, n, model, target)
            entry[spec.key] = {"knob": knob, "bytes": cost}
    results["matching"].setdefault(task.name, {})[str(n)] = entry
    log(f"matched {task.name} n={n}: ScaleCom {target:,.0f} B/worker/step; " + ", ".join(
        f"{k} knob {v['knob']:.4g} -> {v['bytes']:,.0f} B" for k, v in entry.items() if isinstance(v, dict)))
    return entry


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="dense and ScaleCom, n = 4, 8 steps, both tasks")
    ap.add_argument("--report-only", action="store_true", help="rewrite markdown and figures from the JSON")
    ap.add_argument("--resume", action="store_true", help="reuse runs already in the JSON")
    ap.add_argument("--no-horovod", action="store_true", help="skip the horovodrun comparison")
    ap.add_argument("--out-dir", default=None, help="default: docs/ (a temporary directory in --smoke)")
    ap.add_argument("--threads", type=COUNT, default=1)
    args = ap.parse_args(argv)
    args.out_dir = args.out_dir or os.path.dirname(output_path(None, args.smoke, "convergence.json"))
    command = command_line("convergence", argv)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, "convergence.json")
    if args.report_only:
        with open(path) as f:
            results = json.load(f)
        convergence_report.write(results, args.out_dir)
        log(f"wrote {args.out_dir}/convergence.md and its figures from {path}")
        return 0
    torch.set_num_threads(args.threads)
    previous, previous_horovod = [], []
    if args.resume and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        previous, previous_horovod = old.get("runs", []), old.get("horovod", [])
    start, cpu = time.perf_counter(), time.process_time()
    tasks = {name: cls() for name, cls in TASKS.items()}
    recipes = {name: SMOKE_RECIPE for name in tasks} if args.smoke else RECIPES
    workers = (4,) if args.smoke else WORKERS
    schemes = [s for s in SCHEMES if s.key in ("dense", "scalecom")] if args.smoke else list(SCHEMES)
    results = {"command": command, "smoke": args.smoke, "created": time.strftime("%Y-%m-%d %H:%M"),
               "python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
               "machine": f"{platform.machine()}, {os.cpu_count()} cores",
               "recipes": {k: dataclasses.asdict(v) for k, v in recipes.items()},
               "tasks": {k: t.describe() for k, t in tasks.items()},
               "schemes": [dataclasses.asdict(s) for s in SCHEMES],
               "workers": list(workers), "matching": {}, "runs": [], "horovod": []}
    runner = Runner(results, path, previous)

    # 1. main grid
    seeds = (0,) if args.smoke else SEEDS
    plan = []
    for seed in seeds:
        for task in tasks.values():
            for n in workers:
                for spec in schemes:
                    plan.append((task, spec, n, seed))
    sensitivity = [] if args.smoke else SENSITIVITY
    total = len(plan) + (0 if args.smoke else 2 * len(CRITERION_SEEDS) + len(EXACT_SELECTION_SEEDS)
                         + sum(len(s[4]) for s in sensitivity))
    log(f"{total} training runs ({len(plan)} in the main grid), "
        f"{'' if args.no_horovod or args.smoke else '2 horovodrun jobs, '}one thread")
    index = 0
    knobs = {}
    for task, spec, n, seed in plan:
        recipe = recipes[task.name]
        if spec.matched == "bytes":
            if (task.name, n) not in knobs:
                knobs[task.name, n] = matching(task, recipe, n, results)
            knob = knobs[task.name, n][spec.key]["knob"]
        else:
            knob = None
        index += 1
        runner.run(index, total, task, spec.key, n, recipe, seed=seed, knob=knob)

    # 2. the n = 64 digits criterion: seeds and sensitivity
    if not args.smoke:
        for seed in CRITERION_SEEDS:
            for key in ("dense", "scalecom"):
                index += 1
                runner.run(index, total, tasks["digits"], key, 64, recipes["digits"], group="seeds",
                           variant="main", seed=seed)
        for seed in EXACT_SELECTION_SEEDS:
            index += 1
            runner.run(index, total, tasks["digits"], "scalecom_exact", 64, recipes["digits"], group="seeds",
                       variant="main", seed=seed)
        for name, variant, _, changes, keys in sensitivity:
            recipe = dataclasses.replace(recipes[name], **changes)
            for key in keys:
                index += 1
                runner.run(index, total, tasks[name], key, 64, recipe, group="sensitivity", variant=variant)
        results["sensitivity"] = [{"task": t, "variant": v, "what": w, "changes": c, "schemes": list(k)}
                                  for t, v, w, c, k in sensitivity]

    # 3. horovodrun -np 4 against the simulator
    if not (args.smoke or args.no_horovod):
        from benchmarks.convergence_horovod import compare
        job = {"workers": 4, "epochs": 15, "ratio": 0.01, "beta": 0.1}
        reuse = [r for r in previous_horovod if all(r.get(k) == v for k, v in job.items())
                 and "horovod_again" in r]
        if len(reuse) == 2:
            results["horovod"] = reuse
            log("horovodrun -np 4 jobs: reused")
        else:
            results["horovod"] = compare(**job, progress=log)

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    results["runtime"] = {
        "wall_seconds": time.perf_counter() - start,
        "cpu_seconds_main_process": time.process_time() - cpu,
        "cpu_seconds_runs": sum(r["cpu_seconds"] for r in results["runs"]),
        "cpu_seconds_horovod_jobs": children.ru_utime + children.ru_stime,
        # with --resume, results of earlier invocations were reused: this invocation's times are not
        # the whole cost (cpu_seconds_runs still is: every run records its own)
        "resumed": bool(previous or previous_horovod)}
    runner.save()
    convergence_report.write(results, args.out_dir)
    log(f"wrote {path}, {args.out_dir}/convergence.md and its figures in "
        f"{results['runtime']['wall_seconds'] / 60:.1f} min wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
