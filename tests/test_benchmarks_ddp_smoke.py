"""The slow-link benchmark's DDP jobs (torchrun in the shaped namespace) in its --smoke mode."""

import re

import pytest

from benchmark_smoke import run_smoke


def test_slow_link_ddp_jobs_smoke(tmp_path):
    out = tmp_path / "performance.md"
    stdout = run_smoke("benchmarks.slow_link", out, timeout=600,
                       extra=("--jobs", "ddp_dense", "ddp_fp16", 'ddp_powersgd:{"ratio": 0.01}',
                              'ddp_scalecom:{"ratio": 0.01}'))
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    rows = {line.split("|")[3].strip(): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| 1gbit | 2 |")}
    # smoke model 256-256-10: PowerSGD rank 2 hands over the payload closest to ScaleCom 0.01's
    assert set(rows) == {"DDP dense", "DDP fp16 hook", "DDP PowerSGD rank 2", "DDP ScaleCom 0.01"}, rows
    payload = {name: float(row[11]) for name, row in rows.items()}  # MB/step/worker handed over
    dense = 4 * (256 * 256 + 256 + 256 * 10 + 10) / 1e6
    assert payload["DDP dense"] == pytest.approx(dense, abs=1e-3)
    assert payload["DDP fp16 hook"] == pytest.approx(dense / 2, abs=1e-3)
    assert payload["DDP ScaleCom 0.01"] == pytest.approx(0.007, abs=1e-3)  # 6,520 bytes (counted in the calls)
    for row in rows.values():
        assert float(row[9]) > 0 and re.fullmatch(r"[0-9.]+x", row[6].strip())  # wire bytes; speed-up vs DDP dense


@pytest.mark.parametrize("job, message", [
    ('ddp_scalecom:{"ratoi": 0.01}', "unexpected keyword argument 'ratoi'"),
    ('ddp_fp16:{"ratio": 0.1}', "ddp_fp16 takes no options"),
    ('ddp_powersgd:{"ratio": 0}', "ratio must be a number in"),
])
def test_a_bad_ddp_job_is_refused_naming_it_before_anything_runs(job, message, capsys):
    from benchmarks import slow_link
    with pytest.raises(SystemExit):
        slow_link.main(["--smoke", "--jobs", job])
    assert message in capsys.readouterr().err


def test_powersgd_rank_is_the_one_closest_to_scalecom_payload():
    from benchmarks._slow_link_ddp_worker import make_model, powersgd_payload, powersgd_rank, scalecom_payload
    model = make_model([1024, 2048, 2048, 1024, 10])  # the benchmark's default MLP
    assert powersgd_rank(model, 0.01) == 15
    assert scalecom_payload(model, 0.01) == 672_392
    assert [powersgd_payload(model, r) for r in (14, 15, 16)] == [634_920, 675_880, 716_840]
