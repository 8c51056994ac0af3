"""End to end on a slow link: Horovod (Gloo) jobs in a network namespace whose loopback is shaped by
a token bucket; writes the "Slow link" section of docs/performance.md and docs/slow_link.png.

    sudo .venv/bin/python -m benchmarks.slow_link            # 1 and 10 Gbit/s, 2 and 4 workers
    sudo .venv/bin/python -m benchmarks.slow_link --smoke    # tiny model, 1 Gbit/s, 2 workers, 1 step,
                                                             # dense and ScaleCom 0.01
    .venv/bin/python -m benchmarks.slow_link --scalecom-kwargs '{"pipelined": true}'  # extra options

For every rate the benchmark makes its own namespace (``ip netns add``), brings its loopback up with
a 9000-byte MTU (so that the token bucket holds whole packets), shapes it with ``tc qdisc add dev lo
root tbf rate RATE burst BURST latency ...``, runs ``ip netns exec NAME horovodrun -np N -H
localhost:N --gloo`` with one thread per worker, and removes the namespace when done (also on
errors, SIGTERM, SIGINT and SIGHUP; a namespace left by a run that was killed outright is removed by
the next run, and its ``horovodrun`` dies with it). All workers' traffic shares the one shaped
loopback, like workers behind a single link. The bucket (``BURST``, :data:`SHAPES`) holds a few
packets: a larger one would let each exchange's first megabytes leave at loopback speed after the
pause of a compute phase, which favours the small exchanges of compressed schemes. Without root,
without ``ip``/``tc``, or where ``ip netns add`` fails, it says so and skips (exit 0) before any
job; a failure to shape a namespace it could make is an error.

Each job trains an MLP (8.4M parameters by default) on synthetic data: ``--warmup`` untimed steps,
then ``--steps`` timed ones; the table gives rank 0's median step time, ratios against dense in the
same namespace and worker count, and the bytes per step per worker that the loopback really sent
(its ``tx_bytes`` counter, read between barriers around the timed steps, divided by steps and
workers; TCP/IP headers and Horovod's coordination messages included). The floor is the same step
with no communication at all, timed in the same job by all its workers at once right after the
timed steps (see the worker's doc).

Jobs are ``NAME`` or ``NAME:JSON`` with NAME a key of ``_slow_link_worker.COMPRESSORS`` (or of its
``OPTIMIZER_WRAPPERS``: Qsparse-local-SGD, whose step time and bytes are means over the timed steps,
since it synchronises every few steps) and JSON passed to its factory; ``--scalecom-kwargs`` is
merged into every ScaleCom job.
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import shutil
import statistics
import subprocess
import sys
import time

from benchmarks._report import COUNT, NON_NEGATIVE, SECONDS, output_file, output_path, replace_section, shown_arguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_slow_link_worker.py")
DEFAULT_JOBS = ["dense", "fp16", 'scalecom:{"ratio": 0.01}', 'scalecom:{"ratio": 0.001}',
                'scalecom:{"ratio": 0.01, "pipelined": true}',
                # the seed systems: Sketched SGD at about ScaleCom 0.01's payload (FetchSGD's sketch
                # proportions leave k / 35, as in docs/convergence.md), Qsparse synchronising every
                # 5 steps (2 synchronisations in the 10 timed steps)
                'sketched:{"ratio": 0.0003}', 'qsparse:{"local_steps": 5}']
DEFAULT_WIDTHS = [1024, 2048, 2048, 1024, 10]  # the MLP's layer widths: 8.4M parameters
SCALECOM_DEFAULTS = {"selection": "threshold"}  # the exact top-k set, found faster
# Token bucket per rate: the smallest of 64 KB, 128 KB, ... with which one TCP stream of 64 and 256 MiB
# met the rate here (0.99 Gbit/s at 1gbit; 9.5-9.6 Gbit/s at 10gbit, where 128-512 KB gave 8.2-9.4).
SHAPES = {"1gbit": ("128kb", "50ms"), "10gbit": ("1mb", "50ms"), "100mbit": ("64kb", "200ms")}
MTU = 9000


class Skip(Exception):
    """Network namespaces are not available here."""


class JobFailed(Exception):
    """A Horovod job in the namespace failed or ran past ``--timeout``: reported, with its output's
    end, without a traceback (the namespace is removed on the way out)."""


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


PREFIX = "hvdsc_slow_"


def check_namespaces():
    """Skip unless this process can make network namespaces (before any job: a skip later would
    discard finished measurements); removes namespaces that runs killed outright left behind."""
    if os.geteuid() != 0:
        raise Skip("network namespaces need root (ip netns add); run as root to measure")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise Skip("the ip and tc commands (iproute2) are not installed")
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = (line.split() or [""])[0]
        pid = name[len(PREFIX):].split("_")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)
    probe = f"{PREFIX}{os.getpid()}_probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise Skip(f"ip netns add failed: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


@contextlib.contextmanager
def shaped_namespace(rate):
    """A fresh network namespace whose loopback is shaped to ``rate``; removed on exit."""
    name = f"{PREFIX}{os.getpid()}_{rate}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        raise RuntimeError(f"ip netns add {name} failed: {made.stderr.strip()}")
    try:
        burst, latency = SHAPES[rate]
        for cmd in (["ip", "link", "set", "lo", "mtu", str(MTU), "up"],
                    ["tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate, "burst", burst,
                     "latency", latency]):
            done = _ip("netns", "exec", name, *cmd, check=False)
            if done.returncode != 0:  # namespaces work here: a failure now is an error, not a skip
                raise RuntimeError(f"{' '.join(cmd)} failed in the namespace: {done.stderr.strip()}")
        yield name
    finally:
        _ip("netns", "del", name, check=False)


CALIBRATE = r"""
import socket, threading, time
N = %d
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
def sink():
    c, _ = srv.accept(); got = 0
    while got < N:
        b = c.recv(1 << 20)
        if not b: break
        got += len(b)
    c.close()
