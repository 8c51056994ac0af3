"""Smoke test of ``benchmarks.scale``: a real 8-rank job checked against the reference, and its rows."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scale(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "benchmarks.scale", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_eight_ranks_match_the_reference_and_send_a_fraction_of_dense_bytes(tmp_path):
    """8 ranks, each leading once: the weights are bitwise equal on every rank and equal the reference's
    (the benchmark exits 1 otherwise), and each worker's bytes are a small fraction of dense's."""
    rows_path, page = tmp_path / "rows.json", tmp_path / "performance.md"
    done = scale("--smoke", "--ranks", "8", "--out", str(page), "--json", str(rows_path))
    assert done.returncode == 0, done.stdout + done.stderr
    [scalecom] = json.loads(rows_path.read_text())
    assert scalecom["compression"] == "scalecom" and scalecom["ranks"] == 8 and scalecom["leaders"] == 8
    # ratio 0.01 of 1,064,960 compressed entries, 4-byte values and indices, and 64 dense floats
    assert scalecom["stats_sent_bytes"] == 8 * (10486 + 164) + 4 * 64
    if os.geteuid() == 0:  # measured on the job's own loopback, as a mean over the 8 workers: at least the
        # values (a ring allreduce sends 2 (n - 1) / n = 1.75x them) and half the indices (stats() counts
        # them on the leader that sends them and on each rank that receives them), with headers and
        # Horovod's own messages; a small fraction of the dense gradient's 4,260,096 bytes
        values, indices = 4 * (10486 + 164) + 4 * 64, 4 * (10486 + 164)
        assert values + indices / 2 < scalecom["wire_bytes_per_worker_step"] < 0.1 * 4260096
    assert "| scalecom | 8 | 8 | matched |" in page.read_text()


def test_bad_rank_count_is_refused_before_any_job():
    done = scale("--ranks", "1", timeout=60)
    assert done.returncode == 2 and "--ranks" in done.stderr
