"""The prose of docs/convergence.md: set-up, and the reading of the results (figures from the JSON)."""

import os

from benchmarks import convergence_report as rep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preamble(results, cmd):
    d, c = results["tasks"].get("digits", {}), results["tasks"].get("charlm", {})
    r = results["recipes"].get("digits") or next(iter(results["recipes"].values()))
    runtime = results.get("runtime", {})
    lines = [
        "# Convergence: ScaleCom against the other schemes, in the simulator and under horovodrun",
        "",
        f"Made by `{cmd}` (results in `convergence.json`; `python -m benchmarks.convergence "
        "--report-only` rewrites this page and its figures from it). "
        f"Python {results['python']}, torch {results['torch']}, {results['threads']} thread, "
        f"{results['machine']} shared with other jobs"
        + (f"; {runtime['cpu_seconds_runs'] / 60:.1f} CPU minutes of training runs (their process "
           "time summed)" + (", made over several invocations (`--resume` reuses finished runs)."
                             if runtime.get("resumed") else
                             f", {runtime.get('cpu_seconds_horovod_jobs', 0) / 60:.1f} in the horovodrun "
                             f"jobs' processes, {runtime['wall_seconds'] / 60:.1f} minutes wall in all.")
           if runtime else "."),
        "",
        "## Set-up",
        "",
        "Every run trains one model with n simulated synchronous workers in "
        "`hvd_scalecom.sim.Simulator` (the ScaleCom there is the Horovod compressor's own code, "
        "`hvd_scalecom.torch.clt_k`); each worker computes its gradient on its own batch.",
        "",
        f"* **digits**: scikit-learn's 8x8 digits, {d.get('model', '')} ({d.get('parameters', 0):,} "
        "parameters), first 1,437 images train, last 360 test (a test-accuracy point is 3.6 images). "
        "Worker i owns the shard `train[i::n]` (cut to equal length; 29 images dropped at n = 64, "
        "where each shard holds 22 images) and walks through a new permutation of it every epoch.",
        f"* **charlm**: character-level language model on the standard library's source "
        f"(Python {c.get('python', '?')}): {len(c.get('files', []))} files read in sorted order "
        f"from `sysconfig.get_paths()['stdlib']` (`{c.get('first_file', '')}` ... "
        f"`{c.get('last_file', '')}`, list fixed in `benchmarks/convergence_tasks.py`), the first "
        f"{c.get('train_chars', 0):,} characters train, the next {c.get('valid_chars', 0):,} "
        f"validate (held-out files); {c.get('vocabulary', 0)}-symbol vocabulary; model "
        f"{c.get('model', '')} ({c.get('parameters', 0):,} parameters) over the previous "
        f"{c.get('context', 0)} characters; validation loss on {c.get('valid_windows', 0):,} "
        "windows (every 6th position). Workers draw windows uniformly from the whole training text.",
        f"* **one recipe for every scheme and both tasks**: per-worker batch {r['batch']} (global "
        f"batch {r['batch']} n), SGD with momentum {r['momentum']}, peak learning rate "
        f"{r['lr']} * (n / {r['reference_n']})^{r['scaling']} (square-root scaling with the global "
        f"batch) after a {r['warmup']}-step linear warm-up, cosine decay to 0 at step {r['steps']}; "
        f"the first {r['compression_warmup']} steps are dense for every compressing scheme (the "
        "paper's warm-up; Qsparse, which has no such option, runs dense SGD for those steps). "
        "Exceptions, as the papers prescribe: Sketched SGD runs its own momentum (rho = 0.9) inside "
        "the scheme and the optimizer none; Qsparse-local-SGD runs the workers' local SGD with "
        "momentum 0.9 at the same learning rate. FP16 has no warm-up (it never compresses).",
        f"* **compression**: ratio {r['ratio']} (k = ceil(0.01 numel) per tensor), tensors under "
        f"{r['min_numel']} entries (biases) always dense; int32 indices, fp32 values. ScaleCom's "
        "leader is cyclic (t mod n).",
        f"* **seeds**: {seeds_text(results)} (seed s: the same initial weights and, at a given n, "
        "the same batches for every scheme); the tables give the mean over the seeds of every "
        "configuration +- half the range (the further seeds enter only the n = 64 criterion below), "
        "the figures and the diagnostics seed 0.",
        "* **bytes** are the simulator's exact accounting: bytes each worker *sends* per step (ring "
        "allreduce 2 (n-1)/n B, pipelined-chain broadcast (n-1)/n B on average, ring allgather "
        "(n-1) B, gTop-k's log2 n pairwise exchanges), indices, values and the dense biases together, "
        "averaged over workers and over the compressed steps (after the warm-up). The kB columns are "
        "1,000 bytes.",
        "* **traffic matching**: local top-k, global top-k, gTop-k and random-k use ScaleCom's k "
        "exactly; their bytes differ by construction. Global top-k is the ideal CLT-k approximates: "
        "its indices come from an oracle and its bytes are counted as ScaleCom's (finding them for "
        "real takes a dense allreduce). Sketched SGD, PowerSGD and Qsparse are matched on bytes: per "
        "task and n, one knob is set so that their bytes per worker per step come closest to "
        "ScaleCom's, measured in the simulator (table below). Sketched SGD keeps FetchSGD's sketch "
        "proportions (5 rows, 10 k columns, 2 k candidates) and gives up k; PowerSGD's rank is an "
        "integer, so it is the nearest; Qsparse (H = 8, SignTop-k as in the authors' code) sends "
        "every 8th step, averaged over steps.",
        "",
        "## Results",
    ]
    return lines


