r"""End to end on slow links: Horovod (Gloo) jobs of ``benchmarks.models``' models where each worker has
its own network link shaped by a token bucket, as on a cluster; writes the "Slow link" section of
docs/performance.md and docs/slow_link.png.

    sudo .venv/bin/python -m benchmarks.slow_link            # 1 and 10 Gbit/s per worker, 2 and 4
                                                             # workers, mlp, resnet18 and transformer
    sudo .venv/bin/python -m benchmarks.slow_link --smoke    # tiny MLP, 1 Gbit/s, 2 workers, 1 step,
                                                             # dense and ScaleCom 0.01
    sudo .venv/bin/python -m benchmarks.slow_link --models resnet18 --rates 1gbit --workers 4 \
        --jobs dense 'scalecom:{"ratio": 0.01}' --scalecom-kwargs '{"pipelined": true}'

The full tables for docs/performance.md (one section; each model gets its table)::

    sudo .venv/bin/python -m benchmarks.slow_link --rates 1gbit 10gbit --workers 2 4 \
        --models mlp resnet18 transformer --jobs dense fp16 'scalecom:{"ratio": 0.01}' \
        'scalecom:{"ratio": 0.01, "pipelined": true}' 'qsparse:{"local_steps": 5}'

and the same models on the TensorFlow frontend (Keras 3; dense, fp16 and ScaleCom only), into a
section of its own (``slow_link_tensorflow``) and docs/slow_link_tensorflow.png::

    sudo .venv/bin/python -m benchmarks.slow_link --framework tensorflow --rates 1gbit 10gbit \
        --workers 2 4 --models mlp resnet18 transformer --jobs dense fp16 'scalecom:{"ratio": 0.01}' \
        'scalecom:{"ratio": 0.01, "pipelined": true}'

``--section NAME`` writes the tables into the section NAME of ``--out`` (and the plot to
``docs/NAME.png``), so that runs split by model, worker count or rate keep their own tables, e.g.
``--section slow_link_resnet18 --models resnet18``. ``--rates unshaped`` leaves the links (or the
shared loopback) as they are: the step where the network is free (``benchmarks.overhead`` measures
that with the schemes taking turns step by step in one job).

On a 2-core machine the 10 Gbit/s links are not reached: one Python TCP stream between two worker
namespaces made about 8 Gbit/s there, and two at once about 6 each, unshaped as well as shaped (the
CPU is the limit), and 4 workers share 2 cores with their own computation.

Links (``--link``):

- ``per-worker`` (default): for each rate, ``benchmarks.cluster_links`` makes one network namespace
  per worker, each with its own veth link into a bridge (in a namespace of its own), both directions
  of every link shaped to the rate by ``tc tbf``; addresses 10.77.0.0/24 exist only inside these
  namespaces. The job is started without ``horovodrun``: Horovod's Gloo rendezvous server runs on
  the bridge (10.77.0.254) and each worker is ``ip netns exec NS python _slow_link_worker.py`` with
  the variables ``horovodrun --gloo`` sets (one host per worker: ``HOROVOD_HOSTNAME=worker<i>``,
  local size 1, ``HOROVOD_GLOO_IFACE=eth0``). A worker's link carries its own traffic only: "1gbit"
  is 1 Gbit/s up and 1 Gbit/s down for every worker. Bytes: each worker's ``eth0`` counters.
- ``shared-loopback``: all workers in one namespace whose loopback is shaped (``horovodrun -np N -H
  localhost:N``): one bucket for everyone, so "1gbit" gives each of 2 workers about 0.5 Gbit/s and
  each of 4 about 0.25. Bytes: the loopback's ``tx_bytes``.

Both use an MTU of 9000 (so that the token bucket holds whole packets) and the bucket sizes of
``cluster_links.SHAPES``: a few packets, since a larger bucket would let each exchange's first
megabytes leave at memory speed after the pause of a compute phase, which favours the small
exchanges of compressed schemes. Everything is removed when done (also on errors, SIGTERM, SIGINT
and SIGHUP; namespaces and processes left by a run that was killed outright are removed by the next
run). Without root, without ``ip``/``tc``, or where ``ip netns add`` fails, it says so and skips
(exit 0) before any job; a failure to shape a namespace it could make is an error.

Each job trains a model (``--models``; ``--model-size tiny`` in ``--smoke``) on synthetic data with
one thread per worker: ``--warmup`` untimed steps, then ``--steps`` timed ones; the table gives rank
0's median step time, ratios against dense on the same link, model and worker count, and the bytes
per step per worker on the wire (TCP/IP headers and Horovod's coordination messages included); with
per-worker links also each worker's bytes sent and received per step. The floor is the same step
with no communication, timed in the same job by all its workers at once right after the timed steps
(see the worker's doc).

Jobs are ``NAME`` or ``NAME:JSON`` with NAME a key of ``_slow_link_worker.COMPRESSORS`` (or of its
``OPTIMIZER_WRAPPERS``: Qsparse-local-SGD, whose step time and bytes are means over the timed steps,
since it synchronises every few steps) and JSON passed to its factory; ``--scalecom-kwargs`` is
merged into every ScaleCom job.

Jobs named ``ddp_*`` (keys of ``_slow_link_ddp_worker.HOOKS``: ``ddp_dense``, ``ddp_fp16``,
``ddp_powersgd``, ``ddp_scalecom``) train the same model under ``DistributedDataParallel`` (Gloo)
with torch's fp16 or PowerSGD hook or ``hvd_scalecom.ddp``'s ScaleCom hook, measured by the same
code as the Horovod jobs and compared with DDP dense. On per-worker links each rank is ``ip netns
exec NS python _slow_link_ddp_worker.py`` in its worker's namespace with torch.distributed's
``env://`` variables (``MASTER_ADDR``/``MASTER_PORT`` a store served on the bridge, as torchrun's
agent serves one, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``, ``GLOO_SOCKET_IFNAME=eth0``; see
``cluster_links.torch_job``); on the shared loopback, ``torchrun --standalone`` in the namespace.
Their payload is counted in the torch.distributed calls of the hooks (DDP's own reduction: the fp32
gradients). PowerSGD's rank is the one whose payload is closest to ScaleCom's at the job's
``ratio`` (it compresses from its third step: give ``--warmup 2`` or more); its jobs keep the model
in one bucket (torch's PowerSGD hook fails on Gloo when the reductions of two buckets overlap:
docs/ddp.md).
"""

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time

