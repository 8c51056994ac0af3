"""Elastic Horovod with ScaleCom (``hvd_scalecom.torch.elastic``): the state handler's semantics in
one process, and real membership changes under ``horovodrun --min-np/--max-np
--host-discovery-script`` on this machine (Gloo; workers on the hosts ``localhost`` and ``127.0.0.1``).
"""

import glob
import json
import os
import subprocess
import sys

import numpy as np
import torch

from devtools.launch import HorovodRunError, run_command

HERE = os.path.dirname(os.path.abspath(__file__))
K = {"hidden.weight": 154, "out.weight": 32}  # ceil(0.05 * numel) for the worker's model
NUMEL = {"hidden.weight": 3072, "out.weight": 640}
BETA = 0.5


# -- the handler, in this process -------------------------------------------------------------------

def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 2))


def test_importing_registers_the_handler_once():
    from horovod.torch.elastic.state import get_handler_registry

    import hvd_scalecom.torch
    from hvd_scalecom.torch import elastic

    assert hvd_scalecom.torch.elastic is elastic
    elastic.register()
    elastic.register()
    handlers = [h for _, h in get_handler_registry()]
    assert handlers.count(elastic.ScaleComStateHandler) == 1
    assert handlers[0] is elastic.ScaleComStateHandler
    assert torch.optim.Optimizer in [t for t, _ in get_handler_registry()]  # Horovod's own kept


