"""Smoke test of ``benchmarks.scale``: a real 2-rank job checked against the reference, and its rows."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scale(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "benchmarks.scale", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_two_ranks_match_the_reference_and_send_a_fraction_of_dense_bytes(tmp_path):
    rows_path, page = tmp_path / "rows.json", tmp_path / "performance.md"
    done = scale("--smoke", "--out", str(page), "--json", str(rows_path))
    assert done.returncode == 0, done.stdout + done.stderr
    [scalecom] = json.loads(rows_path.read_text())
    assert scalecom["compression"] == "scalecom" and scalecom["ranks"] == 2 and scalecom["leaders"] == 2
    # ratio 0.01 of 1,064,960 compressed entries, 4-byte values and indices, and 64 dense floats
    assert scalecom["stats_sent_bytes"] == 8 * (10486 + 164) + 4 * 64
    if os.geteuid() == 0:  # measured on the job's own loopback, as a mean over the 2 workers: the values
        # (allreduced: 2 (n - 1) / n = 1x), half the indices (stats() counts them on the leader that
        # sends them and on the rank that receives them; they cross the wire once), headers and
        # Horovod's own messages; a small fraction of the dense gradient's 4,260,096 bytes
        values, indices = 4 * (10486 + 164) + 4 * 64, 4 * (10486 + 164)
        assert values + indices / 2 < scalecom["wire_bytes_per_worker_step"] < 0.1 * 4260096
    assert "| scalecom | 2 | 2 | matched |" in page.read_text()


def test_bad_rank_count_is_refused_before_any_job():
    done = scale("--ranks", "1", timeout=60)
    assert done.returncode == 2 and "--ranks" in done.stderr