from benchmarks import cluster_links
from benchmarks._report import COUNT, NON_NEGATIVE, SECONDS, output_file, output_path, replace_section, shown_arguments
from benchmarks.cluster_links import MTU, PREFIX, SHAPES, JobFailed, Skip, check_namespaces
from benchmarks.models import MODELS, SIZES, build_model, describe, mlp_widths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "_slow_link_worker.py")
WORKERS = {"torch": WORKER, "tensorflow": os.path.join(ROOT, "benchmarks", "_slow_link_tf_worker.py")}
DDP_WORKER = os.path.join(ROOT, "benchmarks", "_slow_link_ddp_worker.py")  # (the jobs named ddp_*)
TF_SCHEMES = ("dense", "fp16", "scalecom")  # what the TensorFlow worker runs
DEFAULT_JOBS = ["dense", "fp16", 'scalecom:{"ratio": 0.01}', 'scalecom:{"ratio": 0.001}',
                'scalecom:{"ratio": 0.01, "pipelined": true}',
                # the seed systems: Sketched SGD at about ScaleCom 0.01's payload (FetchSGD's sketch
                # proportions leave k / 35, as in docs/convergence.md), Qsparse synchronising every
                # 5 steps (2 synchronisations in the 10 timed steps)
                'sketched:{"ratio": 0.0003}', 'qsparse:{"local_steps": 5}',
                # DistributedDataParallel with its own reduction, torch's fp16 and PowerSGD hooks
                # (PowerSGD's rank: the one whose payload is closest to ScaleCom 0.01's) and ScaleCom's
                "ddp_dense", "ddp_fp16", 'ddp_powersgd:{"ratio": 0.01}', 'ddp_scalecom:{"ratio": 0.01}']
