"""A small cluster on one machine: one network namespace per worker, each with its own link (a veth
pair) into a Linux bridge in a namespace of its own, both directions of every link shaped by a token
bucket, so that a worker's "NIC" carries only its own traffic, as on a cluster; and Horovod (Gloo)
jobs on it, started without ``horovodrun`` from a rendezvous server on the bridge (and
torch.distributed jobs, started without ``torchrun``).

    sudo .venv/bin/python -m benchmarks.cluster_links --rate 1gbit    # check the shaping (4 workers)

Layout (``T`` is this process's id and a tag, so that runs side by side do not meet)::

    namespace hvdsc_slow_T_br   bridge br0 10.77.0.254/24, ports p0 .. p{N-1}; the rendezvous server
    namespace hvdsc_slow_T_w0   eth0 10.77.0.1/24  <- veth ->  p0 (in the bridge's namespace)
    namespace hvdsc_slow_T_w1   eth0 10.77.0.2/24  <- veth ->  p1
    ...

The addresses exist only inside these namespaces: nothing is added to the machine's own namespace
and no traffic leaves the namespaces made here. Each worker's namespace also gets an
``/etc/netns/NS/hosts`` in which the machine's hostname resolves to the worker's address (see
:func:`_hosts_file`: Horovod 0.28.1's process sets bind to it). Each link is shaped twice with ``tc tbf``: on the
egress of the worker's ``eth0`` (what it sends) and on the egress of its bridge port ``p{i}`` (what
it receives), so each worker has RATE up and RATE down whatever the others do. Wire bytes are each
worker's ``eth0`` counters (``/sys/class/net/eth0/statistics/{tx,rx}_bytes`` inside its namespace).

Rendezvous: :func:`horovod_job` starts Horovod's own ``RendezvousServer`` (as ``horovodrun --gloo``
does) in the bridge's namespace, listening on 10.77.0.254, with one host per worker
(``worker0:1,worker1:1,...``), and gives rank ``i`` the variables ``horovodrun`` would:
``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``, ``HOROVOD_CONTROLLER=gloo``, ``HOROVOD_CPU_OPERATIONS=gloo``,
``HOROVOD_GLOO_IFACE=eth0``, ``HOROVOD_HOSTNAME=worker<i>``, ``HOROVOD_RANK=i``, ``HOROVOD_SIZE``,
local rank 0 of 1, cross rank ``i`` of N.

torch.distributed jobs (:func:`torch_job`) get the ``env://`` variables instead, their store (the
rendezvous ``torchrun``'s agent would host) served on the bridge, ``GLOO_SOCKET_IFNAME=eth0``, one
process per worker.

Everything made here is removed on exit, on errors and on SIGTERM/SIGINT/SIGHUP (with the processes
started in the namespaces); namespaces of a run that was killed outright (``SIGKILL``), whose
process no longer exists, are removed with their processes by the next run (:func:`remove_leftovers`).

The check (``--rate``) sends a stream of ``--megabytes`` between worker namespaces with plain TCP
sockets: one direction alone, both directions of one pair at once, and two pairs at once (each
should get about RATE: they share no link), and prints each stream's Gbit/s at its receiver.
"""

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "hvdsc_slow_"  # (shared with the shared-loopback mode of benchmarks.slow_link)
SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"
NIC = "eth0"  # each worker's interface, inside its namespace
MTU = 9000  # so that a small bucket still holds whole packets
# Token bucket per rate: the smallest of 64 KB, 128 KB, ... with which one TCP stream of 64 and 256 MiB
# met the rate on a shaped loopback (0.99 Gbit/s at 1gbit; 9.5-9.6 Gbit/s at 10gbit, where 128-512 KB
# gave 8.2-9.4). A larger bucket lets each exchange's first megabytes leave at memory speed after the
# pause of a compute phase, which favours the small exchanges of compressed schemes.
SHAPES = {"1gbit": ("128kb", "50ms"), "10gbit": ("1mb", "50ms"), "100mbit": ("64kb", "200ms")}
MAX_WORKERS = 250  # 10.77.0.1 .. 10.77.0.250
ETC_NETNS = "/etc/netns"  # per-namespace files that ip netns exec mounts over /etc