def seeds_text(results):
    main = sorted({r["seed"] for r in results["runs"] if r["group"] == "main"})
    extra = sorted({r["seed"] for r in results["runs"] if r["group"] == "seeds"} - set(main))
    text = f"seed{'s' if len(main) > 1 else ''} {', '.join(map(str, main))} for every configuration"
    if extra:
        text += f", and {', '.join(map(str, extra))} too for dense and ScaleCom at n = 64 on digits"
    return text


def _mean(results, task, scheme, n):
    """Mean final metric over the main grid's seeds (digits in %), and how many seeds diverged."""
    rs = rep.runs(results, task=task, scheme=scheme, n=n)
    ok = [r for r in rs if not r["diverged"]]
    scale = 100 if task == "digits" else 1
    value = sum(scale * rep.metric(r) for r in ok) / len(ok) if ok else float("nan")
    return value, len(rs) - len(ok), len(rs)


def _m(results, task, scheme, n):
    value, bad, total = _mean(results, task, scheme, n)
    if bad == total:
        return "diverged"
    text = f"{value:.2f}%" if task == "digits" else f"{value:.3f}"
    return text + (f" ({bad} of {total} seeds diverged)" if bad else "")


def _kb(results, task, scheme, n):
    r = rep.one(results, task=task, scheme=scheme, n=n)
    return r["bytes_per_step"] / 1000 if r else float("nan")


def _peak(results, task, scheme, n, variant=None):
    group = "sensitivity" if variant else "main"
    r = rep.one(results, group=group, variant=variant, task=task, scheme=scheme, n=n)
    s = rep.residue_stats(r) if r else None
    values = rep.finite(r["residue_norm"]) if r else []  # (the peak before any overflow)
    return max(values) if values else float("nan"), (s or {}).get("final", float("nan"))


def _beyond_rule(job, again):
    """Where two jobs first differ by the table's rule (``first_difference``), in words."""
    from benchmarks.convergence_horovod import first_difference

    epoch = first_difference(job, again)
    return f"epoch {epoch}" if epoch else "no epoch"


def _trend(results, task, scheme, n):
    """The residue norm's last-quarter mean against the previous quarter's, in words."""
    r = rep.one(results, task=task, scheme=scheme, n=n)
    growth = rep.residue_stats(r)["growth"] if r else float("nan")
    if not growth == growth:
        return "not recorded"
    trend = "falling" if growth < 0.95 else "flat" if growth <= 1.05 else "still rising"
    return f"{growth:.2f}x the previous quarter's ({trend})"


def _overlap(results, task, scheme, n):
    r = rep.one(results, task=task, scheme=scheme, n=n)
    o = rep.overlap_stats(r, 0) if r else None
    return o["mean"] if o else float("nan")


