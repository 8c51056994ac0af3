"""The performance benchmarks in their --smoke mode, so that they cannot rot (no timing is asserted).

The slow-link benchmark needs root and ``ip netns``; where they are missing it reports that it
skipped, and so does its test.
"""

import pytest

from benchmark_smoke import run_smoke


def test_kernels_smoke(tmp_path):
    out = tmp_path / "performance.md"
    run_smoke("benchmarks.kernels", out, timeout=300, extra=("--plot", str(tmp_path / "kernels.png")))
    text = out.read_text()
    assert "<!-- kernels:begin -->" in text and "## Kernels" in text
    assert "![compress + decompress against the floor](kernels.png)" in text
    assert (tmp_path / "kernels.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 100,000 | 0.01 | default |" in text and "| 100,000 | 0.001 | default |" in text
    # 2^19 entries: the non-leader trades buffers, and its C passes alone are timed
    lines = text.splitlines()
    header = next(line for line in lines if "| non-leader, C passes alone |" in line).split("|")
    row = next(line for line in lines if line.startswith("| 524,288 | 0.01 | default |")).split("|")
    assert len(row) == len(header) and row[header.index(" non-leader, C passes alone ")].strip().endswith("x)")
    assert "| 1.0000 |" in text  # the threshold selection finds the exact top-k set


def test_slow_link_smoke(tmp_path):
    out = tmp_path / "performance.md"
    out.write_text("# Performance\n\nkept\n")
    stdout = run_smoke("benchmarks.slow_link", out, timeout=600)
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    text = out.read_text()
    assert "kept" in text and "<!-- slow_link:begin -->" in text
    assert "| 1gbit | 2 | ScaleCom 0.01 |" in text


def test_sketch_kernels_smoke(tmp_path):
    out = tmp_path / "performance.md"
    run_smoke("benchmarks.sketch_kernels", out, timeout=300)
    text = out.read_text()
    assert "<!-- sketch:begin -->" in text and "## Count sketch" in text
    assert "| C kernels |" in text and "| torch operations |" in text