class Skip(Exception):
    """Network namespaces cannot be made here."""


class JobFailed(Exception):
    """A job in the namespaces failed or ran past its timeout; the message holds each rank's output's end."""


def ip(*args, check=True):
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def tc(*args):
    done = subprocess.run(["tc", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {done.stderr.strip()}")


def _kill_processes_in(namespace):
    """SIGKILL the processes inside ``namespace`` (``ip netns pids``): only what a run of this module
    started there, since the namespace is its own."""
    for pid in ip("netns", "pids", namespace, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_namespace(namespace):
    _kill_processes_in(namespace)
    ip("netns", "del", namespace, check=False)
    if namespace.startswith(PREFIX):
        shutil.rmtree(os.path.join(ETC_NETNS, namespace), ignore_errors=True)


def _hosts_file(namespace, address):
    """``/etc/netns/NS/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts`` for the processes
    it starts in NS): this machine's hostname resolves to ``address`` inside NS. Horovod 0.28.1 binds
    the Gloo contexts of its process sets, which carry every collective, to the address of the
    hostname rather than to ``HOROVOD_GLOO_IFACE`` (their device is made from an empty interface
    name), and outside a namespace of its own the hostname resolves to a loopback address."""
    directory = os.path.join(ETC_NETNS, namespace)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "hosts"), "w") as f:
        f.write(f"127.0.0.1 localhost\n::1 localhost\n{address} {socket.gethostname()}\n")


def remove_leftovers():
    """Remove the namespaces (with the processes in them and their ``/etc/netns`` files) of runs
    that were killed outright: those named ``PREFIX<pid>_...`` whose process no longer exists."""
    names = [(line.split() or [""])[0] for line in ip("netns", "list", check=False).stdout.splitlines()]
    if os.path.isdir(ETC_NETNS):
        names += os.listdir(ETC_NETNS)
    for name in dict.fromkeys(names):
        pid = name[len(PREFIX):].split("_")[0]
        if name.startswith(PREFIX) and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            remove_namespace(name)


def check_namespaces():
    """Raise :class:`Skip` unless this process can make network namespaces (before any job: a skip
    later would discard finished measurements); removes what runs killed outright left behind."""
    if os.geteuid() != 0:
        raise Skip("network namespaces need root (ip netns add); run as root to measure")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise Skip("the ip and tc commands (iproute2) are not installed")
    remove_leftovers()
    probe = f"{PREFIX}{os.getpid()}_probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise Skip(f"ip netns add failed: {made.stderr.strip()}")
    ip("netns", "del", probe, check=False)


def shape(namespace, device, rate):
    burst, latency = SHAPES[rate]
    tc("-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", burst,
       "latency", latency)


class Cluster:
    """Namespaces made by :func:`cluster`: ``bridge`` (the bridge's namespace), ``workers`` (one per
    worker, rank order), ``addresses`` (each worker's address on the bridge) and ``rate``."""

    def __init__(self, bridge, workers, rate):
        self.bridge, self.workers, self.rate = bridge, workers, rate
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(len(workers))]

    def counters(self):
        """``[(tx_bytes, rx_bytes)]`` of each worker's ``eth0``, read from outside."""
        out = []
        for ns in self.workers:
            stats = json.loads(ip("-n", ns, "-j", "-s", "link", "show", "dev", NIC).stdout)[0]["stats64"]
            out.append((stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return out


@contextlib.contextmanager
def cluster(rate, workers, tag="c"):
    """``workers`` namespaces with a link of ``rate`` each (a key of :data:`SHAPES`, or ``None`` for
    links at veth speed) into a bridge; all removed on exit."""
    if rate is not None and rate not in SHAPES:
        raise ValueError(f"rate must be one of {', '.join(SHAPES)} or None, got {rate!r}")
    if not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be 1 .. {MAX_WORKERS}, got {workers!r}")
    base = f"{PREFIX}{os.getpid()}_{tag}"
    bridge, names = f"{base}_br", [f"{base}_w{i}" for i in range(workers)]
    made = []
    try:
        for ns in (bridge, *names):
            ip("netns", "add", ns)
            made.append(ns)
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", bridge, "link", "add", "br0", "mtu", str(MTU), "type", "bridge")
        for i, ns in enumerate(names):
            port = f"p{i}"
            ip("-n", bridge, "link", "add", port, "mtu", str(MTU), "type", "veth", "peer", "name", NIC,
               "netns", ns, "mtu", str(MTU))
            ip("-n", bridge, "link", "set", port, "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", NIC)
            _hosts_file(ns, f"{SUBNET}.{i + 1}")
            ip("-n", ns, "link", "set", NIC, "up")
            if rate is not None:
                shape(ns, NIC, rate)  # what the worker sends
                shape(bridge, port, rate)  # what it receives
        ip("-n", bridge, "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", "br0")
        ip("-n", bridge, "link", "set", "br0", "up")
        yield Cluster(bridge, names, rate)
    finally:
        for ns in reversed(made):
            remove_namespace(ns)


def _die_with_parent():
    """In the child before exec: SIGTERM when this process dies, however it dies (``ip netns exec``
    execs its command, which keeps the setting)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def in_namespace(namespace, argv):
    return ["ip", "netns", "exec", namespace, *argv]


# ---------------------------------------------------------------------------------------------------
# Horovod jobs without horovodrun: its rendezvous server on the bridge, one worker per namespace


def serve_rendezvous(hostnames):
    """Run in the bridge's namespace: Horovod's Gloo rendezvous server (what ``horovodrun --gloo``
    starts) for one worker on each of ``hostnames``; prints ``{"port", "slots"}`` as one JSON line
    (each slot's ``HOROVOD_*`` variables), then serves until its standard input closes."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer

    plan = get_host_assignments(parse_hosts(",".join(f"{h}:1" for h in hostnames)), len(hostnames))
    server = RendezvousServer()
    port = server.start()
    server.init(plan)
    slots = [{"HOROVOD_HOSTNAME": s.hostname, "HOROVOD_RANK": str(s.rank), "HOROVOD_SIZE": str(s.size),
              "HOROVOD_LOCAL_RANK": str(s.local_rank), "HOROVOD_LOCAL_SIZE": str(s.local_size),
              "HOROVOD_CROSS_RANK": str(s.cross_rank), "HOROVOD_CROSS_SIZE": str(s.cross_size)}
             for s in plan]
    print(json.dumps({"port": port, "slots": slots}), flush=True)
    sys.stdin.read()  # until the benchmark closes it (or dies)
    server.stop()


def _read_line(proc, timeout):
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else ""


def _stop(procs, grace=5.0):
    """SIGTERM the running ones, SIGKILL what is left after ``grace`` seconds."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _check_workers(cluster_, workers):
    if not 1 <= workers <= len(cluster_.workers):
        raise ValueError(f"workers must be 1 .. {len(cluster_.workers)}, got {workers!r}")


def run_ranks(cluster_, argv, envs, timeout, what):
    """Run ``argv`` (a Python script and its arguments) once per item of ``envs`` (each rank's
    environment), rank ``i`` in ``cluster_.workers[i]``; returns ``[output of rank 0, ...]`` (stdout
    and stderr). A rank that fails stops the others; past ``timeout`` seconds all are stopped; both
    raise :class:`JobFailed` naming ``what``."""
    procs, logs = [], []
    try:
        for rank, env in enumerate(envs):
            log = tempfile.TemporaryFile(mode="w+")
            logs.append(log)
            procs.append(subprocess.Popen(
                in_namespace(cluster_.workers[rank], [sys.executable, *argv]), stdout=log,
                stderr=subprocess.STDOUT, cwd=ROOT, env=env, preexec_fn=_die_with_parent))
        deadline = time.monotonic() + timeout
        failed, timed_out = None, False
        while any(p.poll() is None for p in procs):
            failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            timed_out = time.monotonic() > deadline
            if failed is not None or timed_out:
                break
            time.sleep(0.1)
        _stop(procs)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        codes = [p.returncode for p in procs]
        if failed is None and not timed_out and any(codes):
            failed = next(r for r, c in enumerate(codes) if c)
        if failed is not None or timed_out:
            why = (f"ran past --timeout {timeout:g} s and was stopped" if failed is None else
                   f"failed: rank {failed} exited with {codes[failed]}")
            raise JobFailed(f"{what} {why}; each rank's output ended:\n" + "\n".join(
                f"----- rank {r} (exit {codes[r]}) -----\n{out[-3000:]}" for r, out in enumerate(outputs)))
        return outputs
    finally:
        _stop(procs)
        for log in logs:
            log.close()


def horovod_job(cluster_, workers, argv, env, timeout, what):
    """Run ``argv`` (a Python script and its arguments) as a Horovod Gloo job of ``workers`` ranks,
    rank ``i`` in ``cluster_.workers[i]``, with the variables ``horovodrun --gloo`` would set; returns
    and raises as :func:`run_ranks`."""
    _check_workers(cluster_, workers)
    hostnames = [f"worker{i}" for i in range(workers)]
    server = subprocess.Popen(
        in_namespace(cluster_.bridge, [sys.executable, "-c", "import sys; from benchmarks.cluster_links import "
                                       f"serve_rendezvous; serve_rendezvous({hostnames!r})"]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
        preexec_fn=_die_with_parent)
    try:
        line = _read_line(server, 60)
        if not line:
            raise JobFailed(f"{what}: the rendezvous server in {cluster_.bridge} did not start within 60 s")
        rendezvous = json.loads(line)
        common = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": BRIDGE_ADDRESS,
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous["port"]), "HOROVOD_CONTROLLER": "gloo",
                  "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": NIC, "PYTHONUNBUFFERED": "1"}
        return run_ranks(cluster_, argv, [{**env, **common, **rendezvous["slots"][rank]} for rank in range(workers)],
                         timeout, what)
    finally:
        with contextlib.suppress(OSError):
            server.stdin.close()
        _stop([server])


def serve_store():
    """Run in the bridge's namespace: torch.distributed's ``TCPStore`` server (what ``torchrun``'s
    agent hosts for its workers) on a free port of the bridge's address; prints ``{"port"}`` as one
    JSON line, then serves until its standard input closes."""
    from torch.distributed import TCPStore

    store = TCPStore(BRIDGE_ADDRESS, 0, is_master=True, wait_for_workers=False)
    print(json.dumps({"port": store.port}), flush=True)
    sys.stdin.read()  # until the benchmark closes it (or dies)


def torch_job(cluster_, workers, argv, env, timeout, what):
    """Run ``argv`` as a torch.distributed job of ``workers`` ranks, rank ``i`` in
    ``cluster_.workers[i]``, with the ``env://`` variables ``torchrun`` would set for one process
    per node: ``MASTER_ADDR``/``MASTER_PORT`` the store that :func:`serve_store` runs on the bridge
    (``TORCHELASTIC_USE_AGENT_STORE=True``: every rank a client of it, as under torchrun, so that no
    rank's exit takes the store from the others), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` 0 of
    ``LOCAL_WORLD_SIZE`` 1, and ``GLOO_SOCKET_IFNAME=eth0`` (Gloo's connections on the worker's
    link); returns and raises as :func:`run_ranks`."""
    _check_workers(cluster_, workers)
    server = subprocess.Popen(
        in_namespace(cluster_.bridge, [sys.executable, "-c", "from benchmarks.cluster_links import serve_store; "
                                       "serve_store()"]),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env, preexec_fn=_die_with_parent)
    try:
        line = _read_line(server, 120)
        if not line:
            raise JobFailed(f"{what}: the store in {cluster_.bridge} did not start within 120 s")
        common = {"MASTER_ADDR": BRIDGE_ADDRESS, "MASTER_PORT": str(json.loads(line)["port"]),
                  "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(workers), "LOCAL_RANK": "0",
                  "LOCAL_WORLD_SIZE": "1", "GLOO_SOCKET_IFNAME": NIC, "PYTHONUNBUFFERED": "1"}
        return run_ranks(cluster_, argv, [{**env, **common, "RANK": str(rank), "GROUP_RANK": str(rank)}
                                          for rank in range(workers)], timeout, what)
    finally:
        with contextlib.suppress(OSError):
            server.stdin.close()
        _stop([server])


# ---------------------------------------------------------------------------------------------------
# The shaping check: TCP streams between worker namespaces

RECEIVER = r"""
import socket, sys, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2]))); srv.listen(1)
print("ready", flush=True)
c, _ = srv.accept(); got = 0; first = None
while True:
    b = c.recv(1 << 20)
    if not b: break
    if first is None: first = time.perf_counter()
    got += len(b)
