"""The health check's schedule, decisions and measures (hvd_scalecom.health, hvd_scalecom.torch.health)."""

import warnings

import numpy as np
import pytest
import torch

from hvd_scalecom.health import HealthCheck, HealthMonitor, Measures
from hvd_scalecom.torch.health import measure, ordered_sum


def test_check_steps_start_at_the_first_compressed_step():
    health = HealthCheck(check_every=3)
    assert [t for t in range(5, 15) if health.is_check_step(t, warmup_steps=5)] == [5, 8, 11, 14]
    assert not HealthCheck().enabled and not HealthCheck().is_check_step(0, 0)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"check_every": 0}, ValueError, "check_every"),
    ({"check_every": 2.0}, TypeError, "check_every"),
    ({"check_every": True}, TypeError, "check_every"),
    ({"fallback": "sparse", "check_every": 2}, ValueError, "fallback"),
    ({"fallback": "dense"}, ValueError, "check_every"),
    ({"check_every": 2, "min_captured": 1.5}, ValueError, "min_captured"),
    ({"check_every": 2, "min_captured": float("nan")}, ValueError, "min_captured"),
    ({"check_every": 2, "patience": 0}, ValueError, "patience"),
])
def test_bad_options_name_the_argument(kwargs, error, words):
    with pytest.raises(error, match=words):
        HealthCheck(**kwargs)


def _m(captured, k=10):
    """Measures whose captured share is ``captured`` (hits = round(captured * k))."""
    return Measures(hits=round(captured * k), k=k, selected=captured * 4.0, topk=4.0, total=8.0)


def test_fallback_after_patience_low_checks_and_back_after_patience_good_ones():
    monitor = HealthMonitor(HealthCheck(check_every=1, fallback="dense", min_captured=0.5, patience=2),
                            ["a", "b"], warn=False)
    changes = [monitor.record("a", t, _m(c)) for t, c in enumerate([0.4, 0.6, 0.4, 0.3, 0.2, 0.7, 0.4, 0.8, 0.9])]
    # low, good (resets), low, low -> dense; low, good, low (resets), good, good -> back
    assert changes == [False, False, False, True, False, False, False, False, True]
    assert not monitor.sends_dense("a") and not monitor.sends_dense("b")
    summary = monitor.summary()
    assert summary["checks"] == 9 and summary["by_tensor"]["a"]["captured"] == pytest.approx(0.9)
    assert "b" not in summary["by_tensor"]


def test_without_fallback_a_low_tensor_warns_once_and_stays_compressed():
    monitor = HealthMonitor(HealthCheck(check_every=5, patience=2), ["w"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(6):
            monitor.record("w", 5 * t, _m(0.1))
    assert len(caught) == 1 and "'w'" in str(caught[0].message) and "fallback='dense'" in str(caught[0].message)
    assert not monitor.sends_dense("w")


def test_a_nonfinite_check_decides_nothing():
    monitor = HealthMonitor(HealthCheck(check_every=1, fallback="dense", patience=1), ["w"], warn=False)
    assert not monitor.record("w", 0, Measures(1, 10, float("nan"), 1.0, 2.0))
    assert monitor.summary()["checks"] == 0 and not monitor.sends_dense("w")


def test_summary_weights_overlap_by_k_and_sums_energies():
    monitor = HealthMonitor(HealthCheck(check_every=1), ["a", "b"], warn=False)
    monitor.record("a", 0, Measures(hits=1, k=2, selected=1.0, topk=2.0, total=4.0))
    monitor.record("b", 0, Measures(hits=6, k=8, selected=3.0, topk=6.0, total=12.0))
    s = monitor.summary()
    assert s["overlap"] == pytest.approx(7 / 10) and s["captured"] == pytest.approx(4 / 8)
    assert s["selected_share"] == pytest.approx(4 / 16) and s["topk_share"] == pytest.approx(8 / 16)


def test_state_round_trip_and_bad_state_changes_nothing():
    health = HealthCheck(check_every=1, fallback="dense", patience=1)
    monitor = HealthMonitor(health, ["w"], warn=False)
    monitor.record("w", 3, _m(0.1))
    saved = monitor.state_dict()
    other = HealthMonitor(health, ["w"], warn=False)
    other.load_state_dict(saved)
    assert other.sends_dense("w") and other.summary() == monitor.summary()
    bad = {"w": {**saved["w"], "dense": "yes"}}
    with pytest.raises(ValueError, match="'w'"):
        other.load_state_dict(bad)
    with pytest.raises(ValueError, match="entry for each"):
        other.load_state_dict({})
    assert other.summary() == monitor.summary()


def test_measure_against_numpy():
    rng = np.random.default_rng(0)
    P = rng.standard_normal(1000).astype(np.float32)
    indices = rng.choice(1000, 30, replace=False)
    m = measure(torch.from_numpy(P), torch.from_numpy(indices).to(torch.int32), 30)
    squares = P.astype(np.float64) ** 2
    top = np.argsort(-np.abs(P))[:30]
    assert m.hits == len(set(top) & set(indices)) and m.k == 30
    assert m.selected == pytest.approx(squares[indices].sum(), rel=1e-12)
    assert m.topk == pytest.approx(squares[top].sum(), rel=1e-12)
    assert m.total == pytest.approx(squares.sum(), rel=1e-12)
    # the leader's own top-k is the global one: everything captured
    assert measure(torch.from_numpy(P), torch.from_numpy(top), 30).captured == 1.0


def test_ordered_sum_is_the_same_in_any_order():
    rng = np.random.default_rng(1)  # squares over 12 orders of magnitude: any other order rounds differently
    values = torch.from_numpy(rng.standard_normal(4097) ** 2 * 10.0 ** rng.integers(-6, 6, 4097))
    sums = {ordered_sum(values[torch.randperm(values.numel())]) for _ in range(5)}
    plain = {float(values[torch.randperm(values.numel())].cumsum(0)[-1]) for _ in range(5)}
    assert len(sums) == 1 and len(plain) > 1 and sums.pop() == pytest.approx(float(values.sum()), rel=1e-12)
