"""ScaleCom's health check and dense fallback against plain ScaleCom, dense SGD and global top-k, on
the convergence benchmark's two tasks (digits, the character LM) and recipe, in the simulator.

Every run is :func:`benchmarks.convergence_schemes.train` under :data:`benchmarks.convergence.RECIPES`
(320 steps, per-worker batch 16, the first 32 steps dense), one thread per process. Plain ScaleCom
runs with ``check_every`` set and no fallback: the checks only report (its training is that of
ScaleCom without them, ``tests/test_sim_schemes.py``), so its health figures come from the same run;
its bytes are given both with the checks and without (the steps that did not check).

Parts (``--part``, several allowed; results go to ``--out`` and are reused from it):

* ``sweep``: the LM at n = 64, seed 0: the fallback's ``check_every``, ``min_captured`` and
  ``patience`` (:data:`SWEEP`), with dense and plain ScaleCom beside them;
* ``main``: n = 16 and 64: dense, plain ScaleCom, ScaleCom with each fallback setting of
  ``--fallback`` (default :data:`FALLBACKS`), global top-k (oracle indices, ScaleCom's bytes) and
  ScaleCom at ratio 0.1 (a larger k instead of dense steps); seeds 0-4 at n = 64 for dense, plain
  ScaleCom and the fallbacks, seeds 0-1 otherwise (run in the order :func:`plan` gives: what decides
  the criteria first);
* ``long``: the LM at n = 64, seed 0, three times as many steps (960; the schedules stretched).

``--report`` prints the markdown tables of docs/convergence.md's section "The health check and the
fallback at 16 and 64 workers" from ``--out``. ``--smoke``: n = 4, 8 steps, one fallback setting.

    python -m benchmarks.health_fallback --part sweep --jobs 2
    python -m benchmarks.health_fallback --part long main --jobs 2
    python -m benchmarks.health_fallback --report
"""

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import warnings

from benchmarks._report import COUNT
from benchmarks.convergence import RECIPES, SMOKE_RECIPE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "docs", "health_fallback.json")
CHECK_EVERY = 8  # plain ScaleCom's report-only checks
PLAIN = f"scalecom:check_every={CHECK_EVERY}"
# The fallback settings of the main part (chosen from the sweep: see docs/convergence.md).
FALLBACKS = ("check_every=32,fallback=dense,min_captured=0.5,patience=1",
             "check_every=32,fallback=dense,min_captured=0.3,patience=2")
SWEEP = tuple(f"check_every={c},fallback=dense,min_captured={m},patience={p}"
              for c, m, p in ((16, 0.5, 2), (32, 0.3, 2), (32, 0.5, 2), (32, 0.7, 2), (32, 0.5, 1), (64, 0.5, 1)))
LARGER_K = "scalecom:ratio=0.1"
SEEDS_64, SEEDS = (0, 1, 2, 3, 4), (0, 1)
LONG = 3  # the long run's steps, in multiples of the recipe's


def log(message):
    print(message, flush=True)


@dataclasses.dataclass(frozen=True)
class Run:
    part: str
    task: str
    scheme: str
    n: int
    seed: int
    length: int = 1  # multiple of the recipe's steps

    @property
    def key(self):
        return json.dumps([self.task, self.scheme, self.n, self.seed, self.length])


def plan(parts, fallbacks, smoke=False):
    """The runs of ``parts`` in order, each once (a run shared by two parts goes with the first)."""
    fallback_keys = [f"scalecom:{f}" for f in fallbacks]
    runs = []
    if smoke:
        return [Run("smoke", task, scheme, 4, 0) for task in ("digits", "charlm")
                for scheme in ("dense", PLAIN, fallback_keys[0])]
    # in order of what decides the criteria: n = 64 with the first fallback setting, seed by seed; then
    # that setting at n = 16 and the larger ratio at n = 64; the long run and the second setting on
    # digits' seeds; one seed of everything else and the second setting on the LM's; then the rest
    first, second, third, fourth, fifth = [], [], [], [], []
    for part in parts:
        if part == "sweep":  # (the LM: the task where ScaleCom's premise is weakest)
            fourth += [Run(part, "charlm", scheme, 64, 0)
                       for scheme in ("dense", PLAIN, *[f"scalecom:{s}" for s in SWEEP])]
        elif part == "main":
            first += [Run(part, task, scheme, 64, seed) for seed in SEEDS_64 for task in ("charlm", "digits")
                      for scheme in ("dense", PLAIN, fallback_keys[0])]
            second += [Run(part, task, scheme, n, SEEDS[0]) for task in ("charlm", "digits")
                       for scheme, n in ((fallback_keys[0], 16), (LARGER_K, 64))]
            for seed in SEEDS:
                later = fourth if seed == SEEDS[0] else fifth
                later += [Run(part, task, scheme, 16, seed) for task in ("charlm", "digits")
                          for scheme in ("dense", PLAIN, *fallback_keys, "global_topk", LARGER_K)]
                later += [Run(part, task, scheme, 64, seed) for task in ("charlm", "digits")
                          for scheme in ("global_topk", LARGER_K)]
            third += [Run(part, "digits", scheme, 64, seed) for seed in SEEDS_64 for scheme in fallback_keys[1:]]
            fourth += [Run(part, "charlm", scheme, 64, seed) for seed in SEEDS_64 for scheme in fallback_keys[1:]]
        elif part == "long":
            third += [Run(part, "charlm", scheme, 64, 0, LONG) for scheme in ("dense", fallback_keys[0], PLAIN)]
            fourth += [Run(part, "charlm", "global_topk", 64, 0, LONG)]
        else:
            raise ValueError(f"unknown part {part!r}")
    runs += first + second + third + fourth + fifth
    seen, unique = set(), []
    for run in runs:
        if run.key not in seen:
            seen.add(run.key)
            unique.append(run)
    return unique