print(got, time.perf_counter() - first, flush=True)
"""

SENDER = r"""
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
buf = bytes(1 << 20); n = int(sys.argv[3])
for _ in range(n): s.sendall(buf)
s.close()
"""


def streams(cluster_, pairs, megabytes, port=5201, timeout=300):
    """Gbit/s of TCP streams run at once, one per ``(sender, receiver)`` pair of worker indices,
    each measured at its receiver from its first byte to its last."""
    receivers, senders = [], []
    try:
        for k, (_, dst) in enumerate(pairs):
            p = subprocess.Popen(in_namespace(cluster_.workers[dst], [sys.executable, "-c", RECEIVER,
                                                                      cluster_.addresses[dst], str(port + k)]),
                                 stdout=subprocess.PIPE, text=True, preexec_fn=_die_with_parent)
            receivers.append(p)
            if _read_line(p, 30).strip() != "ready":
                raise RuntimeError(f"the receiver in {cluster_.workers[dst]} did not start")
        for k, (src, dst) in enumerate(pairs):
            senders.append(subprocess.Popen(
                in_namespace(cluster_.workers[src], [sys.executable, "-c", SENDER, cluster_.addresses[dst],
                                                     str(port + k), str(megabytes)]),
                preexec_fn=_die_with_parent))
        rates = []
        for s, r in zip(senders, receivers):
            if s.wait(timeout=timeout) != 0:
                raise RuntimeError("a sender failed")
            got, seconds = r.communicate(timeout=timeout)[0].split()
            rates.append(8 * int(got) / float(seconds) / 1e9)
        return rates
    finally:
        _stop(senders + receivers)


def check(rate, megabytes, workers=4):
    """Print and return the Gbit/s of: one stream 0 -> 1; 0 -> 1 and 1 -> 0 at once; 0 -> 1 and 2 -> 3
    at once; all ``workers`` sending to the next at once (a ring)."""
    results = {}
    with cluster(rate, workers, tag="check") as c:
        before = c.counters()
        cases = {"one stream 0->1": [(0, 1)], "both directions 0->1, 1->0": [(0, 1), (1, 0)],
                 "two pairs 0->1, 2->3": [(0, 1), (2, 3)],
                 f"ring of {workers} (i -> i+1)": [(i, (i + 1) % workers) for i in range(workers)]}
        for name, pairs in cases.items():
            results[name] = streams(c, pairs, megabytes)
            print(f"{rate or 'unshaped'}: {name}: " + ", ".join(f"{g:.3f}" for g in results[name]) + " Gbit/s",
                  flush=True)
        after = c.counters()
        moved = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before)]
        print("eth0 bytes moved per worker (tx, rx): " + ", ".join(f"({t / 1e6:.0f} MB, {r / 1e6:.0f} MB)"
                                                                   for t, r in moved), flush=True)
    return results


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # (the namespaces are removed on the way out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rate", choices=[*SHAPES, "none"], default="1gbit", help="per link ('none': unshaped)")
    ap.add_argument("--megabytes", type=int, default=256, help="per stream")
    ap.add_argument("--workers", type=int, default=4, help="namespaces (>= 4 for the two-pair case)")
    args = ap.parse_args(argv)
    if args.workers < 4:
        ap.error(f"argument --workers: must be >= 4, got {args.workers}")
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _terminate)
    try:
        check_namespaces()
    except Skip as why:
        print(f"cluster_links: skipped: {why}")
        return 0
    check(None if args.rate == "none" else args.rate, args.megabytes, args.workers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
