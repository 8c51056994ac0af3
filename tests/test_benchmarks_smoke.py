"""Each benchmark runs in its --smoke mode, so that it cannot rot (no timing is asserted)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_scalecom_options_smoke(tmp_path):
    out = tmp_path / "options.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scalecom_options", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert "| dense | 2 |" in text and "| ScaleCom, defaults" in text
    assert "| 70,000 | 700 |" in text  # the selection table


def test_frontends_smoke(tmp_path):
    out = tmp_path / "frontends.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.frontends", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    assert "| pytorch | scalecom |" in text and "| tensorflow | scalecom |" in text
    rows = json.loads((tmp_path / "frontends.json").read_text())["rows"]
    assert {r["framework"] for r in rows} == {"pytorch", "tensorflow"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["reduction"] > 10 for r in rows)


def test_tf_index_exchange_smoke(tmp_path):
    out = tmp_path / "tf_index_exchange.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.tf_index_exchange", "--smoke", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert len(row) == 1 and row[0].count("%") == 2