def _sens(results, variant, scheme, task="digits"):
    r = rep.one(results, group="sensitivity", variant=variant, task=task, scheme=scheme, n=64)
    return rep.fmt_metric(r) if r else "–"


def _stderr(values):
    mean = sum(values) / len(values)
    return (sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values)) ** 0.5 if len(values) > 1 else 0.0


def _spread(crit, scheme):
    values = [100 * v[scheme]["final"]["accuracy"] for v in crit["pairs"].values()]
    return f"{min(values):.2f}-{max(values):.2f}%"


def analysis(results, crit):
    """Where schemes lose and why, with the numbers of this run (seed means unless said otherwise)."""
    if results.get("smoke") or 64 not in results["workers"]:
        return ["## Reading", "", "A smoke run: too short to read anything into."]
    R = results
    m = lambda *a: _m(R, *a)  # noqa: E731
    kb = lambda *a: _kb(R, *a)  # noqa: E731
    knob = lambda task, scheme, n: R["matching"][task][str(n)][scheme]["knob"]  # noqa: E731
    lines = ["## Reading the results", ""]
    if crit:
        lines += [*_criterion_text(crit), "", *_what_it_takes(R, crit), ""]
    ov_d1, ov_d01 = _overlap(R, "digits", "scalecom_b1", 64), _overlap(R, "digits", "scalecom", 64)
    ov_c1, ov_c01 = _overlap(R, "charlm", "scalecom_b1", 64), _overlap(R, "charlm", "scalecom", 64)
    big = rep.one(R, group="sensitivity", variant="per-worker batch 64", task="charlm", scheme="scalecom", n=64)
    lines += [
        "### ScaleCom: overlap and memory",
        "",
        f"* **The leader's indices are not the global top-k at these batch sizes.** Mean overlap at "
        f"n = 64 is {ov_d01:.2f} (digits) and {ov_c01:.2f} (LM) with beta 0.1, {ov_d1:.2f} and "
        f"{ov_c1:.2f} with beta 1 (chance is 0.01). The leader sees 16 of the step's 1,024 examples, "
        "and with per-worker batches this small its own gradient noise decides much of its top-k.",
        "* **The low-pass filter does not raise the overlap here; it bounds the memory.** With beta 1 "
        "every worker's memory accumulates the same unsent gradient, which then dominates p_i and "
        "makes the leader agree with the global top-k more often (digits) -- but that memory is "
        "what explodes. With beta 0.1 the memory keeps only a tenth of each unsent gradient (off I, "
        "m += 0.1 g) and 90 % of its old value on the entries just sent (which are therefore sent "
        "again), so p_i is mostly the worker's fresh gradient: lower "
        "overlap, a residue that stays small (peak "
        f"{_peak(R, 'digits', 'scalecom', 64)[0]:.2g} on digits, {_peak(R, 'charlm', 'scalecom', 64)[0]:.2g} "
        f"on the LM at n = 64; its last-quarter mean is {_trend(R, 'digits', 'scalecom', 64)} on digits "
        f"and {_trend(R, 'charlm', 'scalecom', 64)} on the LM). The figures show both over training.",
        f"* **On the language model ScaleCom loses to the top-k schemes at the same k.** At n = 64: "
        f"ScaleCom {m('charlm', 'scalecom', 64)} (beta 0.1) and {m('charlm', 'scalecom_b1', 64)} "
        f"(beta 1) against global top-k {m('charlm', 'global_topk', 64)}, local top-k "
        f"{m('charlm', 'local_topk', 64)} and dense {m('charlm', 'dense', 64)}. Global top-k sends the "
        "same bytes, so the loss is the leader's selection, not the sparsity. Here beta 1 beats "
        "beta 0.1 at every n: forgetting 90 % of the unsent gradient costs more than it saves when "
        "nothing explodes.",
    ]
    if big is not None:
        dense_big = rep.one(R, group="sensitivity", variant="per-worker batch 64", task="charlm", scheme="dense", n=64)
        b1_big = rep.one(R, group="sensitivity", variant="per-worker batch 64", task="charlm",
                         scheme="scalecom_b1", n=64)
        gap16 = rep.metric(rep.one(R, task="charlm", scheme="scalecom", n=64)) - \
            rep.metric(rep.one(R, task="charlm", scheme="dense", n=64))
        gap16_b1 = rep.metric(rep.one(R, task="charlm", scheme="scalecom_b1", n=64)) - \
            rep.metric(rep.one(R, task="charlm", scheme="dense", n=64))
        lines += [
            f"* **A 4x larger per-worker batch does not close the gap on the LM.** With 64 windows per "
            f"worker (global 4,096, seed 0) dense reaches {rep.fmt_metric(dense_big)}, ScaleCom "
            f"{rep.with_overlap(big)} (beta 0.1) and {rep.with_overlap(b1_big)} (beta 1): gaps to dense "
            f"of {rep.metric(big) - rep.metric(dense_big):+.3f} and {rep.metric(b1_big) - rep.metric(dense_big):+.3f} "
            f"nats against {gap16:+.3f} and {gap16_b1:+.3f} at 16 windows per worker, and the overlap "
            "hardly moves. On this model the leader's top-1 % differs from the global one even when "
            "its batch is 64 windows: the premise that workers share their largest entries is weak "
            "here, whatever the batch.",
        ]
    pipelined = [(task, rep.one(R, group="sensitivity", variant="pipelined indices", task=task,
                                scheme="scalecom_pipelined", n=64),
                  rep.one(R, task=task, scheme="scalecom", n=64)) for task in ("digits", "charlm")]
    if all(p and m for _, p, m in pipelined):
        lines.append(
            "* **Pipelined indices.** With `pipelined=True` (each step uses the indices "
            "the leader selected a step earlier, which takes the index exchange out of the backward "
            "pass; see docs/performance.md) ScaleCom at n = 64, seed 0, reaches "
            + " and ".join(f"{rep.with_overlap(p)} on {task} (not pipelined: {rep.with_overlap(m)})"
                           for task, p, m in pipelined)
            + " (a single seed each: on digits, see above for how far single runs move).")
    lines += [
        "",
        "### Where the other schemes lose, and why",
        "",
        f"* **Local top-k** is as accurate as anything ({m('digits', 'local_topk', 64)}, "
        f"{m('charlm', 'local_topk', 64)} at n = 64: the union of n local top-k sets is a much denser "
        f"update), but its allgather grows linearly with n: {kb('digits', 'local_topk', 4):.0f}, "
        f"{kb('digits', 'local_topk', 16):.0f} and {kb('digits', 'local_topk', 64):.0f} kB per worker "
        f"per step on digits at n = 4, 16, 64, against ScaleCom's {kb('digits', 'scalecom', 4):.1f}, "
        f"{kb('digits', 'scalecom', 16):.1f} and {kb('digits', 'scalecom', 64):.1f}; at n = 64 it "
        f"sends {kb('digits', 'local_topk', 64) / kb('digits', 'dense', 64):.0%} of dense SGD's bytes.",
        f"* **Global top-k** is the ideal ScaleCom approximates ({m('digits', 'global_topk', 64)}, "
        f"{m('charlm', 'global_topk', 64)} at n = 64 with ScaleCom's bytes), but only with an oracle: "
        "finding the top-k of the sum for real takes a dense allreduce of p.",
        f"* **gTop-k** needs a power-of-two number of workers (the simulator refuses others; 4, 16 "
        f"and 64 are); its log2 n exchanges of k pairs cost {kb('digits', 'gtopk', 64):.0f} kB at "
        f"n = 64 on digits, {kb('digits', 'gtopk', 64) / kb('digits', 'scalecom', 64):.1f}x ScaleCom, "
        "growing with log n, and each merge drops entries into the residuals "
        f"(its residue on the LM reaches {_peak(R, 'charlm', 'gtopk', 64)[0]:.3g}); on the LM at n = 64 "
        f"it ends at {m('charlm', 'gtopk', 64)}, no better than ScaleCom.",
        f"* **Random-k** diverges or collapses at n >= 16 on both tasks ({m('digits', 'random_k', 16)} "
        f"and {m('digits', 'random_k', 64)} on digits, {m('charlm', 'random_k', 64)} on the LM at n = 64; "
        f"{m('digits', 'random_k', 4)} at n = 4). Random indices carry about k/d of the gradient's "
        "energy, so the error-feedback memory must hold the rest: each entry waits about 1/ratio = "
        f"100 steps, the residue grows without bound (peak {_peak(R, 'digits', 'random_k', 64)[0]:.2g}) "
        "and momentum applies it in bursts. It would need a learning rate about d/k times smaller.",
        f"* **Sketched SGD** loses at matched bytes: a count sketch of FetchSGD's proportions (5 rows "
        "x 10 k columns, plus 2 k exact candidates) is 52 floats per selected coordinate, so within "
        f"ScaleCom's bytes it can select only about "
        f"1/{R['recipes']['digits']['ratio'] / knob('digits', 'sketched', 64):.0f} "
        f"of ScaleCom's k (ratio {knob('digits', 'sketched', 64):.2g}). It then "
        f"applies few coordinates per step and its error accumulation grows "
        f"({_peak(R, 'digits', 'sketched', 64)[1]:.3g} on digits at n = 64, still rising): "
        f"{m('digits', 'sketched', 64)} on digits and {m('charlm', 'sketched', 64)} on the LM at n = 64. "
        "Keeping ScaleCom's k instead leaves room for a sketch with fewer cells than k "
        "(1 row of k/2 columns), whose collisions make the heavy-hitter estimates noise (not run here).",
        f"* **PowerSGD** (rank 2, the nearest rank in bytes: {kb('digits', 'powersgd', 64):.1f} against "
        f"ScaleCom's {kb('digits', 'scalecom', 64):.1f} kB at n = 64, "
        f"{kb('digits', 'powersgd', 64) / kb('digits', 'scalecom', 64) - 1:.0%} more) is the strongest "
        f"competitor on these small models: {m('digits', 'powersgd', 64)} and "
        f"{m('charlm', 'powersgd', 64)} at n = 64, and like ScaleCom its bytes do not grow with n. "
        "Its costs are elsewhere: two dependent allreduces and an orthogonalisation per matrix, and "
        "rank 1 (fewer bytes than ScaleCom) is the only cheaper setting.",
        f"* **Qsparse-local-SGD** is good at n = 4 ({m('digits', 'qsparse', 4)}, "
        f"{m('charlm', 'qsparse', 4)}) and degrades with n: its per-worker top-k travels by allgather, "
        f"so at matched bytes its k must shrink as 1/n (ratio {knob('digits', 'qsparse', 4):.2g} at n = 4, "
        f"{knob('digits', 'qsparse', 64):.2g} at n = 64 on digits), and between synchronisations every "
        "worker takes 8 local steps at the scaled "
        f"learning rate, so the drift it compresses grows: {m('digits', 'qsparse', 64)} on digits "
        f"(residue peak {_peak(R, 'digits', 'qsparse', 64)[0]:.2g}) and {m('charlm', 'qsparse', 64)} "
        "on the LM at n = 64.",
        f"* **FP16** matches dense ({m('digits', 'fp16', 64)}, {m('charlm', 'fp16', 64)} at n = 64) at "
        "half the bytes, which is all it saves.",
        "",
        *_horovod_text(results),
        "### Caveats",
        "",
        "* Small models (125k-167k parameters) and small per-worker batches on a CPU budget; the "
        "paper's claims are for ResNets and Transformers with per-worker batches of 32 or more, where "
        "the overlap is reported higher. Two seeds per configuration (five for the criterion): "
        "differences below about a point on digits or 0.01 nats on the LM are within noise, and on "
        "digits at n = 64 single runs of ScaleCom can move by more (the criterion above).",
        "* One recipe for all schemes was chosen on dense SGD and the ScaleCom defaults; schemes "
        "with their own optimal learning rates (random-k, Sketched SGD) would do better with their "
        "own tuning.",
        "* Bytes are counted, not timed: latency, the exchange of the leader's indices on the critical path "
        "and compute are not in these figures.",
    ]
    return lines + hand_written()