def recipe_of(run, smoke=False):
    recipe = SMOKE_RECIPE if smoke else RECIPES[run.task]
    return dataclasses.replace(recipe, steps=recipe.steps * run.length)


_TASKS = {}


def execute(run, smoke=False):
    """One run in this process (a pool's worker): the training record of ``train``."""
    import torch

    from benchmarks.convergence_schemes import train
    from benchmarks.convergence_tasks import TASKS

    torch.set_num_threads(1)
    if run.task not in _TASKS:
        _TASKS[run.task] = TASKS[run.task]()
    recipe = recipe_of(run, smoke)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ScaleCom's health check")  # (the figures are recorded)
        out = train(_TASKS[run.task], run.scheme, run.n, recipe, seed=run.seed)
    out.update(part=run.part, length=run.length, key=run.key, recipe=dataclasses.asdict(recipe))
    return out


def describe(record):
    final = record["final"]
    figure = (f"accuracy {100 * final['accuracy']:.2f}%" if record["task"] == "digits"
              else f"valid loss {final['valid_loss']:.4f}")
    health = record.get("health")
    extra = ""
    if health:
        s = health["summary"]
        extra = (f", {s['dense_steps']} dense tensor-steps, {s['checks']} checks, "
                 f"captured {_mean(health['captured']):.3f}")
    return (f"{record['task']} n={record['n']} {record['scheme']} seed {record['seed']} x{record['length']}: "
            f"{figure}{' DIVERGED' if record['diverged'] else ''}, {record['bytes_per_step'] / 1e3:,.1f} kB/worker/step"
            f"{extra}; {record['cpu_seconds']:.0f} s CPU")


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def run_all(runs, path, jobs, fallbacks, smoke=False):
    results = {"runs": []}
    if os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
    results["fallbacks"] = list(fallbacks)
    done = {r["key"] for r in results["runs"]}
    todo = [r for r in runs if r.key not in done]
    log(f"{len(runs)} runs, {len(runs) - len(todo)} reused, {len(todo)} to run in {jobs} processes")
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = {pool.submit(execute, run, smoke): run for run in todo}
        for i, future in enumerate(concurrent.futures.as_completed(futures), 1):
            record = future.result()
            results["runs"].append(record)
            with open(path, "w") as f:
                json.dump(results, f)
            log(f"[{i}/{len(todo)}] {describe(record)}; {(time.perf_counter() - start) / 60:.1f} min wall")
    return results


# -- the report ----------------------------------------------------------------------------------------

def _quality(record):
    if record["diverged"]:
        return float("nan")
    final = record["final"]
    return 100 * final["accuracy"] if record["task"] == "digits" else final["valid_loss"]


def _label(scheme):
    if scheme == "dense":
        return "dense SGD"
    if scheme == "global_topk":
        return "global top-k (oracle indices)"
    if scheme == PLAIN:
        return "ScaleCom"
    if scheme == LARGER_K:
        return "ScaleCom, ratio 0.1"
    from benchmarks.convergence_schemes import scalecom_options
    o = scalecom_options(scheme)
    if o.get("fallback"):
        return (f"ScaleCom + fallback (every {o['check_every']}, min_captured {o.get('min_captured', 0.5)}, "
                f"patience {o.get('patience', 2)})")
    return scheme


def _fmt(task, values):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    bad = sum(not math.isfinite(v) for v in values)
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return f"diverged ({bad})"
    m = sum(finite) / len(finite)
    text = f"{m:.2f}%" if task == "digits" else f"{m:.3f}"
    if len(finite) > 1:
        half = (max(finite) - min(finite)) / 2
        text += f" ± {half:.2f}" if task == "digits" else f" ± {half:.3f}"
    if bad:
        text += f" ({bad} diverged)"
    return text + (f" [{len(values)}]" if len(values) > 1 else "")


