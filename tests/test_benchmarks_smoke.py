"""Each benchmark runs in its --smoke mode, so that it cannot rot (no timing is asserted)."""

import json

import pytest
from benchmark_smoke import run_smoke


def test_scalecom_options_smoke(tmp_path):
    out = tmp_path / "options.md"
    run_smoke("benchmarks.scalecom_options", out, timeout=300)
    text = out.read_text()
    assert "| dense | 2 |" in text and "| ScaleCom, defaults" in text
    assert "| 70,000 | 700 |" in text  # the selection table
    assert "AVX-512, one thread" in text  # the machine's CPU


def test_frontends_smoke(tmp_path):
    out = tmp_path / "frontends.md"
    run_smoke("benchmarks.frontends", out, timeout=600)
    text = out.read_text()
    assert "| pytorch | scalecom |" in text and "| tensorflow | scalecom |" in text
    rows = json.loads((tmp_path / "frontends.json").read_text())["rows"]
    assert {r["framework"] for r in rows} == {"pytorch", "tensorflow"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["reduction"] > 10 for r in rows)


def test_tf_index_exchange_smoke(tmp_path):
    out = tmp_path / "tf_index_exchange.md"
    run_smoke("benchmarks.tf_index_exchange", out, timeout=600)
    row = [line for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert len(row) == 1
    cells = [c.strip() for c in row[0].strip("|").split("|")]
    broadcast, allreduce, allgather = float(cells[1]), float(cells[2]), float(cells[3])
    ratios = float(cells[4].rstrip("x")), float(cells[5].rstrip("x"))
    assert broadcast > 0 and allreduce > 0 and allgather > 0
    assert ratios == (pytest.approx(allreduce / broadcast, abs=0.006), pytest.approx(allgather / broadcast, abs=0.006))
    accuracies = [float(a.rstrip("%")) for a in cells[7].split(", ")]
    assert len(accuracies) == 3 and min(accuracies) > 10  # all trained (chance: 10%)
    assert len(set(accuracies)) == 1  # the same update


def test_smoke_sets_only_what_is_not_given(tmp_path, monkeypatch):
    """--smoke's small settings fill in what the command line leaves out; an option given with it is
    not ignored (--smoke --workers 3 ran 2 workers, --smoke --dense no dense job). Jobs stubbed."""
    from benchmarks import frontends, tf_index_exchange

    jobs = []
    monkeypatch.setattr(tf_index_exchange, "job", lambda workers, mode, epochs: jobs.append((workers, epochs))
                        or {"seconds": 1.0, "accuracy": 0.5})
    tf_index_exchange.main(["--smoke", "--workers", "3", "--epochs", "2", "--out", str(tmp_path / "t.md")])
    assert jobs == [(3, 2)] * 3  # one repeat of the three exchanges
    runs = []
    monkeypatch.setattr(frontends, "run_example", lambda framework, compression, seed, epochs: runs.append(
        (compression, seed, epochs)) or {"accuracy": 0.5, "reduction": 40.0, "compression": compression})
    frontends.main(["--smoke", "--seeds", "7", "--dense", "--out", str(tmp_path / "f.md")])
    assert sorted(runs) == [("dense", 7, 1)] * 2 + [("scalecom", 7, 1)] * 2