HAND_WRITTEN = "<!-- hand-written:"
PAGE = os.path.join(ROOT, "docs", "convergence.md")


def hand_written(page=PAGE):
    """The hand-written end of ``docs/convergence.md`` (from its ``<!-- hand-written: ...`` line on),
    which this module does not write, so that regenerating the page keeps it; [] without one."""
    try:
        with open(page) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    start = next((i for i, line in enumerate(lines) if line.startswith(HAND_WRITTEN)), None)
    return [] if start is None else ["", *lines[start:]]


def _accuracy(r):
    return 100 * r["final"]["accuracy"]


def _criterion_text(crit):
    """The n = 64 criterion: the verdict on the mean, the seeds, and how much a run depends on ties."""
    seeds, gaps = list(crit["pairs"]), crit["gaps"]
    within = sum(1 for g in gaps if g >= -1.0)
    collapsed = [seed for seed, g in zip(seeds, gaps) if g < -10.0]
    lines = [
        "### The n = 64 criterion",
        "",
        f"**{'Holds' if crit['holds'] else 'Does not hold'} on the mean over {len(gaps)} seeds.** "
        f"ScaleCom (ratio 0.01, beta 0.1) reaches {crit['scalecom']:.2f}% against dense "
        f"{crit['dense']:.2f}%, a gap of {crit['gap']:+.2f} points; {within} of {len(gaps)} seeds are "
        f"no more than 1 point below dense (gaps {', '.join(f'{g:+.2f}' for g in gaps)}). One point is 3.6 of the 360 "
        f"test images. Dense ranges over {_spread(crit, 'dense')} across these seeds, ScaleCom over "
        f"{_spread(crit, 'scalecom')}.",
    ]
    if collapsed:
        rest = [g for seed, g in zip(seeds, gaps) if seed not in collapsed]
        lines[-1] += (f" Seed{'s' if len(collapsed) > 1 else ''} {', '.join(map(str, collapsed))} "
                      f"collapsed (more than 10 points below dense); over the other {len(rest)} the mean "
                      f"gap is {sum(rest) / len(rest):+.2f} points." if rest else "")
    else:
        lines[-1] += (f" Seed to seed both move by several points: the mean gap's standard error is "
                      f"about {_stderr(gaps):.1f} points, so a single-seed verdict either way would be noise.")
    if crit["exact"] is not None:
        exact = [_accuracy(v["scalecom_exact"]) for v in crit["pairs"].values()]
        default = [_accuracy(v["scalecom"]) for v in crit["pairs"].values()]
        moved = max(abs(a - b) for a, b in zip(exact, default))
        lines += [
            "",
            f"**Ties decide single runs.** ScaleCom with the exact selection (`torch.topk`), which takes "
            "the same top-k at every step except which of several entries tied at the k-th magnitude it "
            f"keeps, reaches {crit['exact']:.2f}% on the mean ({crit['exact'] - crit['dense']:+.2f} points; "
            f"per seed {', '.join(f'{a:.2f}%' for a in exact)}), the same seeds moving by up to "
            f"{moved:.1f} points. Ties are common here: the digits' 3 pixels that are constant over the "
            "data set give each hidden unit three first-layer weights with identical gradients. The "
            "default selection keeps the lowest indices among tied entries, `torch.topk` others; both "
            "are exact top-k. That runs differing only in such choices end this far apart says that "
            "ScaleCom at n = 64 on this recipe sits close to instability, and that the criterion's "
            "verdict rests on a handful of runs.",
        ]
    return lines


