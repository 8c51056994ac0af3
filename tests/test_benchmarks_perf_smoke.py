"""The performance benchmarks in their --smoke mode, so that they cannot rot (no timing is asserted).

The slow-link benchmark needs root and ``ip netns``; where they are missing it reports that it
skipped, and so does its test.
"""

import argparse
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from benchmark_smoke import ROOT, run_smoke

from benchmarks import slow_link


def test_kernels_smoke(tmp_path):
    out, tmp = tmp_path / "performance.md", tmp_path / "tmp"
    tmp.mkdir()
    plot = tmp_path / "plots" / "kernels.png"  # (a new directory: made, not a failure after the run)
    run_smoke("benchmarks.kernels", out, timeout=300, extra=("--plot", str(plot)), env={"TMPDIR": str(tmp)})
    assert not list(tmp.iterdir())  # (its child process left an empty smoke directory behind)
    text = out.read_text()
    assert "<!-- kernels:begin -->" in text and "## Kernels" in text
    assert "![compress + decompress against the floor](kernels.png)" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 100,000 | 0.01 | default |" in text and "| 100,000 | 0.001 | default |" in text
    # 2^19 entries: the non-leader trades buffers, and its C passes alone are timed
    lines = text.splitlines()
    header = next(line for line in lines if "| non-leader, C passes alone |" in line).split("|")
    row = next(line for line in lines if line.startswith("| 524,288 | 0.01 | default |")).split("|")
    assert len(row) == len(header) and row[header.index(" non-leader, C passes alone ")].strip().endswith("x)")
    assert "| 1.0000 |" in text  # the threshold selection finds the exact top-k set


def test_slow_link_smoke(tmp_path):
    """The shared-loopback mode (tests/test_benchmarks_links_smoke.py runs the per-worker links)."""
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nkept\n")
    stdout = run_smoke("benchmarks.slow_link", out, timeout=600,
                       extra=("--link", "shared-loopback", "--jobs", "dense", 'scalecom:{"ratio": 0.01}'))
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    text = out.read_text()
    assert "kept" in text and "<!-- slow_link:begin -->" in text
    link = float(re.search(r"1gbit: one TCP stream gets ([0-9.]+) Gbit/s", stdout).group(1))
    assert 0.5 < link < 1.2, f"the shaped link carried {link} Gbit/s, not about 1"  # (32 MiB: past the bucket)
    row = next(line for line in text.splitlines() if line.startswith("| 1gbit | 2 | ScaleCom 0.01 |")).split("|")
    assert float(row[5]) > 0 and row[6].strip().endswith("x")  # vs dense, speed-up over dense (no timing asserted)
    assert not _namespaces_left(), "a namespace was left behind"


def _namespaces_left():
    return [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            .splitlines() if line.startswith(slow_link.PREFIX)]


