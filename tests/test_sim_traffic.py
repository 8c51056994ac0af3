"""Byte accounting of every simulated scheme, asserted to the byte, and how it scales with n.

Model: w (6 x 5 = 30 entries, compressed), b (4 entries, below min_numel: dense), fp32 gradients,
ratio 0.2 so k = 6 on w. Ring allreduce: 2 (n - 1) / n * B sent per worker; broadcast: a chain, every
worker but the last forwards B; allgather: (n - 1) * B; exchange: B per round.
"""

import math

import numpy as np
import pytest
import torch

from hvd_scalecom import traffic
from hvd_scalecom.sim import (
    FP16,
    Dense,
    GlobalTopK,
    GTopK,
    LocalTopK,
    PowerSGD,
    QsparseLocalSGD,
    RandomK,
    ScaleCom,
    Simulator,
    SketchedSGD,
)
from hvd_scalecom.traffic import Collective

SHAPES = {"w": (6, 5), "b": (4,)}
MIN_NUMEL = 10


def run(scheme, n=4, steps=2, seed=0):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sim = Simulator(scheme, n, params)
    g = torch.Generator().manual_seed(seed)
    results = [sim.step_stacked([torch.randn(n, *s, generator=g) for s in SHAPES.values()])
               for _ in range(steps)]
    return sim, results


def figures(record):
    d = record.as_dict()
    return {k: d[k] for k in ("index_bytes", "value_bytes", "dense_bytes", "sent_index_bytes",
                              "sent_value_bytes", "sent_dense_bytes", "sent_bytes", "uncompressed_bytes")}