def _what_it_takes(R, crit):
    """The sensitivity runs (seed 0), described from their numbers."""
    peak = lambda scheme, variant=None: _peak(R, "digits", scheme, 64, variant)[0]  # noqa: E731
    b1 = rep.one(R, task="digits", scheme="scalecom_b1", n=64)
    return [
        "What the recipe does (the sensitivity table, seed 0; every change applied to dense as well):",
        "",
        f"* **the dense warm-up.** Compressing from step 0 gives ScaleCom "
        f"{_sens(R, 'no compression warm-up', 'scalecom')} with beta 0.1 and "
        f"{_sens(R, 'no compression warm-up', 'scalecom_b1')} with beta 1 (chance is 10%), the residue "
        f"memory peaking at {peak('scalecom', 'no compression warm-up'):.2g} with beta 0.1: it fills "
        "while the network is far from a minimum and the gradients are large. A longer warm-up (64 "
        f"steps) gives {_sens(R, 'compression warm-up 64 steps', 'scalecom')} (beta 0.1) and "
        f"{_sens(R, 'compression warm-up 64 steps', 'scalecom_b1')} (beta 1).",
        f"* **beta.** Beta 0.1 (the paper's value for large batches) gives "
        f"{rep.fmt_metric(rep.one(R, task='digits', scheme='scalecom', n=64))}, beta 0.03 "
        f"{_sens(R, 'beta sweep', 'scalecom_beta0.03')}, 0.3 {_sens(R, 'beta sweep', 'scalecom_beta0.3')} "
        f"and 0.5 {_sens(R, 'beta sweep', 'scalecom_beta0.5')} (residue peaks "
        f"{peak('scalecom_beta0.3', 'beta sweep'):.2g} and {peak('scalecom_beta0.5', 'beta sweep'):.2g}), "
        f"beta 1 (classic error feedback) {rep.fmt_metric(b1)} with a residue peak of "
        f"{peak('scalecom_b1'):.2g}. The filter is what keeps the memory bounded here.",
        "* **learning-rate scaling**: linear scaling (peak 1.6) gives "
        f"{_sens(R, 'lr scaled linearly with n', 'dense')} "
        f"for dense and {_sens(R, 'lr scaled linearly with n', 'scalecom')} for ScaleCom; no scaling (0.1) "
        f"{_sens(R, 'lr not scaled with n', 'dense')} against {_sens(R, 'lr not scaled with n', 'scalecom')}. "
        "Square-root scaling (the main recipe) is the one that trains both.",
        f"* **batch per worker**: halving it to 8 gives {_sens(R, 'per-worker batch 8', 'dense')} "
        f"against {_sens(R, 'per-worker batch 8', 'scalecom')}. Digits cannot give the paper's large "
        "per-worker batches at n = 64 (each shard holds 22 images); on the language model a 4x "
        "larger batch per worker is measured below.",
        "",
        ("The main recipe (square-root learning-rate scaling, per-worker batch 16, 32 dense warm-up "
         "steps, beta 0.1) is the same for every scheme; nothing in it was tuned for ScaleCom alone, "
         "but ScaleCom is the scheme that needs the warm-up and the small beta"
         + (", and it meets the criterion on the mean with little margin." if crit["holds"] else
            ", and with it ScaleCom misses the criterion on the mean of these seeds.")),
    ]