t = threading.Thread(target=sink); t.start()
s = socket.create_connection(srv.getsockname()); buf = bytes(1 << 20)
start = time.perf_counter(); sent = 0
while sent < N:
    s.sendall(buf); sent += len(buf)
s.close(); t.join()
print(8 * N / (time.perf_counter() - start) / 1e9)
"""


def calibrate(namespace, nbytes):
    """Gbit/s one TCP stream gets through the namespace's loopback."""
    out = subprocess.run(["ip", "netns", "exec", namespace, sys.executable, "-c", CALIBRATE % nbytes],
                         capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _env(extra=None):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                "TF_NUM_INTEROP_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "HOROVOD_CYCLE_TIME": "1"})
    env.update(extra or {})
    return env


def _results(output):
    rows = []
    for line in output.splitlines():
        at = line.find("RESULT ")
        if at >= 0:
            rows.append(json.loads(line[at + len("RESULT "):]))
    return rows


def _die_with_parent():
    """In the child before exec: SIGTERM when the benchmark dies, however it dies (``ip netns exec``
    execs horovodrun, which keeps the setting and stops its workers on SIGTERM)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def horovod_job(namespace, workers, spec, timeout):
    from devtools.launch import horovodrun_command

    cmd = ["ip", "netns", "exec", namespace,
           *horovodrun_command([WORKER, json.dumps(spec)], np=workers, controller="gloo")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                              preexec_fn=_die_with_parent)
    except subprocess.TimeoutExpired as e:  # (run() has killed horovodrun; its workers follow it)
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                         for x in (e.stdout, e.stderr))
        raise JobFailed(f"{spec['compressor']} with {workers} workers ran past --timeout {timeout:g} s and was "
                        f"stopped ({' '.join(cmd)}); its output ended:\n{output[-6000:]}") from None
    rows = _results(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not rows:
        raise JobFailed(f"{spec['compressor']} with {workers} workers: {' '.join(cmd)} exited with "
                        f"{proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return rows[0]


def json_object(text):
    """An argparse ``type``: a JSON object (a scheme's keyword arguments)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object of keyword arguments, got {text!r}")
    return value


def job(text):
    """An argparse ``type``: ``NAME`` or ``NAME:JSON``, NAME a scheme the worker knows, JSON an object."""
    from benchmarks._slow_link_worker import COMPRESSORS, OPTIMIZER_WRAPPERS
    name, colon, raw = text.partition(":")
    known = sorted({*COMPRESSORS, *OPTIMIZER_WRAPPERS})
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown scheme {name!r} in {text!r}: NAME or NAME:JSON, NAME one of "
                                         f"{', '.join(known)}")
    if colon:
        json_object(raw)
    return text


def widths(text):
    """An argparse ``type``: the MLP's layer widths, ``IN,HIDDEN,...,OUT``, at least two, each >= 1."""
    try:
        values = [int(w) for w in text.split(",")]
    except ValueError:
        values = []
    if len(values) < 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be two or more comma-separated integers >= 1, got {text!r}")
    return values


def check_job(name, kwargs, widths):
    """Build the job's scheme on the job's model in this process (no Horovod needed), so that options
    it refuses (an unknown keyword, a ratio of 2) stop the benchmark before any namespace or job, not
    inside the namespace after the jobs before it ran. Raises TypeError or ValueError."""
    import torch

    from benchmarks._slow_link_worker import COMPRESSORS, NO_OPTIONS, OPTIMIZER_WRAPPERS, make_model
    if name in NO_OPTIONS:
        if kwargs:
            raise TypeError(f"{name} takes no options, got {json.dumps(kwargs)}")
        return
    model = make_model(widths)
    if name in OPTIMIZER_WRAPPERS:
        OPTIMIZER_WRAPPERS[name](model, torch.optim.SGD(model.parameters(), lr=0.01), kwargs)
    else:
        COMPRESSORS[name](None, model, kwargs)


def parse_job(text, scalecom_kwargs):
    name, _, raw = text.partition(":")
    kwargs = json.loads(raw) if raw else {}
    if name == "scalecom":
        kwargs = {**SCALECOM_DEFAULTS, **kwargs, **scalecom_kwargs}
    return name, kwargs


def label(name, kwargs):
    if name == "scalecom":
        extra = {k: v for k, v in kwargs.items() if k not in ("ratio",) and SCALECOM_DEFAULTS.get(k) != v}
        text = f"ScaleCom {kwargs.get('ratio', 0.01):g}"
        return text + (f" {json.dumps(extra, sort_keys=True)}" if extra else "")
    if name == "fp16":
        return "Horovod fp16"
    name = {"sketched": "Sketched SGD", "qsparse": "Qsparse-local-SGD (mean step)"}.get(name, name)
    return name + (f" {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")


def run(args):
    base = {"widths": args.widths, "batch": args.batch, "warmup": args.warmup, "steps": args.steps}
    jobs = [parse_job(j, args.scalecom_kwargs) for j in args.jobs]
    rows, links = [], {}
    check_namespaces()
    for rate in args.rates:
        with shaped_namespace(rate) as ns:
            links[rate] = calibrate(ns, args.calibrate_bytes)
            print(f"{rate}: one TCP stream gets {links[rate]:.2f} Gbit/s", flush=True)
            for workers in args.workers:
                runs = {i: [] for i in range(len(jobs))}
                for repeat in range(args.repeats):  # forward, then backward: drifts in load cancel
                    order = range(len(jobs)) if repeat % 2 == 0 else reversed(range(len(jobs)))
                    for i in order:
                        name, kwargs = jobs[i]
                        r = horovod_job(ns, workers, dict(base, compressor=name, kwargs=kwargs), args.timeout)
                        r.update(rate=rate, label=label(name, kwargs))
                        runs[i].append(r)
                        print(f"{rate:>7} {workers} workers {r['label']:28s} "
                              f"{1e3 * r['median_step_seconds']:9.1f} ms/step  "
                              f"{per_worker_bytes(r) / 1e6:9.3f} MB/step/worker  floor "
                              f"{1e3 * r['floor_seconds']:7.1f} ms", flush=True)
                rows.extend(combine(runs[i]) for i in range(len(jobs)))
    return rows, links


def combine(repeats):
    """One row from repeated jobs: medians of their median step, floor, bytes and statistics."""
    row = dict(repeats[0])
    row["repeats"] = len(repeats)
    for key in ("median_step_seconds", "floor_seconds"):
        row[key] = statistics.median(r[key] for r in repeats)
    if all(r.get("tx_bytes") is not None for r in repeats):
        row["tx_bytes"] = statistics.median(r["tx_bytes"] for r in repeats)
    if "compressor_stats" in row:
        row["compressor_stats"] = {k: statistics.median(r["compressor_stats"][k] for r in repeats)
                                   for k in row["compressor_stats"]}
    return row


def payload(r):
    """Bytes this rank handed to Horovod per step (the compressor's own count where it keeps one)."""
    sent = r.get("compressor_stats", {}).get("sent_bytes")
    if sent is not None:
        return sent
    return r["dense_bytes"] // 2 if r["compressor"] == "fp16" else r["dense_bytes"]


def per_worker_bytes(r):
    if r.get("tx_bytes") is None:
        return float("nan")
    return r["tx_bytes"] / r["steps"] / r["workers"]


def markdown(rows, links, args, command, plot, load):
    params = rows[0]["parameters"] if rows else 0
    lines = [
        "## Slow link: step time of Horovod jobs on a shaped loopback",
        "",
        f"Made by `{command}` (as root). An MLP of widths {args.widths} ({params:,} parameters, "
        f"{4 * params / 1e6:.1f} MB of fp32 gradients), batch {args.batch} of synthetic data per worker, "
        f"one thread per worker, Gloo, `HOROVOD_CYCLE_TIME=1`; {args.warmup} warm-up and {args.steps} "
        f"timed steps per job, rank 0's median step, median over {args.repeats} runs of each job (in "
        "alternating order). All workers share one loopback shaped by `tc tbf` "
        f"(MTU {MTU}; bucket "
        + ", ".join(f"{SHAPES[k][0]} at {k}" for k in links)
        + f"); a single TCP stream of {args.calibrate_bytes >> 20} MiB measured "
        + ", ".join(f"{v:.2f} Gbit/s at {k}" for k, v in links.items())
        + ". Bytes: the namespace's `lo` `tx_bytes` over the timed steps, per step and worker (TCP/IP "
        "headers and Horovod's own coordination messages included; payload: what each worker hands "
        "to Horovod's collectives). Floor: the same step with no communication, timed in the same job "
        "right after the timed steps by all N workers at once (a copy of the model, a plain "
        f"optimizer), so it shares the cores as the job does (up to {max(args.workers)} workers on "
        f"this {os.cpu_count()}-core machine). ScaleCom runs with "
        f"`{json.dumps(SCALECOM_DEFAULTS)}` (the exact top-k set) plus any options shown. Index wait: "
        "rank 0's waits for the leader's indices (ScaleCom) or for its two rounds' allreduces (Sketched "
        "SGD), which its compress time leaves out. Load "
        f"average of the machine (the jobs' own workers included): {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end.",
        "",
        "| link | workers | scheme | ms/step | vs dense | speed-up over dense | floor ms | vs floor | "
        "MB/step/worker (wire) | wire bytes vs dense | payload MB/step/worker | index wait ms/step | "
        "compress ms/step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        dense = next((d for d in rows if d["rate"] == r["rate"] and d["workers"] == r["workers"]
                      and d["compressor"] == "dense"), None)
        step = r["median_step_seconds"]
        vs = f"{step / dense['median_step_seconds']:.3f}" if dense else "n/a"
        speed = f"{dense['median_step_seconds'] / step:.2f}x" if dense else "n/a"
        wire = per_worker_bytes(r)
        wire_vs = f"{wire / per_worker_bytes(dense):.4f}" if dense else "n/a"
        cs = r.get("compressor_stats", {})
        wait = f"{1e3 * cs['index_wait_seconds']:.1f}" if "index_wait_seconds" in cs else ""
        comp = f"{1e3 * cs['compress_seconds']:.1f}" if "compress_seconds" in cs else ""
        lines.append(f"| {r['rate']} | {r['workers']} | {r['label']} | {1e3 * step:.1f} | {vs} | {speed} | "
                     f"{1e3 * r['floor_seconds']:.1f} | {step / r['floor_seconds']:.2f}x | "
                     f"{wire / 1e6:.3f} | {wire_vs} | {payload(r) / 1e6:.3f} | {wait} | {comp} |")
    if len(args.workers) > 1:
        lines += scaling_table(rows, args.workers)
    if plot:
        lines += ["", f"![step times]({os.path.basename(plot)})"]
    return "\n".join(lines) + "\n"