SCALECOM_DEFAULTS = {"selection": "threshold"}  # the exact top-k set, found faster
LINKS = ("per-worker", "shared-loopback")
UNSHAPED = "unshaped"  # a rate: links (or the shared loopback) at the speed the machine gives them
RATES = (*SHAPES, UNSHAPED)


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def shaped_namespace(rate):
    """A fresh network namespace whose loopback is shaped to ``rate`` (left as it is for ``UNSHAPED``);
    removed on exit."""
    name = f"{PREFIX}{os.getpid()}_{rate}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        raise RuntimeError(f"ip netns add {name} failed: {made.stderr.strip()}")
    try:
        # (namespaces work here: a failure now is an error, not a skip)
        if rate == UNSHAPED:  # (the loopback as a machine has it, its MTU too)
            cluster_links.ip("-n", name, "link", "set", "lo", "up")
        else:
            cluster_links.ip("-n", name, "link", "set", "lo", "mtu", str(MTU), "up")
            cluster_links.shape(name, "lo", rate)
        yield name
    finally:
        cluster_links.remove_namespace(name)


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


def calibrate(network, nbytes):
    """Gbit/s one TCP stream gets: through the shared loopback (``network`` a namespace's name), or
    from worker 0 to worker 1 (``network`` a :class:`cluster_links.Cluster`)."""
    if isinstance(network, cluster_links.Cluster):
        return cluster_links.streams(network, [(0, 1)], max(1, nbytes >> 20))[0]
    out = subprocess.run(["ip", "netns", "exec", network, sys.executable, "-c", CALIBRATE % nbytes],
                         capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _env(extra=None):
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1",
                "TF_NUM_INTEROP_THREADS": "1", "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
                "HOROVOD_CYCLE_TIME": "1",
                # the worker imports benchmarks.models, wherever the benchmark was started from
                "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)})
    env.update(extra or {})
    return env


def _results(output):
    rows = []
    for line in output.splitlines():
        at = line.find("RESULT ")
        if at >= 0:
            rows.append(json.loads(line[at + len("RESULT "):]))
    return rows


def _what(spec, workers):
    return f"{spec['compressor']} with {workers} workers"


def run_job(network, workers, spec, timeout):
    """Rank 0's result of one job: on per-worker links (``network`` a :class:`cluster_links.Cluster`;
    Horovod from its rendezvous server on the bridge, DDP with torch.distributed's ``env://``
    variables) or in a namespace with a shaped loopback (``network`` its name; under ``horovodrun``,
    DDP under ``torchrun``)."""
    ddp = spec["compressor"].startswith("ddp_")
    argv = [DDP_WORKER if ddp else WORKERS[spec.get("framework", "torch")], json.dumps(spec)]
    if isinstance(network, cluster_links.Cluster):
        start = cluster_links.torch_job if ddp else cluster_links.horovod_job
        outputs = start(network, workers, argv, _env(), timeout, _what(spec, workers))
        rows = _results(outputs[0])
        if not rows:
            raise JobFailed(f"{_what(spec, workers)}: rank 0 printed no result:\n{outputs[0][-6000:]}")
        return rows[0]
    from devtools.launch import horovodrun_command, sooner_launcher

    if ddp:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(workers),
                    *argv]
    else:
        launcher = sooner_launcher(horovodrun_command(argv, np=workers, controller="gloo"))
    cmd = ["ip", "netns", "exec", network, *launcher]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout,
                              preexec_fn=cluster_links._die_with_parent)
    except subprocess.TimeoutExpired as e:  # (run() has killed the launcher; what is left of its
        # workers goes with the namespace)
        output = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                         for x in (e.stdout, e.stderr))
        raise JobFailed(f"{_what(spec, workers)} ran past --timeout {timeout:g} s and was "
                        f"stopped ({' '.join(cmd)}); its output ended:\n{output[-6000:]}") from None
    rows = _results(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not rows:
        raise JobFailed(f"{_what(spec, workers)}: {' '.join(cmd)} exited with "
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
    from benchmarks._slow_link_ddp_worker import HOOKS
    from benchmarks._slow_link_worker import COMPRESSORS, OPTIMIZER_WRAPPERS
    name, colon, raw = text.partition(":")
    known = sorted({*COMPRESSORS, *OPTIMIZER_WRAPPERS, *HOOKS})
    if name not in known:
        raise argparse.ArgumentTypeError(f"unknown scheme {name!r} in {text!r}: NAME or NAME:JSON, NAME one of "
                                         f"{', '.join(known)}")
    if colon:
        json_object(raw)
    return text


def section_name(text):
    """An argparse ``type``: a section's name, letters, digits and ``_`` only (it names a file too)."""
    if not text or not all(c.isalnum() or c == "_" for c in text):
        raise argparse.ArgumentTypeError(f"must be letters, digits and _ only, got {text!r}")
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


def check_job(name, kwargs, model="mlp", size="full", widths=None, framework="torch"):
    """Build the job's scheme on the job's model in this process (no Horovod needed), so that options
    it refuses (an unknown keyword, a ratio of 2) stop the benchmark before any namespace or job, not
    inside the namespace after the jobs before it ran.
    Raises TypeError or ValueError."""
    import torch

    from benchmarks import _slow_link_ddp_worker as ddp_worker
    from benchmarks._slow_link_worker import COMPRESSORS, NO_OPTIONS, OPTIMIZER_WRAPPERS
    if framework == "tensorflow" and name not in TF_SCHEMES:
        raise ValueError(f"the TensorFlow worker runs {', '.join(TF_SCHEMES)} only")
    if name in NO_OPTIONS or name in ddp_worker.NO_OPTIONS:
        if kwargs:
            raise TypeError(f"{name} takes no options, got {json.dumps(kwargs)}")
        return
    if framework == "tensorflow":
        from benchmarks.models import build_keras_model
        from hvd_scalecom.tensorflow import ScaleCom
        ScaleCom(build_keras_model(model, size, widths).trainable_variables, **kwargs)
        return
    net = build_model(model, size, widths)
    if name in ddp_worker.HOOKS:
        ddp_worker.HOOKS[name](net, kwargs)
    elif name in OPTIMIZER_WRAPPERS:
        OPTIMIZER_WRAPPERS[name](net, torch.optim.SGD(net.parameters(), lr=0.01), kwargs)
    else:
        COMPRESSORS[name](None, net, kwargs)


def parse_job(text, scalecom_kwargs):
    name, _, raw = text.partition(":")
    kwargs = json.loads(raw) if raw else {}
    if name == "scalecom":
        kwargs = {**SCALECOM_DEFAULTS, **kwargs, **scalecom_kwargs}
    if name == "ddp_scalecom":  # (--scalecom-kwargs are the Horovod compressor's: pipelined is not here)
        kwargs = {**SCALECOM_DEFAULTS, **kwargs}
    return name, kwargs


def label(name, kwargs, result=None):
    if name.startswith("ddp_"):
        if name == "ddp_scalecom":
            return "DDP " + label("scalecom", kwargs)
        if name == "ddp_powersgd":
            rank = (result or {}).get("powersgd_rank")
            return f"DDP PowerSGD rank {rank}" if rank else "DDP PowerSGD"
        return {"ddp_dense": "DDP dense", "ddp_fp16": "DDP fp16 hook"}[name]
    if name == "scalecom":
        extra = {k: v for k, v in kwargs.items() if k not in ("ratio",) and SCALECOM_DEFAULTS.get(k) != v}
        text = f"ScaleCom {kwargs.get('ratio', 0.01):g}"
        return text + (f" {json.dumps(extra, sort_keys=True)}" if extra else "")
    if name == "fp16":
        return "Horovod fp16"
    name = {"sketched": "Sketched SGD", "qsparse": "Qsparse-local-SGD (mean step)"}.get(name, name)
    return name + (f" {json.dumps(kwargs, sort_keys=True)}" if kwargs else "")


@contextlib.contextmanager
def network(link, rate, workers):
    """Per-worker links for up to ``workers`` workers (at least 2, for the calibration's stream), or
    one namespace with a shaped loopback; removed on exit."""
    if link == "per-worker":
        with cluster_links.cluster(None if rate == UNSHAPED else rate, max(2, workers), tag=rate) as c:
            yield c
    else:
        with shaped_namespace(rate) as ns:
            yield ns


def run(args):
    base = {"framework": args.framework, "size": args.model_size, "batch": args.batch, "warmup": args.warmup,
            "steps": args.steps, "timeout": args.timeout, "link": args.link,
            "nic": cluster_links.NIC if args.link == "per-worker" else "lo"}
    jobs = [parse_job(j, args.scalecom_kwargs) for j in args.jobs]
    rows, links = [], {}
    check_namespaces()
    for rate in args.rates:
        with network(args.link, rate, max(args.workers)) as net:
            links[rate] = calibrate(net, args.calibrate_bytes)
            print(f"{rate}: one TCP stream gets {links[rate]:.2f} Gbit/s", flush=True)
            for model in args.models:
                spec = dict(base, model=model, widths=args.widths if model == "mlp" else None)
                for workers in args.workers:
                    runs = {i: [] for i in range(len(jobs))}
                    for repeat in range(args.repeats):  # forward, then backward: drifts in load cancel
                        order = range(len(jobs)) if repeat % 2 == 0 else reversed(range(len(jobs)))
                        for i in order:
                            name, kwargs = jobs[i]
                            r = run_job(net, workers, dict(spec, compressor=name, kwargs=kwargs), args.timeout)
                            r.update(rate=rate, label=label(name, kwargs, r))
                            runs[i].append(r)
                            print(f"{rate:>7} {model:11s} {workers} workers {r['label']:28s} "
                                  f"{1e3 * r['median_step_seconds']:9.1f} ms/step  "
                                  f"{per_worker_bytes(r) / 1e6:9.3f} MB/step/worker  floor "
                                  f"{1e3 * r['floor_seconds']:7.1f} ms" + (
                                      f"  each worker tx/rx MB/step: {each_worker(r)}" if r.get("wire") else ""),
                                  flush=True)
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
    if all(r.get("wire") for r in repeats):
        row["wire"] = [{k: statistics.median(r["wire"][w][k] for r in repeats) for k in ("tx_bytes", "rx_bytes")}
                       for w in range(len(repeats[0]["wire"]))]
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
    """Bytes sent per step per worker: all workers' bytes over the timed steps / steps / workers."""
    if r.get("tx_bytes") is None:
        return float("nan")
    return r["tx_bytes"] / r["steps"] / r["workers"]


def each_worker(r):
    """Each worker's MB sent / received per timed step on its own link: ``"0.27/0.27, 0.27/0.27"``."""
    return ", ".join(f"{w['tx_bytes'] / r['steps'] / 1e6:.3f}/{w['rx_bytes'] / r['steps'] / 1e6:.3f}"
                     for w in r["wire"])


def _link_text(args, links):
    shapes = ", ".join(f"{SHAPES[k][0]} at {k}" for k in links if k in SHAPES) or "none: unshaped"
    measured = ", ".join(f"{v:.2f} Gbit/s at {k}" for k, v in links.items())
    if args.link == "per-worker":
        return (f"Each worker runs in its own network namespace with its own link (a veth pair, MTU {MTU}) "
                "into a Linux bridge, both directions of every link shaped by `tc tbf` to the rate "
                f"(bucket {shapes}), so a worker's link carries its own traffic only, as on a cluster; a "
                f"single TCP stream of {args.calibrate_bytes >> 20} MiB from one worker to another measured "
                f"{measured}. The jobs are started without `horovodrun`, from Horovod's Gloo rendezvous "
                "server on the bridge, one host per worker. Bytes: each worker's link counters over the "
                "timed steps, per step (TCP/IP headers and Horovod's own coordination messages included); "
                "the wire column is their mean over the workers")
    if set(links) == {UNSHAPED}:
        return (f"All workers share one loopback, not shaped (as on one machine with no network cost); a single "
                f"TCP stream of {args.calibrate_bytes >> 20} MiB measured {measured}. Bytes: the namespace's `lo` "
                "`tx_bytes` over the timed steps, per step and worker (TCP/IP headers and Horovod's own "
                "coordination messages included)")
    return (f"All workers share one loopback shaped by `tc tbf` (MTU {MTU}; bucket {shapes}), so the rate "
            f"is divided among them; a single TCP stream of {args.calibrate_bytes >> 20} MiB measured "
            f"{measured}. Bytes: the namespace's `lo` `tx_bytes` over the timed steps, per step and worker "
            "(TCP/IP headers and Horovod's own coordination messages included)")


def _ddp_text(args):
    started = ("one process per worker in its namespace, torch.distributed's `env://` variables with the "
               "store on the bridge, Gloo on the worker's link" if args.link == "per-worker" else "under torchrun")
    return ("Rows named DDP: `DistributedDataParallel` jobs (Gloo, the same model, batch, steps and "
            f"counters; {started}) with the named communication hook (`hvd_scalecom.ddp` for ScaleCom; "
            "PowerSGD's jobs keep the model in one bucket, its hook failing on Gloo when buckets overlap), "
            "compared with DDP dense; their payload is counted in the torch.distributed calls of the "
            "hooks (DDP dense: the fp32 gradients). ")


def markdown(rows, links, args, command, plot, load):
    shaped = "" if set(links) == {UNSHAPED} else "shaped "
    title = (f"one {shaped}link per worker" if args.link == "per-worker"
             else f"one {shaped}loopback shared by all workers")
    lines = [
        f"## Slow link{'' if args.framework == 'torch' else ', TensorFlow'}: step time of Horovod jobs, {title}",
        "",
        f"Made by `{command}` (as root). "
        + ("PyTorch workers (`hvd.DistributedOptimizer`). " if args.framework == "torch" else
           "TensorFlow workers: Keras 3 models trained through `hvd_scalecom.tensorflow.make_train_step` "
           "(Horovod's `DistributedGradientTape`). ")
        + f"Batch {args.batch} of synthetic data per worker, "
        f"one thread per worker, Gloo, `HOROVOD_CYCLE_TIME=1`; {args.warmup} warm-up and {args.steps} "
        f"timed steps per job, rank 0's median step, median over {args.repeats} runs of each job (in "
        f"alternating order). {_link_text(args, links)}; payload: what each worker hands "
        "to Horovod's collectives. Floor: the same step with no communication, timed in the same job "
        "right after the timed steps by all N workers at once (a copy of the model, a plain "
        f"optimizer), so it shares the cores as the job does (up to {max(args.workers)} workers on "
        f"this {os.cpu_count()}-core machine). ScaleCom runs with "
        f"`{json.dumps(SCALECOM_DEFAULTS)}` (the exact top-k set) plus any options shown. Index wait: "
        "rank 0's waits for the leader's indices (ScaleCom) or for its two rounds' allreduces (Sketched "
        "SGD), which its compress time leaves out (PyTorch workers only: TensorFlow's `stats()` time each tensor's "
        "span in the step's graph, where the tensors' work interleaves). " + (_ddp_text(args) if any(
            r["compressor"].startswith("ddp_") for r in rows) else "") + "Load "
        f"average of the machine (the jobs' own workers included): {load[0]:.1f} at the start, "
        f"{load[1]:.1f} at the end.",
    ]
    per_worker = args.link == "per-worker"
    for model in dict.fromkeys(r.get("model", "mlp") for r in rows):
        these = [r for r in rows if r.get("model", "mlp") == model]
        params = these[0]["parameters"]
        lines += ["", f"### {describe(model, args.model_size, args.widths if model == 'mlp' else None)}: "
                      f"{params:,} parameters, {4 * params / 1e6:.1f} MB of fp32 gradients", "",
                  "| link | workers | scheme | ms/step | vs dense | speed-up over dense | floor ms | vs floor | "
                  "MB/step/worker (wire) | wire bytes vs dense | payload MB/step/worker | index wait ms/step | "
                  "compress ms/step |" + (" each worker sent/received MB/step |" if per_worker else ""),
                  "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---|" if per_worker else "")]
        for r in these:
            baseline = "ddp_dense" if r["compressor"].startswith("ddp_") else "dense"  # (DDP against DDP)
            dense = next((d for d in these if d["rate"] == r["rate"] and d["workers"] == r["workers"]
                          and d["compressor"] == baseline), None)
            step = r["median_step_seconds"]
            vs = f"{step / dense['median_step_seconds']:.3f}" if dense else "n/a"
            speed = f"{dense['median_step_seconds'] / step:.2f}x" if dense else "n/a"
            wire = per_worker_bytes(r)
            wire_vs = f"{wire / per_worker_bytes(dense):.4f}" if dense else "n/a"
            # (TensorFlow's stats() time each tensor's span in the step's graph, where the tensors'
            # work interleaves: their sum is no share of the step, and is left out)
            cs = r.get("compressor_stats", {}) if r.get("framework", "torch") == "torch" else {}
            wait = f"{1e3 * cs['index_wait_seconds']:.1f}" if "index_wait_seconds" in cs else ""
            comp = f"{1e3 * cs['compress_seconds']:.1f}" if "compress_seconds" in cs else ""
            lines.append(f"| {r['rate']} | {r['workers']} | {r['label']} | {1e3 * step:.1f} | {vs} | {speed} | "
                         f"{1e3 * r['floor_seconds']:.1f} | {step / r['floor_seconds']:.2f}x | "
                         f"{wire / 1e6:.3f} | {wire_vs} | {payload(r) / 1e6:.3f} | {wait} | {comp} |"
                         + (f" {each_worker(r) if r.get('wire') else ''} |" if per_worker else ""))
        if len(args.workers) > 1:
            lines += scaling_table(these, args.workers)
    if plot:
        lines += ["", f"![step times]({os.path.basename(plot)})"]
    return "\n".join(lines) + "\n"


def scaling_table(rows, workers):
    lines = ["", f"Bytes per worker per step from {min(workers)} to {max(workers)} workers: ring allreduce "
             "sends `2 (n - 1) / n` times the payload per worker (1.0 at 2 workers, 1.5 at 4), a broadcast "
             "about `(n - 1) / n`; an allgather (local top-k) would send `n - 1` times (1 at 2 workers, 3 at 4).",
             "",
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


def plot_rows(rows, path, link="per-worker"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.get("model", "mlp") for r in rows))
    groups = list(dict.fromkeys((r["rate"], r["workers"]) for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=((2.2 + 1.6 * len(groups)) * len(models), 4), squeeze=False)
    width = 0.8 / (len(labels) + 1)
    for ax, model in zip(axes[0], models):
        these = [r for r in rows if r.get("model", "mlp") == model]
        for i, lab in enumerate(labels):
            ys = [next((1e3 * r["median_step_seconds"] for r in these if (r["rate"], r["workers"]) == g
                        and r["label"] == lab), 0) for g in groups]
            ax.bar([j + i * width for j in range(len(groups))], ys, width, label=lab)
        floor = [statistics.median([1e3 * r["floor_seconds"] for r in these if (r["rate"], r["workers"]) == g] or [0])
                 for g in groups]
        ax.bar([j + len(labels) * width for j in range(len(groups))], floor, width,
               label="no communication (floor)", color="black")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
        ax.set_xticklabels([f"{rate}\n{w} workers" for rate, w in groups])
        ax.set_ylabel("median step (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{model}: " + ("one link per worker" if link == "per-worker" else "shared loopback"))
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # (the running job is stopped and the namespaces removed on the way out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--smoke", action="store_true",
                    help="tiny MLP, 1gbit, 2 workers, one step, dense and ScaleCom 0.01")
    ap.add_argument("--link", choices=LINKS, default="per-worker",
                    help="per-worker: each worker its own shaped link (default); shared-loopback: one shaped "
                         "loopback for all workers")
    ap.add_argument("--rates", nargs="+", default=None, choices=list(RATES),
                    help=f"per link; {UNSHAPED}: not shaped (what the step costs where the network is free)")
    ap.add_argument("--workers", type=COUNT, nargs="+", default=None)
    ap.add_argument("--models", nargs="+", choices=MODELS, default=None,
                    help="default: all (mlp in --smoke)")
    ap.add_argument("--model-size", choices=SIZES, default=None, help="default: full (tiny in --smoke)")
    ap.add_argument("--framework", choices=list(WORKERS), default="torch",
                    help="the frontend the workers train with (tensorflow: Keras 3 models, dense, fp16 and "
                         "scalecom jobs)")
    ap.add_argument("--jobs", type=job, nargs="+", default=None, help="NAME or NAME:JSON (see module doc)")
    ap.add_argument("--scalecom-kwargs", type=json_object, default={},
                    help="JSON merged into every ScaleCom job's constructor arguments")
    ap.add_argument("--widths", type=widths, default=None, help="the MLP's layer widths")
    ap.add_argument("--batch", type=COUNT, default=8, help="per worker")
    ap.add_argument("--warmup", type=NON_NEGATIVE, default=None)
    ap.add_argument("--steps", type=COUNT, default=None)
    ap.add_argument("--repeats", type=COUNT, default=None, help="runs of each job (default 2; 1 in --smoke)")
    ap.add_argument("--timeout", type=SECONDS, default=900)
    ap.add_argument("--out", type=output_file, default=None,
                    help="default: docs/performance.md (a temporary file in --smoke)")
    ap.add_argument("--section", type=section_name, default=None,
                    help="the section of --out written (between its <!-- NAME:begin/end --> markers), and the "
                         "plot's default name (default: slow_link, slow_link_tensorflow), so that runs of other "
                         "rates or models keep their own tables")
    ap.add_argument("--plot", type=output_file, default=None,
                    help="PNG path (default: docs/slow_link.png, docs/slow_link_tensorflow.png; none in --smoke)")
    args = ap.parse_args(argv)
    args.out = output_path(args.out, args.smoke, "performance.md")
    smoke = args.smoke
    args.rates = args.rates or (["1gbit"] if smoke else ["1gbit", "10gbit"])
    args.workers = args.workers or ([2] if smoke else [2, 4])
    args.models = list(dict.fromkeys(args.models or (["mlp"] if smoke else MODELS)))
    args.model_size = args.model_size or ("tiny" if smoke else "full")
    args.jobs = args.jobs or (["dense", 'scalecom:{"ratio": 0.01}'] if smoke else DEFAULT_JOBS)
    args.widths = mlp_widths(args.model_size, args.widths)
    args.warmup = args.warmup if args.warmup is not None else (1 if smoke else 3)
    args.steps = args.steps if args.steps is not None else (1 if smoke else 10)
    # much more than a bucket holds; the smoke test's a quarter second at 1 Gbit/s, so that one
    # scheduling stall of a loaded machine cannot halve the rate it checks
    args.calibrate_bytes = (32 if smoke else 64) << 20
    args.repeats = args.repeats or (1 if smoke else 2)
    for text in args.jobs:  # (each scheme built here once per model: a bad option is named before anything runs)
        name, kwargs = parse_job(text, args.scalecom_kwargs)
        for model in args.models:
            try:
                check_job(name, kwargs, model, args.model_size, args.widths if model == "mlp" else None,
                          args.framework)
            except (TypeError, ValueError) as e:
                merged = f" with --scalecom-kwargs {json.dumps(args.scalecom_kwargs)}" \
                    if name == "scalecom" and args.scalecom_kwargs else ""
                ap.error(f"argument --jobs: {text!r}{merged}: {e} (built for the {model} model)")
    started = time.perf_counter()
    load = [os.getloadavg()[0]]
    for signum in (signal.SIGTERM, signal.SIGHUP):  # so that the namespaces are removed on kill too
        signal.signal(signum, _terminate)
    try:
        rows, links = run(args)
    except Skip as why:
        print(f"slow_link: skipped: {why}", flush=True)
        return 0
    except JobFailed as why:
        print(f"slow_link: failed: {why}", file=sys.stderr, flush=True)
        return 1
    section = args.section or ("slow_link" if args.framework == "torch" else f"slow_link_{args.framework}")
    plot = None if smoke and args.plot is None else (args.plot or os.path.join(ROOT, "docs", f"{section}.png"))
    command = " ".join(["python -m benchmarks.slow_link", *map(shlex.quote, shown_arguments(
        sys.argv[1:] if argv is None else argv))])
    replace_section(args.out, section, markdown(rows, links, args, command, plot,
                                                    load + [os.getloadavg()[0]]))  # (the table first)
    if plot:
        plot_rows(rows, plot, args.link)
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