def _horovod_text(results):
    """How the horovodrun jobs compare with the simulator's replay and with each other."""
    rows = {r["compression"]: r for r in results.get("horovod", [])}
    row = rows.get("scalecom")
    if not row or "horovod_again" not in row:
        return []
    job, again, sim = row["horovod"], row["horovod_again"], row["simulator"]
    epochs = len(job["per_epoch"])
    jobs_loss = next((a["epoch"] for a, b in zip(job["per_epoch"], again["per_epoch"])
                      if round(a["loss"], 4) != round(b["loss"], 4)), None)
    first = row["first_different_epoch"]
    agree = f"through epoch {first - 1} of {epochs}" if first else f"in all {epochs} epochs"
    lines = [
        "### The simulator against horovodrun",
        "",
        f"* ScaleCom's `horovodrun -np {row['workers']}` job and the simulator's replay agree on every "
        f"epoch's test accuracy and (within the example's 4 printed decimals and 1 %) its loss {agree}"
        + (f"; at epoch {first} they part, and end at {100 * job['accuracy']:.2f}% against "
           f"{100 * sim['accuracy']:.2f}% after epoch {epochs}" if first else "") + ". "
        + ("Two runs of the same job are not bit-identical either: their printed losses first differ "
           f"at epoch {jobs_loss} ({_beyond_rule(job, again)} by the table's rule), most likely because Horovod "
           "fuses tensors into buffers as they become "
           "ready, and an entry's place in a fused buffer decides the order of the ring's sums; "
           "training then amplifies such rounding "
           "differences. " if jobs_loss else "")
        + "Bit-exact agreement of the compressor with the simulator over a few steps is a test "
        "(`tests/test_sim_horovod.py`); the bytes each rank hands to Horovod equal the simulator's "
        f"count ({job['sent_bytes_last_step']:,} B per step).",
        "",
    ]
    return lines