def test_the_handler_is_registered_without_importing_the_elastic_module():
    """A fresh process that only imports ScaleCom: TorchState(compression=...) must still find the
    handler (without it, Horovod pickled the compressor at the first sync and failed at a later one)."""
    code = ("from hvd_scalecom.torch import ScaleCom\n"
            "from horovod.torch.elastic.state import get_handler_registry\n"
            "print([h.__name__ for t, h in get_handler_registry() if t is ScaleCom])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['ScaleComStateHandler']"


def test_torch_state_snapshots_restores_and_resyncs_locally_held_state(monkeypatch):
    import horovod.torch as hvd

    from hvd_scalecom.torch import ScaleCom
    from hvd_scalecom.torch.elastic import ScaleComStateHandler

    net = small_model()
    compression = ScaleCom(net.named_parameters(), ratio=0.1, pipelined=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    state = hvd.elastic.TorchState(net, optimizer, compression=compression, epoch=0)
    assert isinstance(state._handlers["compression"], ScaleComStateHandler)
    assert state.compression is compression and "compression" not in state._saved_state

    def with_state(step, memory_value, next_indices=False):
        sd = compression.state_dict()
        for name, entry in sd["params"].items():
            entry["step"] = step
            numel = dict(net.named_parameters())[name].numel()
            entry["memory"] = torch.full((numel,), float(memory_value)) if numel >= 1024 else None
            entry.pop("next_indices", None)  # (those held are for the old step: refused with another)
            if next_indices and numel >= 1024:  # k indices chosen ahead for the next step
                k = compression.config.num_selected(numel)
                entry["next_indices"] = (step, torch.arange(k, dtype=torch.int32) * (numel // k))
        compression.load_state_dict(sd)

    with_state(5, 1.5, next_indices=True)
    state.save()  # what commit() does before it asks the elastic driver for news
    saved = compression.state_dict()
    with_state(9, -2.0)  # a step that fails part way: restore() goes back to the commit
    state.restore()
    restored = compression.state_dict()
    for name in saved["params"]:
        assert restored["params"][name]["step"] == 5
        if saved["params"][name]["memory"] is not None:
            assert torch.equal(restored["params"][name]["memory"], saved["params"][name]["memory"])
            assert restored["params"][name]["next_indices"][0] == 5
    # The snapshot is a copy: training changes the live memory in place (decompress), not the snapshot.
    compression._slots[0].memory.add_(1.0)
    state.restore()
    assert torch.equal(compression.state_dict()["params"]["0.weight"]["memory"], torch.full((1200,), 1.5))

    # sync(): one broadcast of the step counters from rank 0 (here: rank 0 is at step 7); memories
    # stay this rank's own, pipelined indices of the old world are dropped.
    calls = []

    def fake_broadcast(tensor, root_rank, name=None, **kwargs):
        calls.append((name, root_rank, tensor.tolist()))
        return torch.full_like(tensor, 7)

    monkeypatch.setattr(hvd, "broadcast", fake_broadcast)
    state._handlers["compression"].sync()
    assert calls == [("scalecom.resync", 0, [5, 5, 5, 5])]
    synced = compression.state_dict()
    for entry in synced["params"].values():
        assert entry["step"] == 7 and "next_indices" not in entry
        if entry["memory"] is not None:
            assert torch.equal(entry["memory"], torch.full_like(entry["memory"], 1.5))

    # A joining rank: a fresh compressor (here assigned through the state, which re-targets the
    # handler and snapshots it) takes rank 0's counters and keeps its memories at zero (not allocated).
    other = ScaleCom(net.named_parameters(), ratio=0.1, pipelined=True)
    state.compression = other
    assert state._handlers["compression"].value is other
    state._handlers["compression"].sync()
    assert [(e["step"], e["memory"]) for e in other.state_dict()["params"].values()] == [(7, None)] * 4
    state.restore()  # back to its snapshot, taken when it was assigned
    assert [e["step"] for e in other.state_dict()["params"].values()] == [0] * 4


# -- real membership changes ------------------------------------------------------------------------

def elastic_run(tmp_path, opts, hosts, np_, max_np=3, env=None, timeout=240):
    """``horovodrun -np N --min-np 2 --max-np M --host-discovery-script`` (a script printing the hosts
    file that rank 0 rewrites) running tests/workers/torch_elastic.py; returns (events, output, out
    dir)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    discover.chmod(0o755)
    python = sys.executable
    cmd = [os.path.join(os.path.dirname(python), "horovodrun"), "-np", str(np_), "--min-np", "2",
           "--max-np", str(max_np), "--host-discovery-script", str(discover), "--network-interface", "lo",
           "--gloo", "--start-timeout", "120", "--elastic-timeout", "60",
           python, os.path.join(HERE, "workers", "torch_elastic.py"),
           json.dumps({**opts, "hosts_file": str(hosts_file)}), str(out_dir)]
    # HOROVOD_ELASTIC=1 is set for the workers by horovodrun itself. The Gloo timeout also bounds how
    # long the others wait in Gloo's rendezvous for a joining worker to start up (30 s by default).
    try:
        output = run_command(cmd, timeout=timeout,
                             env={"HOROVOD_GLOO_TIMEOUT_SECONDS": "120", **(env or {})})
    except HorovodRunError as error:
        raise HorovodRunError(f"elastic {error}\n{event_tails(out_dir)}") from None
    return read_events(out_dir), output, out_dir


def event_tails(out_dir):
    """The last lines each worker process recorded, for a failure's message."""
    parts = []
    for path in sorted(glob.glob(str(out_dir / "proc*.jsonl"))):
        with open(path) as f:
            parts.append(f"----- {os.path.basename(path)} (last lines) -----\n" + "".join(f.readlines()[-4:]))
    return "\n".join(parts)


def read_events(out_dir):
    events = []
    for path in glob.glob(str(out_dir / "proc*.jsonl")):
        with open(path) as f:
            events += [json.loads(line) for line in f]
    return events


def by(events, ev, **match):
    return [e for e in events if e["ev"] == ev and all(e[k] == v for k, v in match.items())]


def check_leaders(events):
    """Every attempt of a compressed step was selected by exactly one rank: step mod size."""
    attempts = {}
    for e in by(events, "end", rank=0):
        if e["step"] >= 1:
            attempts[(e["step"], e["size"])] = attempts.get((e["step"], e["size"]), 0) + 1
    for (step, size), n in sorted(attempts.items()):
        for name, numel in NUMEL.items():
            selected = [e["rank"] for e in by(events, "select", step=step, size=size, numel=numel)]
            assert selected == [step % size] * n, f"step {step}, size {size}, {name}: selected on {selected}"
    assert not by(events, "select", step=0)  # the warm-up step is dense


def check_compressed_traffic(events, steps):
    for e in by(events, "end"):
        if e["step"] not in steps:
            continue
        assert e["traffic"] == {"index_bytes": 4 * (154 + 32), "value_bytes": 4 * (154 + 32),
                                "dense_bytes": 4 * (64 + 10)}, e
        for name, k in K.items():
            assert 0 < e["nonzero"][name] <= k, e  # the applied gradient has k entries at most


def check_same_weights_every_step(events):
    """After every attempt of every step, all ranks of that world hold the same weights (an attempt:
    the n-th time a process completed that step; a rolled-back step is completed twice)."""
    attempts = {}
    for e in sorted(by(events, "end"), key=lambda e: (e["pid"], e["world"])):
        nth = sum(1 for key in attempts if key[0] == e["step"] and e["pid"] in attempts[key]["pids"])
        entry = attempts.setdefault((e["step"], nth), {"pids": set(), "sizes": set(), "weights": set()})
        entry["pids"].add(e["pid"])
        entry["sizes"].add(e["size"])
        entry["weights"].add(e["weights"])
    for (step, nth), entry in sorted(attempts.items()):
        (size,) = entry["sizes"]
        assert len(entry["pids"]) == size and len(entry["weights"]) == 1, (step, nth, entry)


def check_counters_agree(events):
    for e in by(events, "top"):
        assert set(e["slot_steps"].values()) == {e["step"]}, e


def check_joined_memory_started_at_zero(out_dir, events, joiners):
    for pid in joiners:
        first = min(by(events, "top", pid=pid), key=lambda e: e["step"])
        assert set(first["memory"].values()) == {None} and set(first["memory_abs_sum"].values()) == {0.0}
        with np.load(out_dir / f"joined{pid}.npz") as data:
            assert int(data["step"]) == first["step"]
            for name in K:
                g, memory = data[f"raw/{name}"].reshape(-1), data[f"memory/{name}"]
                sent = data[f"applied/{name}"].reshape(-1) != 0
                # From m = 0: m' = beta * g off the selected entries, 0 on them (p - p[I] = 0 there).
                # Any memory carried in from elsewhere would show up off the selected entries.
                assert 0 < sent.sum() <= K[name]
                np.testing.assert_array_equal(memory[sent], 0.0)
                np.testing.assert_allclose(memory[~sent], BETA * g[~sent], rtol=1e-6, atol=1e-9)


def check_own_memory_carried_over(events, pid, boundary):
    """This process's memories at the top of step ``boundary`` in the new world are the ones it had
    after the step before in the old world; no other rank holds the same (memories are never sent)."""
    top = max(by(events, "top", pid=pid, step=boundary), key=lambda e: e["world"])
    end = min(by(events, "end", pid=pid, step=boundary - 1), key=lambda e: e["world"])
    assert top["world"] > end["world"] and top["memory"] == end["memory"]
    assert top["memory"]["hidden.weight"] is not None
    for other in by(events, "top", step=boundary):
        if other["pid"] != pid:
            assert other["memory"]["hidden.weight"] != top["memory"]["hidden.weight"]


def timeline_submitters(path):
    """``{operation name: ranks that submitted it}`` from the negotiation marks of a Horovod timeline
    (a root's broadcast carries no shape there, so ``read_operations`` does not list it)."""
    with open(path) as f:
        text = f.read().strip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("name") == "process_name" and "name" in e.get("args", {})}
    ranks = {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in names and str(e.get("name")).isdigit():
            ranks.setdefault(names[e["pid"]], set()).add(int(e["name"]))
    return ranks


def worlds_of(events, pid):
    """(size, first step, rank) of each world this process entered."""
    entries = sorted(by(events, "enter", pid=pid), key=lambda e: e["world"])
    return [(e["size"], e["step"], e["rank"]) for e in entries]


def test_join_leave_failure_and_join_again(tmp_path):
    """One job, commits every 2 steps, 12 steps, four changes:

    - world 1, size 2 (``localhost:2``): steps 0-1; then ``127.0.0.1:1`` is added: worker A joins.
    - world 2, size 3: steps 2-5 (A leads steps 2 and 5); then ``127.0.0.1`` goes: A is removed.
    - world 3, size 2 (Horovod re-initialises without sync() when hosts only left): steps 6-8; at the
      start of step 9 every rank raises HorovodInternalError (a failed collective), restore() takes
      them back to the commit after step 7, step 8 is rolled back (memories, counters, weights).
    - world 4, size 2: steps 8-9 again; then ``127.0.0.1:1`` is back: worker B joins.
    - world 5, size 3: steps 10-11 (B leads step 11).
    """
    two, three = "localhost:2\n", "localhost:2\n127.0.0.1:1\n"
    opts = {"steps": 12, "commit_every": 2, "changes": {"2": three, "6": two, "10": three}, "fail_at": 9,
            "beta": BETA, "warmup_steps": 1, "random_init": True}
    timeline = tmp_path / "timeline.json"  # re-created at each initialisation: the last world
    events, _, out_dir = elastic_run(tmp_path, opts, two, 2, env={"HOROVOD_TIMELINE": str(timeline)})

    # Who ran what: ranks 0 and 1 throughout, A in world 2, B in world 5.
    survivors = sorted({e["pid"] for e in by(events, "enter", step=0)},
                       key=lambda p: by(events, "enter", pid=p)[0]["rank"])
    joiners = sorted({e["pid"] for e in by(events, "enter") if e["joined"]},
                     key=lambda p: by(events, "enter", pid=p)[0]["step"])
    assert len(survivors) == 2 and len(joiners) == 2
    for rank, pid in enumerate(survivors):
        assert worlds_of(events, pid) == [(2, 0, rank), (3, 2, rank), (2, 6, rank), (2, 8, rank),
                                          (3, 10, rank)]
    assert worlds_of(events, joiners[0]) == [(3, 2, 2)] and not by(events, "done", pid=joiners[0])
    assert worlds_of(events, joiners[1]) == [(3, 10, 2)]
    assert sorted((e["rank"], e["step"]) for e in by(events, "done")) == [(0, 12), (1, 12), (2, 12)]
    attempts = {}  # step -> sizes of the worlds that completed it
    for e in by(events, "end", rank=0):
        attempts.setdefault(e["step"], []).append(e["size"])
    assert attempts == {0: [2], 1: [2], 2: [3], 3: [3], 4: [3], 5: [3], 6: [2], 7: [2], 8: [2, 2], 9: [2],
                        10: [3], 11: [3]}

    # sync() ran ScaleCom.resync on every rank of each world Horovod synced (start, join, failure,
    # join) but not after the removal; the agreement check ran again at the first step after each.
    for kind in ("resync", "agree"):
        for pid in survivors:
            assert [e["size"] for e in by(events, kind, pid=pid)] == [2, 3, 2, 3], (kind, pid)
        for pid in joiners:
            assert [e["size"] for e in by(events, kind, pid=pid)] == [3], (kind, pid)
    assert sorted({e["step"] for e in by(events, "agree")}) == [0, 2, 8, 10]

    # The rollback: step 8 ran again from the state committed after step 7.
    for pid in survivors:
        assert by(events, "fail", pid=pid, step=9)
        redo = by(events, "top", pid=pid, step=8, world=4)[0]
        committed = by(events, "end", pid=pid, step=7, world=3)[0]
        dropped = by(events, "end", pid=pid, step=8, world=3)[0]
        assert set(redo["slot_steps"].values()) == {8}
        assert redo["memory"] == committed["memory"] != dropped["memory"]
        assert redo["weights"] == committed["weights"] != dropped["weights"]

    check_counters_agree(events)  # each joiner's first step included: rank 0's counters, not 0
    check_same_weights_every_step(events)  # the joiners' own initial weights included
    finals = [dict(np.load(out_dir / f"final{r}.npz")) for r in range(3)]
    for name in ("hidden.weight", "hidden.bias", "out.weight", "out.bias"):
        for r in (1, 2):
            np.testing.assert_array_equal(finals[r][f"final/{name}"], finals[0][f"final/{name}"])
    check_leaders(events)  # t mod size with the size of each world
    for pid, steps in ((joiners[0], {2, 5}), (joiners[1], {11})):
        assert {e["step"] for e in by(events, "select", pid=pid)} == steps
    check_compressed_traffic(events, range(1, 12))
    check_joined_memory_started_at_zero(out_dir, events, joiners)
    for pid in survivors:
        check_own_memory_carried_over(events, pid, 2)  # across the first join
        check_own_memory_carried_over(events, pid, 6)  # across the removal
        check_own_memory_carried_over(events, pid, 10)  # across the second join
    for name in K:  # memories stay apart: the final ones differ between the ranks
        for a, b in ((0, 1), (0, 2), (1, 2)):
            assert not np.array_equal(finals[a][f"memory/{name}"], finals[b][f"memory/{name}"])

    # What Horovod moved in the last world (steps 10-11 at size 3), as rank 0 recorded it: the resync
    # broadcast and the agreement check from all three ranks, then per step and tensor k values, and
    # k int32 indices from the leaders of steps 10 (rank 1) and 11 (rank 2, B).
    from devtools.timeline import read_operations

    submitters = timeline_submitters(timeline)
    assert submitters["broadcast.scalecom.resync"] == submitters["allgather.scalecom.agreement"] == {0, 1, 2}
    ops = [(op["name"], op["numel"], op["dtype"]) for op in read_operations(timeline)]
    assert ("allgather.scalecom.agreement.sizes", 3, "int64") in ops
    for name, k in K.items():
        assert [o for o in ops if o[0] == f"allreduce.{name}"] == [(f"allreduce.{name}", k, "float32")] * 2
        assert [o for o in ops if o[0] == f"allgather.scalecom.{name}"] == \
            [(f"allgather.scalecom.{name}", k, "int32")] * 2