def scaling_table(rows, workers):
    lines = ["", f"### Bytes per worker per step from {min(workers)} to {max(workers)} workers", "",
              "Ring allreduce sends `2 (n - 1) / n` times the payload per worker (1.0 at 2 workers, 1.5 at "
              "4), a broadcast about `(n - 1) / n`; an allgather (local top-k) would send `n - 1` times "
              "(1 at 2 workers, 3 at 4).", "",
              "| link | scheme | " + " | ".join(f"{n} workers MB/step/worker" for n in workers)
              + " | growth | allreduce model growth |",
              "|---|---|" + "---:|" * len(workers) + "---:|---:|"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for lab in dict.fromkeys(r["label"] for r in rows):
            by_n = {r["workers"]: r for r in rows if r["rate"] == rate and r["label"] == lab}
            if len(by_n) < 2:
                continue
            ns = sorted(by_n)
            first, last = per_worker_bytes(by_n[ns[0]]), per_worker_bytes(by_n[ns[-1]])
            model = (2 * (ns[-1] - 1) / ns[-1]) / (2 * (ns[0] - 1) / ns[0])
            sizes = " | ".join(f"{per_worker_bytes(by_n[n]) / 1e6:.3f}" for n in ns)
            lines.append(f"| {rate} | {lab} | {sizes} | {last / first:.2f}x | {model:.2f}x |")
    return lines


def plot_rows(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["rate"], r["workers"]) for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(groups), 4))
    width = 0.8 / (len(labels) + 1)
    for i, lab in enumerate(labels):
        ys = [next((1e3 * r["median_step_seconds"] for r in rows if (r["rate"], r["workers"]) == g
                    and r["label"] == lab), 0) for g in groups]
        ax.bar([j + i * width for j in range(len(groups))], ys, width, label=lab)
    floor = [statistics.median(1e3 * r["floor_seconds"] for r in rows if (r["rate"], r["workers"]) == g)
             for g in groups]
    ax.bar([j + len(labels) * width for j in range(len(groups))], floor, width,
           label="no communication (floor)", color="black")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels([f"{rate}\n{w} workers" for rate, w in groups])
    ax.set_ylabel("median step (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Horovod step time on a shaped loopback")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # (the running job is killed and the namespace removed on the way out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1gbit, 2 workers, one step, dense and ScaleCom 0.01")
    ap.add_argument("--rates", nargs="+", default=None, choices=list(SHAPES))
    ap.add_argument("--workers", type=COUNT, nargs="+", default=None)
    ap.add_argument("--jobs", type=job, nargs="+", default=None, help="NAME or NAME:JSON (see module doc)")
    ap.add_argument("--scalecom-kwargs", type=json_object, default={},
                    help="JSON merged into every ScaleCom job's constructor arguments")
    ap.add_argument("--widths", type=widths, default=None)
    ap.add_argument("--batch", type=COUNT, default=8, help="per worker")
    ap.add_argument("--warmup", type=NON_NEGATIVE, default=None)
    ap.add_argument("--steps", type=COUNT, default=None)
    ap.add_argument("--repeats", type=COUNT, default=None, help="runs of each job (default 2; 1 in --smoke)")
    ap.add_argument("--timeout", type=SECONDS, default=900)
    ap.add_argument("--out", type=output_file, default=None, help="default: docs/performance.md (a temporary file in --smoke)")
    ap.add_argument("--plot", type=output_file, default=None, help="PNG path (default: docs/slow_link.png; none in --smoke)")
    args = ap.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "performance.md")
    smoke = args.smoke
    args.rates = args.rates or (["1gbit"] if smoke else ["1gbit", "10gbit"])
    args.workers = args.workers or ([2] if smoke else [2, 4])
    args.jobs = args.jobs or (["dense", 'scalecom:{"ratio": 0.01}'] if smoke else DEFAULT_JOBS)
    args.widths = args.widths or ([256, 256, 10] if smoke else DEFAULT_WIDTHS)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.steps = args.steps if args.steps is not None else (1 if smoke else 10)
    # much more than a bucket holds; the smoke test's a quarter second at 1 Gbit/s, so that one
    # scheduling stall of a loaded machine cannot halve the rate it checks
    args.calibrate_bytes = (32 if smoke else 64) << 20
    args.repeats = args.repeats or (1 if smoke else 2)
    for text in args.jobs:  # (each scheme built here once: a bad option is named before anything runs)
        name, kwargs = parse_job(text, args.scalecom_kwargs)
        try:
            check_job(name, kwargs, args.widths)
        except (TypeError, ValueError) as e:
            merged = f" with --scalecom-kwargs {json.dumps(args.scalecom_kwargs)}" \
                if name == "scalecom" and args.scalecom_kwargs else ""
            ap.error(f"argument --jobs: {text!r}{merged}: {e}")
    started = time.perf_counter()
    load = [os.getloadavg()[0]]
    for signum in (signal.SIGTERM, signal.SIGHUP):  # so that the namespace is removed on kill too
        signal.signal(signum, _terminate)
    try:
        rows, links = run(args)
    except Skip as why:
        print(f"slow_link: skipped: {why}", flush=True)
        return 0
    except JobFailed as why:
        print(f"slow_link: failed: {why}", file=sys.stderr, flush=True)
        return 1
    plot = None if smoke and args.plot is None else (args.plot or os.path.join(ROOT, "docs", "slow_link.png"))
    command = " ".join(["python -m benchmarks.slow_link", *map(shlex.quote, shown_arguments(
        sys.argv[1:] if argv is None else argv))])
    replace_section(args.out, "slow_link", markdown(rows, links, args, command, plot,
                                                          load + [os.getloadavg()[0]]))  # (the table first)
    if plot:
        plot_rows(rows, plot)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