def _gap(task, value, dense):
    return f"{value - dense:+.2f} points" if task == "digits" else f"{100 * (value - dense) / dense:+.1f}%"


def _kb(x):
    return "–" if x is None else f"{x / 1e3:,.1f}" if x < 1e5 else f"{x / 1e3:,.0f}"


def _dense_share(record):
    """The share of the compressed tensor-steps the fallback sent densely."""
    h = record.get("health")
    if not h:
        return None
    s = h["summary"]
    tensors = sum(1 for _ in s["by_tensor"]) or 1
    return s["dense_steps"] / (tensors * (record["steps"] - record["recipe"]["compression_warmup"]))


def report(results):
    runs = results["runs"]
    by = {}
    for r in runs:
        by.setdefault((r["task"], r["scheme"], r["n"], r.get("length", 1)), []).append(r)
    lines = []
    metric = {"digits": "test accuracy", "charlm": "validation loss (nats/char)"}

    sweep = [r for r in runs if r["part"] == "sweep" and r["task"] == "charlm"]
    if sweep:
        lines += ["Sweep (n = 64, seed 0):", "",
                  "| task | scheme | quality | gap to dense | kB/worker/step | dense tensor-steps | "
                  "captured, mean over checks |", "|---|---|---:|---:|---:|---:|---:|"]
        dense = {r["task"]: _quality(r) for r in sweep if r["scheme"] == "dense"}
        for r in sweep:
            h = r.get("health")
            share = "–" if not h else f"{100 * _dense_share(r):.0f}%"
            captured = "–" if not h else f"{_mean(h['captured']):.3f}"
            gap = "–" if r["scheme"] == "dense" or r["task"] not in dense else _gap(r["task"], _quality(r),
                                                                                          dense[r["task"]])
            lines.append(f"| {r['task']} | {_label(r['scheme'])} | {_fmt(r['task'], [_quality(r)])} | {gap} | "
                         f"{_kb(r['bytes_per_step'])} | {share} | {captured} |")
        lines.append("")

    for task in ("digits", "charlm"):
        order = ["dense", PLAIN, *[f"scalecom:{f}" for f in results.get("fallbacks", FALLBACKS)], LARGER_K,
                 "global_topk"]
        schemes = [s for s in order if any(r["task"] == task and r["scheme"] == s and r.get("length", 1) == 1
                                           for r in runs)]
        if not schemes:
            continue
        ns = sorted({r["n"] for r in runs if r["task"] == task and r["part"] != "sweep"})
        lines += [f"{task}, {metric[task]} (mean ± half the range over the seeds, [seeds]) and kB/worker/step "
                  f"after the 32 dense warm-up steps:", "",
                  "| scheme | " + " | ".join(f"n = {n}" for n in ns) + " | " + " | ".join(f"kB, n = {n}" for n in ns)
                  + " |", "|---|" + "---:|" * (2 * len(ns))]
        for scheme in schemes:
            cells = [_fmt(task, [_quality(r) for r in by.get((task, scheme, n, 1), [])]) for n in ns]
            kb = []
            for n in ns:
                rs = by.get((task, scheme, n, 1), [])
                if not rs:
                    kb.append("–")
                    continue
                mean = sum(r["bytes_per_step"] for r in rs) / len(rs)
                plain = rs[0].get("health", {}).get("plain_bytes_per_step") if scheme == PLAIN else None
                kb.append(_kb(mean) + (f" ({_kb(plain)} without checks)" if plain else ""))
            lines.append(f"| {_label(scheme)} | " + " | ".join(cells) + " | " + " | ".join(kb) + " |")
        lines.append("")

    for task in ("digits", "charlm"):
        seeds = sorted({r["seed"] for r in runs if r["task"] == task and r["n"] == 64 and r.get("length", 1) == 1
                        and r["scheme"] == "dense"})
        if len(seeds) < 2:
            continue
        fallbacks = [f"scalecom:{f}" for f in results.get("fallbacks", FALLBACKS)]
        schemes = [s for s in ("dense", PLAIN, *fallbacks) if (task, s, 64, 1) in by]
        lines += [f"{task} at n = 64, per seed ({metric[task]}; gap to dense in "
                  f"{'points' if task == 'digits' else '% of dense'}):", "",
                  "| seed | " + " | ".join(_label(s) for s in schemes) + " |", "|---:|" + "---:|" * len(schemes)]
        table = {s: {r["seed"]: _quality(r) for r in by[(task, s, 64, 1)]} for s in schemes}
        for seed in seeds + ["mean"]:
            row = []
            for s in schemes:
                values = table[s]
                v = values.get(seed) if seed != "mean" else (
                    _mean([values.get(x) for x in seeds]) if all(x in values for x in seeds) else None)
                d = table["dense"].get(seed) if seed != "mean" else _mean([table["dense"].get(x) for x in seeds])
                if v is None:
                    row.append("–")
                    continue
                text = f"{v:.2f}%" if task == "digits" else f"{v:.4f}"
                if s != "dense" and d is not None:
                    text += f" ({v - d:+.2f})" if task == "digits" else f" ({100 * (v - d) / d:+.1f}%)"
                row.append(text)
            lines.append(f"| {seed} | " + " | ".join(row) + " |")
        lines.append("")

    fallbacks = [f"scalecom:{f}" for f in results.get("fallbacks", FALLBACKS)]
    health_rows = [r for r in runs if r["scheme"] in (PLAIN, *fallbacks) and r.get("length", 1) == 1]
    if health_rows:
        lines += ["Health figures (mean over the seeds of each run's mean over its checks; dense share: of "
                  "the compressed tensor-steps, those the fallback sent densely):", "",
                  "| task | n | scheme | captured | overlap | captured, first quarter | last quarter | dense share |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        groups = {}
        for r in health_rows:
            groups.setdefault((r["task"], r["n"], r["scheme"]), []).append(r)
        for (task, n, scheme), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            def quarter(values, q, warm):
                values = values[warm:]
                size = len(values) // 4
                return _mean(values[q * size:(q + 1) * size])
            warm = rs[0]["recipe"]["compression_warmup"]
            cap = _mean([_mean(r["health"]["captured"]) for r in rs])
            ov = _mean([_mean(r["health"]["overlap"]) for r in rs])
            first = _mean([quarter(r["health"]["captured"], 0, warm) for r in rs])
            last = _mean([quarter(r["health"]["captured"], 3, warm) for r in rs])
            share = _mean([_dense_share(r) for r in rs])
            lines.append(f"| {task} | {n} | {_label(scheme)} | {cap:.3f} | {ov:.3f} | {first:.3f} | {last:.3f} | "
                         f"{100 * share:.0f}% |")
        lines.append("")

    long_runs = [r for r in runs if r.get("length", 1) > 1]
    if long_runs:
        lines += ["The LM at n = 64, seed 0, 320 and 960 steps (validation loss; gap to dense):", "",
                  "| scheme | 320 steps | gap | 960 steps | gap | kB/worker/step, 960 steps |",
                  "|---|---:|---:|---:|---:|---:|"]
        dense = {length: _quality(r) for r in runs if r["task"] == "charlm" and r["n"] == 64 and r["seed"] == 0
                 and r["scheme"] == "dense" for length in [r.get("length", 1)]}
        for r in long_runs:
            short = [x for x in by.get(("charlm", r["scheme"], 64, 1), []) if x["seed"] == 0]
            s = _quality(short[0]) if short else None
            cells = []
            for v, length in ((s, 1), (_quality(r), r["length"])):
                d = dense.get(length)
                cells += ["–", "–"] if v is None else [f"{v:.4f}", "–" if d is None or r["scheme"] == "dense"
                                                       else f"{v - d:+.4f} ({100 * (v - d) / d:+.1f}%)"]
            lines.append(f"| {_label(r['scheme'])} | " + " | ".join(cells) + f" | {_kb(r['bytes_per_step'])} |")
        lines.append("")
    lines.append(f"{len(runs)} runs, {sum(r['cpu_seconds'] for r in runs) / 60:.1f} CPU minutes of training "
                 f"(their process time summed).")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--part", nargs="+", choices=("sweep", "main", "long"), default=())
    ap.add_argument("--fallback", nargs="+", default=FALLBACKS,
                    help="ScaleCom fallback settings of the main part, NAME=VALUE,... each")
    ap.add_argument("--jobs", type=COUNT, default=1, help="processes in parallel")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--report", action="store_true", help="print the markdown tables from --out")
    ap.add_argument("--smoke", action="store_true", help="n = 4, 8 steps, dense, ScaleCom and one fallback")
    args = ap.parse_args(argv)
    from benchmarks.convergence_schemes import scalecom_options
    for setting in args.fallback:
        try:
            scalecom_options(f"scalecom:{setting}")
        except ValueError as error:
            ap.error(f"argument --fallback: {error}")
    if args.smoke and args.out == OUT:
        args.out = os.path.join(tempfile.mkdtemp(prefix="health_fallback_"), "health_fallback.json")
    if args.smoke or args.part:
        results = run_all(plan(args.part, args.fallback, args.smoke), args.out, args.jobs, args.fallback, args.smoke)
    elif args.report:
        with open(args.out) as f:
            results = json.load(f)
    else:
        ap.error("give --part, --report or --smoke")
    if args.report or args.smoke:
        print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
