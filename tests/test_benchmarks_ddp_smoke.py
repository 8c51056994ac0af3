"""The slow-link benchmark's DDP jobs in its --smoke mode: on per-worker links (each rank in its own
worker namespace, torch.distributed's env:// variables) and on the shared loopback (torchrun).

The network tests need root and ``ip netns``; where they are missing they skip."""

import time

import pytest
from benchmark_smoke import run_smoke

from benchmarks import models

DDP_JOBS = ("ddp_dense", "ddp_fp16", 'ddp_powersgd:{"ratio": 0.01}', 'ddp_scalecom:{"ratio": 0.01}')


def _rows(text):
    """``{scheme: {column: cell}}`` of the smoke run's one table (1gbit, 2 workers)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]
            if line.startswith("| 1gbit | 2 |")]
    return {r["scheme"]: r for r in rows}


def _tiny_payloads():
    """Bytes per step each job hands over on the smoke model (MLP 256-256-10), from the worker's
    payload formulas (checked by hand in the next test)."""
    from benchmarks._slow_link_ddp_worker import powersgd_payload, scalecom_payload
    model = models.build_model("mlp", "tiny")
    dense = 4 * sum(p.numel() for p in model.parameters())
    return {"DDP dense": dense, "DDP fp16 hook": dense // 2, "DDP ScaleCom 0.01": scalecom_payload(model, 0.01),
            "DDP PowerSGD rank 2": powersgd_payload(model, 2)}


def test_tiny_payloads_from_the_shapes():
    """The smoke test's references by hand (256x256 and 10x256 weights, 256 and 10 biases): DDP dense
    the fp32 gradients; ScaleCom 0.01 ceil(0.01 n) int32 indices and fp32 values of each weight, the
    biases (under min_numel 1024) dense; PowerSGD rank 2 its P (n x 2) and Q (m x 2) of each weight,
    the biases dense."""
    payloads = _tiny_payloads()
    assert payloads["DDP dense"] == 4 * (65536 + 256 + 2560 + 10) == 273_448
    assert payloads["DDP ScaleCom 0.01"] == 8 * (656 + 26) + 4 * (256 + 10) == 6_520
    assert payloads["DDP PowerSGD rank 2"] == 4 * ((256 + 256) * 2 + 256 + (10 + 256) * 2 + 10) == 7_288


@pytest.mark.parametrize("link, jobs", [("per-worker", DDP_JOBS),
                                        ("shared-loopback", ("ddp_dense", 'ddp_scalecom:{"ratio": 0.01}'))])
def test_slow_link_ddp_jobs_smoke(tmp_path, link, jobs):
    """DDP dense, torch's fp16 and PowerSGD hooks and the ScaleCom hook (on the shared loopback, under
    torchrun: dense and ScaleCom), 2 workers at 1 Gbit/s, two warm-up steps (PowerSGD compresses from
    its third step): each job's payload is the one its shapes give, and its bytes crossed the link(s);
    on per-worker links each worker's own link carried them (dense: about one payload sent and one
    received, a ring of 2)."""
    out = tmp_path / "performance.md"
    started = time.perf_counter()
    stdout = run_smoke("benchmarks.slow_link", out, timeout=600,
                       extra=("--link", link, "--warmup", "2", "--jobs", *jobs))
    took = time.perf_counter() - started
    if "slow_link: skipped:" in stdout:
        pytest.skip(stdout.strip().splitlines()[-1])
    text = out.read_text()
    assert "Rows named DDP" in text
    rows = _rows(text)
    payloads = _tiny_payloads()
    if link != "per-worker":
        payloads = {k: v for k, v in payloads.items() if k in ("DDP dense", "DDP ScaleCom 0.01")}
    # (PowerSGD rank 2 hands over the payload closest to ScaleCom 0.01's on this model)
    assert set(rows) == set(payloads), rows
    for name, row in rows.items():
        assert float(row["payload MB/step/worker"]) == pytest.approx(payloads[name] / 1e6, abs=1e-3), row
        assert float(row["MB/step/worker (wire)"]) >= 0.9 * payloads[name] / 1e6, row  # (headers on top)
        assert row["speed-up over dense"].endswith("x"), row  # against DDP dense
    dense = payloads["DDP dense"] / 1e6
    assert float(rows["DDP dense"]["MB/step/worker (wire)"]) <= 1.5 * dense
    assert float(rows["DDP ScaleCom 0.01"]["wire bytes vs dense"]) < 0.2
    if link == "per-worker":
        assert "one shaped link per worker" in text and "env://" in text
        for name, row in rows.items():
            each = [tuple(float(v) for v in w.split("/")) for w in row["each worker sent/received MB/step"].split(", ")]
            assert len(each) == 2 and all(sent > 0 and received > 0 for sent, received in each), row
            if name == "DDP dense":
                assert all(0.9 * dense <= v <= 1.5 * dense for w in each for v in w), each
            assert float(row["MB/step/worker (wire)"]) == pytest.approx(sum(s for s, _ in each) / 2, abs=2e-3)
    else:
        assert "one shaped loopback shared by all workers" in text and "under torchrun" in text
    print(f"DDP slow-link smoke ({link}): {took:.1f} s")


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


def test_ddp_jobs_are_refused_on_the_tensorflow_frontend(capsys):
    from benchmarks import slow_link
    with pytest.raises(SystemExit):
        slow_link.main(["--smoke", "--framework", "tensorflow", "--jobs", "ddp_dense"])
    assert "the TensorFlow worker runs dense, fp16, scalecom only" in capsys.readouterr().err


def test_powersgd_rank_is_the_one_closest_to_scalecom_payload():
    from benchmarks._slow_link_ddp_worker import powersgd_payload, powersgd_rank, scalecom_payload
    model = models.build_model("mlp", "full")  # the benchmark's default MLP
    assert powersgd_rank(model, 0.01) == 15
    assert scalecom_payload(model, 0.01) == 672_392
    assert [powersgd_payload(model, r) for r in (14, 15, 16)] == [634_920, 675_880, 716_840]
