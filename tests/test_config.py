"""k from the ratio: ``max(1, ceil(ratio * numel))`` taken exactly, one rule for every scheme."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.sim import ScaleCom as SimScaleCom
from hvd_scalecom.sim import Simulator
from hvd_scalecom.sketched_qsparse_config import QsparseConfig, SketchedSGDConfig


def exact_k(ratio_text, numel):
    """The ceiling of the decimal ``ratio_text`` times ``numel``, in integers."""
    ratio = Fraction(ratio_text)
    return min(numel, max(1, -(-numel * ratio.numerator // ratio.denominator)))


@pytest.mark.parametrize("ratio_text", ["0.07", "0.14", "0.01", "0.001", "0.3", "1e-05", "0.5", "1.0"])
def test_k_is_the_ceiling_of_the_decimal_ratio(ratio_text):
    config = ScaleComConfig(ratio=float(ratio_text))
    numels = list(range(1, 3001)) + [2 ** 20, 25_000_000, 2 ** 31 + 7]
    assert [config.num_selected(n) for n in numels] == [exact_k(ratio_text, n) for n in numels]


def test_float_products_just_above_an_integer_do_not_round_k_up():
    assert 0.07 * 100 > 7  # the product in floating point: its ceiling would be 8
    assert ScaleComConfig(ratio=0.07).num_selected(100) == 7
    assert ScaleComConfig(ratio=0.14).num_selected(50) == 7
    assert QsparseConfig(ratio=0.07).num_selected(100) == 7
    assert QsparseConfig(ratio=0.07, max_k=5).num_selected(100) == 5
    assert SketchedSGDConfig(ratio=0.07).num_selected([100, 200]) == 7 + 14


def test_simulated_scalecom_sends_k_values_of_the_exact_rule():
    """The simulator's ScaleCom on a 10 x 10 tensor at ratio 0.07 sends 7 values per worker."""
    params = [("w", torch.nn.Parameter(torch.zeros(10, 10)))]
    sim = Simulator(SimScaleCom(ratio=0.07, beta=1.0, min_numel=1), 2, params)
    grads = [[torch.from_numpy(np.random.RandomState(i).randn(10, 10).astype(np.float32))] for i in range(2)]
    update = sim.step(grads).update[0]
    assert int(torch.count_nonzero(update)) == 7


def test_a_count_sketch_of_2_31_columns_or_more_is_refused_by_the_configuration():
    """Before any state exists (the hashes need fewer columns): given, or 10 k by default."""
    assert SketchedSGDConfig(ratio=0.5).num_columns(214_748_364) == 2_147_483_640
    with pytest.raises(ValueError, match="10 k = 2147483650 columns"):
        SketchedSGDConfig(ratio=0.5).num_columns(214_748_365)
    with pytest.raises(ValueError, match="columns must be below 2"):
        SketchedSGDConfig(columns=2**31)


def test_numpy_scalars_count_as_the_decimals_they_print_as():
    """np.float32(0.07) prints as 0.07: k and the configuration are those of 0.07 (ranks that build
    their ratio with NumPy agree with those that do not)."""
    for ratio, k in ((np.float32(0.07), 7), (np.float32(0.1), 10), (np.float16(0.25), 25)):
        assert ScaleComConfig(ratio=ratio).num_selected(100) == k
        assert ScaleComConfig(ratio=ratio) == ScaleComConfig(ratio=float(str(ratio)))
    assert ScaleComConfig(beta=np.float32(0.1)).beta == 0.1


def test_dtypes_are_taken_by_name_or_as_framework_dtypes_alike():
    """As the Horovod compressors take them (torch.float16, torch.int32): the simulator's schemes too."""
    from hvd_scalecom.sim import GlobalTopK, LocalTopK

    named = ScaleComConfig(value_dtype="float16", index_dtype="int64")
    assert ScaleComConfig(value_dtype=torch.float16, index_dtype=torch.int64) == named
    for scheme in (SimScaleCom, LocalTopK, GlobalTopK):
        config = scheme(value_dtype=torch.float16, index_dtype=torch.int64).config
        assert (config.value_dtype, config.index_dtype) == ("float16", "int64")
    for kwargs, argument in (({"value_dtype": torch.int8}, "value_dtype"),
                             ({"index_dtype": torch.float32}, "index_dtype"),
                             ({"index_dtype": None}, "index_dtype")):
        with pytest.raises(ValueError, match=f"{argument} must be one of"):
            ScaleComConfig(**kwargs)