def test_collective_formulas_are_those_of_hvd_scalecom_traffic():
    for n in (1, 2, 3, 8, 64):
        ar = Collective("allreduce", "value", "x", 100, "float32").sent_by_worker(n)
        assert list(ar) == [traffic.allreduce_bytes_sent(100, n)] * n
        ag = Collective("allgather", "index", "x", 100, "int32").sent_by_worker(n)
        assert list(ag) == [traffic.allgather_bytes_sent(100, n)] * n
        bc = Collective("broadcast", "index", "x", 100, "int32", root=n // 2).sent_by_worker(n)
        assert bc.mean() == pytest.approx(traffic.broadcast_bytes_sent(100, n))
        if n > 1:  # a chain from the root: the root's predecessor is last and forwards nothing
            assert bc[(n // 2 - 1) % n] == 0 and bc[n // 2] == 100 and sorted(bc)[1:] == [100.0] * (n - 1)
        ex = Collective("exchange", "value", "x", 100, "float32", rounds=3).sent_by_worker(n)
        assert list(ex) == [300.0 if n > 1 else 0.0] * n


def test_dense_and_fp16():
    _, (r, _) = run(Dense())
    assert figures(r.traffic) == {"index_bytes": 0, "value_bytes": 0, "dense_bytes": 136,
                                  "sent_index_bytes": 0, "sent_value_bytes": 0, "sent_dense_bytes": 204,
                                  "sent_bytes": 204, "uncompressed_bytes": 136}
    assert r.traffic.ratio == 1.0
    _, (r, _) = run(FP16())
    assert figures(r.traffic)["dense_bytes"] == 68 and r.traffic.sent_bytes() == 102
    assert {c.dtype for c in r.traffic.collectives} == {"float16"}
    assert r.traffic.ratio == 2.0


@pytest.mark.parametrize("index_dtype, value_dtype, index_bytes, value_bytes", [
    ("int32", None, 24, 24), ("int64", None, 48, 24), ("int32", "float16", 24, 12)])
def test_scalecom(index_dtype, value_dtype, index_bytes, value_bytes):
    sim, results = run(ScaleCom(ratio=0.2, beta=0.5, warmup_steps=1, min_numel=MIN_NUMEL,
                                index_dtype=index_dtype, value_dtype=value_dtype), steps=3)
    warm, first, second = (r.traffic for r in results)
    assert figures(warm)["dense_bytes"] == 136 and warm.payload("index") == 0   # warm-up: dense
    assert figures(first) == {
        "index_bytes": index_bytes, "value_bytes": value_bytes, "dense_bytes": 16,
        "sent_index_bytes": 0.75 * index_bytes, "sent_value_bytes": 1.5 * value_bytes,
        "sent_dense_bytes": 24, "sent_bytes": 0.75 * index_bytes + 1.5 * value_bytes + 24,
        "uncompressed_bytes": 136}
    # Per worker: the leader of step t is t mod 4; the chain's last worker, t - 1, forwards nothing.
    expected = np.full(4, float(index_bytes))
    expected[(1 - 1) % 4] = 0.0
    np.testing.assert_array_equal(first.sent_by_worker("index"), expected)
    expected = np.full(4, float(index_bytes))
    expected[(2 - 1) % 4] = 0.0
    np.testing.assert_array_equal(second.sent_by_worker("index"), expected)
    # The payload split is the Horovod compressor's stats() fields.
    st = first.step_traffic()
    assert (st.index_bytes, st.value_bytes, st.dense_bytes, st.uncompressed_bytes, st.tensors) == \
        (index_bytes, value_bytes, 16, 136, 2)
    totals = sim.totals()
    assert totals["steps"] == 3
    assert totals["sent_bytes"] == pytest.approx(204 + 2 * (0.75 * index_bytes + 1.5 * value_bytes + 24))
    assert totals["ratio"] == pytest.approx(3 * 204 / totals["sent_bytes"])


def test_top_k_baselines_and_random_k():
    _, (r, _) = run(LocalTopK(ratio=0.2, min_numel=MIN_NUMEL))
    assert figures(r.traffic) == {"index_bytes": 24, "value_bytes": 24, "dense_bytes": 16,
                                  "sent_index_bytes": 72, "sent_value_bytes": 72, "sent_dense_bytes": 24,
                                  "sent_bytes": 168, "uncompressed_bytes": 136}
    _, (r, _) = run(GlobalTopK(ratio=0.2, min_numel=MIN_NUMEL))             # realised: allreduce of p
    assert figures(r.traffic)["value_bytes"] == 120 and r.traffic.sent_bytes() == 180 + 24
    _, results = run(GlobalTopK(ratio=0.2, min_numel=MIN_NUMEL, traffic="clt-k"))
    assert (results[0].traffic.payload("index"), results[0].traffic.payload("value")) == (24, 24)
    # broadcast from ScaleCom's cyclic leader, so the bytes per worker split as ScaleCom's (root 0 took
    # every step, and worker 3, the chain's last, never sent an index)
    assert [[c.root for c in r.traffic.collectives if c.op == "broadcast"] for r in results] == [[0], [1]]
    _, scalecom = run(ScaleCom(ratio=0.2, beta=1.0, min_numel=MIN_NUMEL))
    assert [list(r.traffic.sent_by_worker()) for r in results] == [list(r.traffic.sent_by_worker()) for r in scalecom]
    _, (r, _) = run(GTopK(ratio=0.2, min_numel=MIN_NUMEL))                  # log2 4 = 2 rounds
    assert figures(r.traffic) == {"index_bytes": 48, "value_bytes": 48, "dense_bytes": 16,
                                  "sent_index_bytes": 48, "sent_value_bytes": 48, "sent_dense_bytes": 24,
                                  "sent_bytes": 120, "uncompressed_bytes": 136}
    _, (r, _) = run(RandomK(ratio=0.2, min_numel=MIN_NUMEL))                 # no indices travel
    assert figures(r.traffic) == {"index_bytes": 0, "value_bytes": 24, "dense_bytes": 16,
                                  "sent_index_bytes": 0, "sent_value_bytes": 36, "sent_dense_bytes": 24,
                                  "sent_bytes": 60, "uncompressed_bytes": 136}


def test_sketched_sgd_and_powersgd():
    # k = ceil(0.1 * 30) = 3; sketch 3 x 16 fp32 = 192 bytes; 2k = 6 candidates = 24 bytes.
    _, (r, _) = run(SketchedSGD(ratio=0.1, rows=3, columns=16, candidates=2, min_numel=MIN_NUMEL))
    assert figures(r.traffic) == {"index_bytes": 0, "value_bytes": 216, "dense_bytes": 16,
                                  "sent_index_bytes": 0, "sent_value_bytes": 324, "sent_dense_bytes": 24,
                                  "sent_bytes": 348, "uncompressed_bytes": 136}
    # Rank 2: P is 6 x 2, Q is 5 x 2, fp32: 48 + 40 bytes in two allreduces.
    _, (r, _) = run(PowerSGD(rank=2, min_numel=MIN_NUMEL))
    assert [c.nbytes for c in r.traffic.collectives if c.carries == "value"] == [48, 40]
    assert figures(r.traffic)["sent_bytes"] == 1.5 * 88 + 24


@pytest.mark.parametrize("operator, value_bits", [("top_k", 6 * 32), ("sign_top_k", 6 + 32),
                                                  ("qsgd_top_k", 6 * (1 + 3) + 32)])
def test_qsparse_bits(operator, value_bits):
    """Per sync and worker: 6 indices of ceil(log2 30) = 5 bits, values as the operator needs them,
    b (4 fp32 entries) averaged densely; nothing between synchronisations."""
    _, results = run(QsparseLocalSGD(lr=0.1, local_steps=2, ratio=0.2, operator=operator, levels=4,
                                     min_numel=MIN_NUMEL), steps=4)
    for t, r in enumerate(results):
        assert r.traffic.uncompressed_bytes == 136
        if t % 2 == 0:
            assert r.traffic.collectives == [] and r.traffic.sent_bytes() == 0
            continue
        assert r.traffic.payload("index") == 30 / 8
        assert r.traffic.payload("value") == value_bits / 8
        assert r.traffic.sent_bytes("index") == 3 * 30 / 8                    # allgather: (n - 1) B
        assert r.traffic.sent_bytes("value") == 3 * value_bits / 8
        assert r.traffic.sent_bytes("dense") == 24


N_SWEEP = (2, 4, 8, 16, 32, 64)


def sweep(make):
    return {n: run(make(), n=n, steps=1)[1][0].traffic for n in N_SWEEP}


def test_scalecom_bytes_per_worker_do_not_grow_with_n_local_top_k_grows_linearly():
    k = 6
    scalecom = sweep(lambda: ScaleCom(ratio=0.2, min_numel=MIN_NUMEL))
    local = sweep(lambda: LocalTopK(ratio=0.2, min_numel=MIN_NUMEL))
    gtopk = sweep(lambda: GTopK(ratio=0.2, min_numel=MIN_NUMEL))
    dense = sweep(Dense)
    for n in N_SWEEP:
        # ScaleCom: the same payload at every n, and bytes sent below 4k + 8k (index + 2 x values).
        assert (scalecom[n].payload("index"), scalecom[n].payload("value")) == (4 * k, 4 * k)
        sent = scalecom[n].sent_bytes("index") + scalecom[n].sent_bytes("value")
        assert sent == pytest.approx((n - 1) / n * 3 * 4 * k) and sent < 12 * k
        # Local top-k: allgather, linear in n.
        assert local[n].sent_bytes("index") + local[n].sent_bytes("value") == (n - 1) * 8 * k
        # gTop-k: log2 n rounds of k pairs.
        assert gtopk[n].sent_bytes("index") + gtopk[n].sent_bytes("value") == math.log2(n) * 8 * k
        assert dense[n].sent_bytes() == pytest.approx(2 * (n - 1) / n * 136)
    assert local[64].sent_bytes("value") / local[2].sent_bytes("value") == 63
    assert scalecom[64].sent_bytes("value") / scalecom[2].sent_bytes("value") == pytest.approx(2 * 63 / 64)


def test_sketch_and_powersgd_traffic_do_not_grow_with_n():
    sketched = sweep(lambda: SketchedSGD(ratio=0.1, rows=3, columns=16, min_numel=MIN_NUMEL))
    power = sweep(lambda: PowerSGD(rank=2, min_numel=MIN_NUMEL))
    for n in N_SWEEP:
        assert sketched[n].payload() == 216 + 16 and power[n].payload() == 88 + 16
        assert sketched[n].sent_bytes() < 2 * sketched[n].payload()