def test_a_slow_link_job_past_its_timeout_is_reported_and_leaves_nothing_running(tmp_path):
    """A job past --timeout (its workers training, a million steps to go): exit 1 and a message naming
    the job and --timeout, not a TimeoutExpired traceback; no namespace, no worker and no page left."""
    out = tmp_path / "performance.md"
    done = subprocess.run([sys.executable, "-m", "benchmarks.slow_link", "--smoke", "--out", str(out), "--jobs",
                           "dense", "--steps", "1000000", "--timeout", "12"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    if "slow_link: skipped:" in done.stdout:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "slow_link: failed: dense with 2 workers ran past --timeout 12 s and was stopped" in done.stderr
    assert "Traceback" not in done.stderr and not out.exists()
    assert not _namespaces_left(), "a namespace was left behind"
    workers = subprocess.run(["pgrep", "-f", slow_link.WORKER], capture_output=True, text=True).stdout.split()
    assert not workers, f"workers of the stopped job still run: {workers}"


def test_a_smoke_run_that_writes_nothing_leaves_no_directory(tmp_path):
    """A smoke run's temporary directory is removed at exit when nothing was written into it (a
    slow-link smoke run that skipped without root, or one that failed, left an empty one each time)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = ("from benchmarks._report import output_path; import os, sys; "
            "kept = output_path(None, True, 'kept.md'); open(kept, 'w').close(); "
            "output_path(None, True, 'x.md'); sys.exit(3)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp)}, timeout=120)
    assert done.returncode == 3
    assert [p.name for p in tmp.glob("*/*")] == ["kept.md"] and len(list(tmp.iterdir())) == 1


def test_slow_link_report_from_synthetic_rows():
    """The report's arithmetic without a namespace (no root needed): ratios against dense, the median
    of repeats, bytes per worker, and the scaling table's growth against the ring allreduce's."""
    def row(rate, workers, compressor, step, tx, **extra):
        return {"rate": rate, "workers": workers, "compressor": compressor, "label": compressor,
                "median_step_seconds": step, "floor_seconds": 0.010, "tx_bytes": tx, "steps": 10,
                "dense_bytes": 4_000_000, "parameters": 1_000_000, **extra}

    repeats = [row("1gbit", 2, "scalecom", s, tx, compressor_stats={"sent_bytes": b, "index_wait_seconds": 0.001,
                                                                   "compress_seconds": 0.002})
               for s, tx, b in ((0.030, 2e6, 80_000), (0.050, 4e6, 80_000), (0.040, 3e6, 80_000))]
    combined = slow_link.combine(repeats)
    assert (combined["median_step_seconds"], combined["tx_bytes"], combined["repeats"]) == (0.040, 3e6, 3)
    rows = [row("1gbit", 2, "dense", 0.200, 80e6), combined,
            row("1gbit", 4, "dense", 0.300, 240e6), {**combined, "workers": 4, "tx_bytes": 9e6}]
    args = argparse.Namespace(widths=[10, 10], batch=8, warmup=1, steps=10, repeats=3, workers=[2, 4],
                              calibrate_bytes=64 << 20, link="shared-loopback", model_size="full",
                              framework="torch")
    text = slow_link.markdown(rows, {"1gbit": 0.99}, args, "python -m benchmarks.slow_link", None, [1.0, 2.0])
    lines = text.splitlines()
    assert ("| 1gbit | 2 | scalecom | 40.0 | 0.200 | 5.00x | 10.0 | 4.00x | 0.150 | 0.0375 | 0.080 | 1.0 | 2.0 |"
            in lines)
    assert "| 1gbit | 2 | dense | 200.0 | 1.000 | 1.00x | 10.0 | 20.00x | 4.000 | 1.0000 | 4.000 |  |  |" in lines
    assert "| 1gbit | scalecom | 0.150 | 0.225 | 1.50x | 1.50x |" in lines  # 3e6 / 10 / 2 -> 9e6 / 10 / 4
    assert "bucket 128kb at 1gbit" in text and "up to 4 workers" in text


def test_slow_link_unshaped_report_says_so():
    """``--rates unshaped`` (the step where the network is free): no bucket named, the loopback said
    to be not shaped."""
    rows = [{"rate": "unshaped", "workers": 2, "compressor": "dense", "label": "dense", "median_step_seconds": 0.2,
             "floor_seconds": 0.1, "tx_bytes": 80e6, "steps": 10, "dense_bytes": 4_000_000, "parameters": 1_000_000}]
    args = argparse.Namespace(widths=[10, 10], batch=8, warmup=1, steps=10, repeats=1, workers=[2],
                              calibrate_bytes=64 << 20, link="shared-loopback", model_size="full",
                              framework="torch")
    text = slow_link.markdown(rows, {"unshaped": 27.0}, args, "python -m benchmarks.slow_link", None, [1.0, 2.0])
    assert "one loopback shared by all workers" in text and "not shaped" in text and "tbf" not in text
    assert "| unshaped | 2 | dense | 200.0 | 1.000 | 1.00x | 100.0 | 2.00x |" in text
    done = subprocess.run([sys.executable, "-m", "benchmarks.slow_link", "--rates", "2gbit"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--rates" in done.stderr and "unshaped" in done.stderr


def test_overhead_smoke(tmp_path):
    """Both frontends on the tiny CNN, the schemes taking turns: every scheme and the floor get a row
    in each frontend's table, ScaleCom on PyTorch with its compress time (no timing asserted)."""
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nkept\n")
    run_smoke("benchmarks.overhead", out, timeout=600)
    text = out.read_text()
    assert "kept" in text and "<!-- overhead:begin -->" in text and "## Overhead where the network is free" in text
    for frontend in ("PyTorch", "TensorFlow"):
        at = text.index(f"### {frontend}: ResNet-18 (4 base channels)")
        table = [line.split("|")[1:-1] for line in text[at:].splitlines()[4:8]]
        assert [c[0].strip() for c in table[:3]] == ["no communication (floor)", "dense", "ScaleCom 0.01"], table
        assert not table[3] or not table[3][0].strip(), "a row too many"
        cells = {c[0].strip(): [x.strip() for x in c[1:]] for c in table[:3]}
        assert cells["dense"][1] == "1.000" and cells["no communication (floor)"][2] == "1.00x"
        assert float(cells["ScaleCom 0.01"][0]) > 0 and float(cells["ScaleCom 0.01"][1]) > 0
        assert (float(cells["ScaleCom 0.01"][3]) > 0) if frontend == "PyTorch" else cells["ScaleCom 0.01"][3] == ""


def test_overhead_refuses_a_bad_job():
    done = subprocess.run([sys.executable, "-m", "benchmarks.overhead", "--jobs", 'fp16:{"ratio": 0.1}'], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --jobs: fp16 takes no options" in done.stderr, done.stderr


def test_sketch_kernels_smoke(tmp_path):
    out = tmp_path / "performance.md"
    run_smoke("benchmarks.sketch_kernels", out, timeout=300)
    text = out.read_text()
    assert "<!-- sketch:begin -->" in text and "## Count sketch" in text
    assert "| C kernels |" in text and "| torch operations |" in text


def test_per_tensor_smoke(tmp_path):
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nkept\n")
    run_smoke("benchmarks.per_tensor", out, timeout=300)
    text = out.read_text()
    assert "kept" in text and "<!-- per_tensor:begin -->" in text and "## Per-tensor cost" in text
    lines = text.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| entries |")).split("|")]
    row = [c.strip() for c in next(line for line in lines if line.startswith("| 4,096 | 4 |")).split("|")]
    assert len(row) == len(header)
    cell = dict(zip(header, row))
    assert float(cell["dense (ms)"]) > 0 and cell["ScaleCom"].endswith("x)")  # (no timing asserted)
    assert cell["ScaleCom, broadcast"].endswith("x)") and cell["ScaleCom, pipelined"].endswith("x)")
    waits = cell["index wait per tensor, non-leader, allgather / broadcast (µs)"].split(" / ")
    assert len(waits) == 2 and all(float(w) >= 0 for w in waits)
    leader, non_leader = cell["compute per tensor, leader / non-leader (µs)"].split(" / ")
    assert float(leader) > 0 and float(non_leader) > 0  # both ranks led one of the steps and followed in another


def test_gpu_kernels_smoke_on_the_cpu(tmp_path):
    """The GPU benchmark's steps with --device cpu (no GPU here); without CUDA its default says so and
    measures nothing."""
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nkept\n")
    json_path = tmp_path / "json" / "r.json"  # (a new directory: made, not a failure after the page was written)
    run_smoke("benchmarks.gpu_kernels", out, timeout=300, extra=("--device", "cpu", "--json", str(json_path)))
    text = out.read_text()
    assert "kept" in text and "<!-- gpu_kernels:begin -->" in text and "## GPU" in text
    lines = text.splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| entries |")).split("|")]
    cell = dict(zip(header, [c.strip()
                             for c in next(line for line in lines if line.startswith("| 65,536 |")).split("|")]))
    assert cell["overlap (sampled threshold)"] == "1.0000 (1.0000)" and cell["same indices as the CPU"] == "yes"
    assert cell["leader"].endswith("x)") and cell["selection, sampled threshold"].endswith("x)")
    below = lines[lines.index("| scheme | weights, device against CPU | same bytes | bytes per worker |") + 2:]
    schemes = [line.split("|")[1].strip() for line in below if line.startswith("| ") and "| yes |" in line]
    assert schemes == ["Dense", "FP16", "ScaleCom", "ScaleCom, pipelined", "LocalTopK", "GlobalTopK", "GTopK",
                       "RandomK", "SketchedSGD", "QsparseLocalSGD", "PowerSGD"]
    result = json.loads(json_path.read_text())
    assert result["kernels"][0]["leader_diff"] == [0.0, 0.0]  # (the CPU against itself, torch operations)
    if not torch.cuda.is_available():
        stdout = subprocess.run([sys.executable, "-m", "benchmarks.gpu_kernels", "--smoke", "--out", str(out)],
                                cwd=ROOT, capture_output=True, text=True, timeout=120, check=True).stdout
        assert "no CUDA device here" in stdout


@pytest.mark.parametrize("module, argv, option", [
    ("kernels", ["--sizes", "0"], "--sizes"),  # (divided by zero)
    ("kernels", ["--ratios", "nan"], "--ratios"),
    ("kernels", ["--rounds", "0"], "--rounds"),  # (no median of nothing)
    ("per_tensor", ["--steps", "0"], "--steps"),  # (ran its default 40 steps)
    ("sketch_kernels", ["--rows", "0"], "--rows"),  # (timed an empty table)
    ("gpu_kernels", ["--ratios", "1.5"], "--ratios"),
    ("soak", ["--np", "0"], "--np"),  # (ran 4 workers)
    ("soak", ["--timeout", "inf"], "--timeout"),
    ("slow_link", ["--repeats", "0"], "--repeats"),  # (ran 2 of each job)
    ("slow_link", ["--jobs", "dense", "sketchy"], "unknown scheme 'sketchy'"),  # (failed in the namespace)
    ("slow_link", ["--jobs", "scalecom:{ratio: 0.1}"], "is not JSON"),
    ("slow_link", ["--scalecom-kwargs", "[1]"], "--scalecom-kwargs"),
    ("slow_link", ["--widths", "64"], "--widths"),
    # options a scheme refuses, found by building it here (they failed in the namespace, after other jobs)
    ("slow_link", ["--jobs", "dense", 'scalecom:{"ratoi": 0.01}'], "unexpected keyword argument 'ratoi'"),
    ("slow_link", ["--jobs", 'qsparse:{"local_steps": 0}'], "argument --jobs: 'qsparse:"),
    ("slow_link", ["--scalecom-kwargs", '{"ratio": 2}'], 'with --scalecom-kwargs {"ratio": 2}: ratio must be'),
    ("slow_link", ["--jobs", 'dense:{"ratio": 0.1}'], "dense takes no options"),  # (ignored)
    ("kernels", ["--plot", "/dev/null/kernels.png"], "--plot"),  # (failed after the run)
    ("gpu_kernels", ["--json", "/"], "--json"),
    ("gpu_kernels", ["--device", "gpu"], "--device"),  # (torch's traceback)
    ("tf_index_exchange", ["--workers", "0"], "--workers"),
    ("convergence", ["--threads", "0"], "--threads"),
    # no abbreviations: --out on convergence was taken for --out-dir, --size for --sizes
    ("convergence", ["--out", "elsewhere"], "unrecognized arguments: --out elsewhere"),
    ("kernels", ["--size", "4096"], "unrecognized arguments: --size 4096"),
])
def test_a_bad_argument_is_refused_naming_it_before_anything_runs(module, argv, option, tmp_path, capsys):
    """argparse's exit 2 with the option named; nothing written (a 0 was taken for the default)."""
    import importlib
    main = importlib.import_module(f"benchmarks.{module}").main
    out = tmp_path / "out.md"
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--out" if module not in ("soak", "convergence") else "--out-dir", str(out)])
    assert exit_.value.code == 2 and option in capsys.readouterr().err
    assert not out.exists()
