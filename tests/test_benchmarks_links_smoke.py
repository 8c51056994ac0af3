"""Per-worker links (``benchmarks.cluster_links``) and the benchmark models (``benchmarks.models``).

The network tests need root and ``ip netns``; where they are missing they skip.
"""

import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from benchmark_smoke import ROOT, run_smoke

from benchmarks import cluster_links, models


def _namespaces_left(pid=None):
    names = [(line.split() or [""])[0] for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()]
    prefix = cluster_links.PREFIX + ("" if pid is None else f"{pid}_")
    return [n for n in names if n.startswith(prefix)]


def _skip_without_namespaces():
    try:
        cluster_links.check_namespaces()
    except cluster_links.Skip as why:
        pytest.skip(str(why))


def _table(text, heading):
    """``[{column: cell}]`` of the first table after the line starting with ``heading``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    rows = [line for line in lines[start + 1:] if line.startswith("|")]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    body = []
    for line in rows[2:]:
        if not line.startswith("| 1gbit") and not line.startswith("| 10gbit"):
            break
        body.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return body


def test_slow_link_on_per_worker_links(tmp_path):
    """Dense and ScaleCom 0.01 on a tiny MLP, 2 workers, each on its own 1 Gbit/s link: the job ran on
    the per-worker links (each worker's eth0 sent and received at least the dense payload that a ring
    allreduce of 2 sends, about the model's fp32 gradients), and ScaleCom's bytes per worker are well
    under dense's."""
    out = tmp_path / "performance.md"
    started = time.perf_counter()
    stdout = run_smoke("benchmarks.slow_link", out, timeout=300)
    took = time.perf_counter() - started
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    link = float(re.search(r"1gbit: one TCP stream gets ([0-9.]+) Gbit/s", stdout).group(1))
    assert 0.5 < link < 1.2, f"a shaped link carried {link} Gbit/s, not about 1"
    text = out.read_text()
    assert "one shaped link per worker" in text
    rows = {r["scheme"]: r for r in _table(text, "### an MLP")}
    dense, scalecom = rows["dense"], rows["ScaleCom 0.01"]
    payload = 4 * sum(p.numel() for p in models.build_model("mlp", "tiny").parameters())
    assert float(dense["payload MB/step/worker"]) == pytest.approx(payload / 1e6, abs=1e-3)
    for row in (dense, scalecom):
        each = [tuple(float(v) for v in w.split("/")) for w in row["each worker sent/received MB/step"].split(", ")]
        assert len(each) == 2 and all(sent > 0 and received > 0 for sent, received in each), row
        if row is dense:  # each worker's own link: sent and received about one payload (ring of 2)
            assert all(0.9 * payload / 1e6 <= v <= 1.5 * payload / 1e6 for w in each for v in w), (each, payload)
        # the wire column is the mean of the workers' sent bytes
        assert float(row["MB/step/worker (wire)"]) == pytest.approx(sum(s for s, _ in each) / 2, abs=2e-3)
    assert float(scalecom["wire bytes vs dense"]) < 0.2, scalecom
    assert not _namespaces_left(), "a namespace was left behind"
    print(f"per-worker slow-link smoke: {took:.1f} s")


def test_each_link_is_its_own_and_shaped(capsys):
    """Two pairs of workers sending at once each get about the rate (they share no link), and so do
    both directions of one link; at veth speed the same streams run far faster."""
    _skip_without_namespaces()
    results = cluster_links.check("1gbit", megabytes=32)
    for case in ("one stream 0->1", "both directions 0->1, 1->0", "two pairs 0->1, 2->3"):
        assert all(0.6 < g < 1.2 for g in results[case]), (case, results[case])
    assert not _namespaces_left(os.getpid())
    with cluster_links.cluster(None, 2, tag="fast") as c:
        fast = cluster_links.streams(c, [(0, 1)], 256)[0]
    assert fast > 2.0, f"an unshaped link carried only {fast} Gbit/s: the 1 Gbit/s above says little"


def test_cluster_removed_on_sigterm_and_leftovers_of_a_killed_run():
    """SIGTERM during a check: exit, no namespace, no stream process left. SIGKILL: the namespaces
    and their processes stay until the next run's remove_leftovers, which removes them."""
    _skip_without_namespaces()
    for signum in (signal.SIGTERM, signal.SIGKILL):
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.cluster_links", "--rate", "100mbit",
                                 "--megabytes", "100000"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        while len(_namespaces_left(proc.pid)) < 5 or not subprocess.run(
                ["ip", "netns", "pids", f"{cluster_links.PREFIX}{proc.pid}_check_w1"],
                capture_output=True, text=True).stdout.split():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        inside = [int(p) for ns in _namespaces_left(proc.pid)
                  for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        assert inside  # (the receiver, at least)
        proc.send_signal(signum)
        proc.communicate(timeout=60)
        if signum == signal.SIGKILL:
            assert _namespaces_left(proc.pid), "nothing was left to remove: the test checks nothing"
            cluster_links.remove_leftovers()
        time.sleep(0.5)  # (the streams' processes die with their parent or are killed)
        assert not _namespaces_left(proc.pid)
        alive = [p for p in inside if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
        assert not alive, f"processes of the namespaces still run after {signal.Signals(signum).name}: {alive}"


@pytest.mark.parametrize("name", models.MODELS)
def test_models_train_on_their_batches(name):
    """Each tiny model takes its batch, gives one logit row per target and learns it (the loss falls
    over a few SGD steps on the one batch)."""
    torch.manual_seed(0)
    model = models.build_model(name, "tiny")
    x, y = models.make_batch(name, "tiny", 4, torch.Generator().manual_seed(1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = models.task_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_full_model_sizes():
    """The published shapes: ResNet-18 for 32x32 images has 11,173,962 parameters (CIFAR-10); the
    language model's count follows from its sizes; the MLP keeps the slow-link default."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):
        assert count(models.build_model("resnet18")) == 11_173_962
        assert count(models.build_model("mlp")) == 8_403_978
        c = models.TRANSFORMER["full"]
        v, w, f, n = c["vocabulary"], c["width"], c["feed_forward"], c["layers"]
        layer = 4 * w * w + 4 * w + 2 * w * f + f + w + 4 * w  # attention, feed-forward, two norms
        assert count(models.build_model("transformer")) == v * w + c["tokens"] * w + n * layer + 2 * w + w * v + v
    causal = models.build_model("transformer", "tiny")
    x, _ = models.make_batch("transformer", "tiny", 2, torch.Generator().manual_seed(0))
    changed = x.clone()
    changed[:, -1] = (changed[:, -1] + 1) % models.TRANSFORMER["tiny"]["vocabulary"]
    with torch.no_grad():  # causal: a later token does not change the earlier positions' logits
        assert torch.allclose(causal(x)[:, :-1], causal(changed)[:, :-1], atol=1e-5)


def test_keras_models_have_the_torch_shapes():
    """The Keras 3 models have the same parameter counts as the torch ones and take the same batches."""
    pytest.importorskip("keras")
    for name in models.MODELS:
        torch_model = models.build_model(name, "tiny")
        keras_model = models.build_keras_model(name, "tiny")
        assert sum(math.prod(v.shape) for v in keras_model.trainable_variables) == \
            sum(p.numel() for p in torch_model.parameters()), name
        x, y = models.numpy_batch(name, models.make_batch(name, "tiny", 2, torch.Generator().manual_seed(0)))
        logits = keras_model(x)
        assert tuple(logits.shape) == tuple(torch_model(models.make_batch(
            name, "tiny", 2, torch.Generator().manual_seed(0))[0]).shape), name


def test_tensorflow_jobs_are_the_schemes_its_worker_runs(tmp_path, capsys):
    """A torch-only scheme with --framework tensorflow is refused before anything runs, naming it."""
    from benchmarks import slow_link
    out = tmp_path / "out.md"
    with pytest.raises(SystemExit) as exit_:
        slow_link.main(["--framework", "tensorflow", "--smoke", "--jobs", "dense", 'qsparse:{"local_steps": 5}',
                        "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "'qsparse:{\"local_steps\": 5}'" in err
    assert "the TensorFlow worker runs dense, fp16, scalecom only" in err and not out.exists()


def test_per_worker_report_from_synthetic_rows():
    """Each worker's own bytes per step in the per-worker table, the wire column their mean, one
    table per model."""
    import argparse

    from benchmarks import slow_link

    def row(model, compressor, tx):
        wire = [{"tx_bytes": t, "rx_bytes": r} for t, r in tx]
        return {"rate": "1gbit", "workers": 2, "compressor": compressor, "label": compressor, "model": model,
                "median_step_seconds": 0.1, "floor_seconds": 0.05, "tx_bytes": sum(t for t, _ in tx), "steps": 10,
                "dense_bytes": 4_000_000, "parameters": 1_000_000, "wire": wire}

    rows = [row("mlp", "dense", [(40e6, 41e6), (41e6, 40e6)]), row("mlp", "scalecom", [(2e6, 3e6), (3e6, 2e6)]),
            row("transformer", "dense", [(40e6, 40e6), (40e6, 40e6)])]
    combined = slow_link.combine([rows[1], {**rows[1], "wire": [{"tx_bytes": 4e6, "rx_bytes": 5e6}] * 2}])
    assert combined["wire"] == [{"tx_bytes": 3e6, "rx_bytes": 4e6}, {"tx_bytes": 3.5e6, "rx_bytes": 3.5e6}]
    args = argparse.Namespace(widths=[10, 10], batch=8, warmup=1, steps=10, repeats=1, workers=[2],
                              calibrate_bytes=32 << 20, link="per-worker", model_size="full", framework="torch")
    text = slow_link.markdown(rows, {"1gbit": 0.97}, args, "python -m benchmarks.slow_link", None, [1.0, 2.0])
    assert "one shaped link per worker" in text and "0.97 Gbit/s at 1gbit" in text
    assert text.count("### ") == 2 and "### a Transformer language model" in text
    lines = text.splitlines()
    assert "| 1gbit | 2 | scalecom | 100.0 | 1.000 | 1.00x | 50.0 | 2.00x | 0.250 | 0.0617 | 4.000 |  |  | " \
           "0.200/0.300, 0.300/0.200 |" in lines
    assert "| 1gbit | 2 | dense | 100.0 | 1.000 | 1.00x | 50.0 | 2.00x | 4.050 | 1.0000 | 4.000 |  |  | " \
           "4.000/4.100, 4.100/4.000 |" in lines


def test_slow_link_tensorflow_on_per_worker_links(tmp_path):
    """The Keras 3 twin (a tiny ResNet-18 through make_train_step) on per-worker links: each worker's
    link carried about the dense payload, and ScaleCom's bytes per worker are well under dense's."""
    out = tmp_path / "performance.md"
    stdout = run_smoke("benchmarks.slow_link", out, timeout=600,
                       extra=("--framework", "tensorflow", "--models", "resnet18"))
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    text = out.read_text()
    assert "<!-- slow_link_tensorflow:begin -->" in text and "TensorFlow workers: Keras 3 models" in text
    rows = {r["scheme"]: r for r in _table(text, "### ResNet-18")}
    payload = 4 * sum(p.numel() for p in models.build_model("resnet18", "tiny").parameters())
    each = [float(v) for w in rows["dense"]["each worker sent/received MB/step"].split(", ") for v in w.split("/")]
    assert len(each) == 4 and all(0.9 * payload / 1e6 <= v <= 1.5 * payload / 1e6 for v in each), (each, payload)
    assert float(rows["ScaleCom 0.01"]["wire bytes vs dense"]) < 0.5, rows["ScaleCom 0.01"]
    assert not _namespaces_left(), "a namespace was left behind"
