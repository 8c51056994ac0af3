"""The count sketch's C kernels (``hsc_sketch``, ``hsc_estimate`` of hvd_scalecom.native) against the
torch operations of CountSketch: the same floats, bit for bit (signed zeros and NaN payloads
included), for any length (vector bodies and tails), row count (odd and even), batch and column
count (many collisions or many empty cells); and the same again from the build without AVX-512."""

import os

import pytest
import torch
from scalar_kernels import SCALAR_BUILD, rerun_with_scalar_kernels

from hvd_scalecom import native
from hvd_scalecom.torch import sketch as sketch_module
from hvd_scalecom.torch.sketch import CountSketch


def bits(t):
    """The bit patterns: torch.equal on them compares -0.0 with 0.0 and NaN payloads too."""
    return t.contiguous().view(torch.int32)


def assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    mismatched = int((bits(got) != bits(want)).sum())
    assert mismatched == 0, f"{mismatched} of {got.numel()} entries differ"


def kernels_and_torch(fn):
    """``fn()`` with the C kernels, then with torch operations."""
    assert native.library() is not None
    got = fn()
    with native.torch_operations():
        want = fn()
    return got, want


def spread(shape, seed):
    """Values over eight orders of magnitude: every order of summation gives its own floats."""
    gen = torch.Generator().manual_seed(seed)
    scale = 10.0 ** (8 * torch.rand(shape, generator=gen) - 4)
    return (torch.randn(shape, generator=gen) * scale).float()


def test_the_kernels_apply_to_contiguous_fp32_cpu_tensors():
    lib = native.library()
    assert lib is not None
    with open("/proc/cpuinfo") as f:
        avx512 = " avx512f " in f.read()
    assert lib.hsc_sketch_lanes() == (1 if os.environ.get(SCALAR_BUILD) or not avx512 else 16)
    assert sketch_module._native_library(torch.zeros(4)) is lib
    assert sketch_module._native_library(torch.zeros(4, dtype=torch.float64)) is None
    assert sketch_module._native_library(torch.zeros(4, 4).t()) is None
    assert sketch_module._native_library(torch.zeros(4, requires_grad=True)) is None
    with native.torch_operations():
        assert sketch_module._native_library(torch.zeros(4)) is None


@pytest.mark.parametrize("numel", [1, 15, 16, 17, 511, 513, 70_001])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("columns", [3, 37, 20_000])
def test_sketch_and_estimate_equal_the_torch_operations(numel, rows, columns):
    cs = CountSketch(numel, rows, columns, seed=numel + 7 * rows)
    for batch in (1, 3):
        v = spread((batch, numel), seed=rows)
        table, want_table = kernels_and_torch(lambda: cs.sketch(v))
        assert_same_bits(table, want_table)
        estimate, want_estimate = kernels_and_torch(lambda: cs.estimate(table))
        assert_same_bits(estimate, want_estimate)
        assert estimate.shape == (batch, numel)


def test_the_order_of_the_additions_shows_in_the_floats():
    """The data above is sensitive to the order of the additions: the reversed order gives other floats
    in most cells, so the equality of the sketches checks the order."""
    numel, rows, columns = 70_001, 3, 37
    cs = CountSketch(numel, rows, columns, seed=1)
    v = spread((1, numel), seed=2)
    buckets, signs = cs.hashes(torch.arange(numel))
    cells = (buckets + torch.arange(rows).unsqueeze(1) * columns).reshape(-1)
    signed = (v[:, None, :] * signs.float()).reshape(1, -1)
    forward = torch.zeros(1, rows * columns).index_add_(1, cells, signed)
    backward = torch.zeros(1, rows * columns).index_add_(1, cells.flip(0), signed.flip(1))
    assert_same_bits(cs.sketch(v).reshape(1, -1), forward)
    assert int((bits(forward) != bits(backward)).sum()) > rows * columns // 2


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 17])
def test_the_median_picks_torch_s_element_among_ties_and_signed_zeros(rows):
    """Tables of small integers: many equal values and zeros (s_j(x) 0.0 is -0.0 where s_j(x) = -1);
    an even row count takes the lower middle value, ties go by row (17 rows: the torch operations)."""
    numel, columns = 5_000, 11
    cs = CountSketch(numel, rows, columns, seed=rows)
    gen = torch.Generator().manual_seed(rows)
    for values in ([-2.0, -1.0, 0.0, 1.0, 2.0], [0.0, -0.0], [0.0, -0.0, 1.0]):
        choice = torch.randint(0, len(values), (2, rows, columns), generator=gen)
        table = torch.tensor(values)[choice]
        estimate, want = kernels_and_torch(lambda: cs.estimate(table))
        assert_same_bits(estimate, want)
    negative_zeros = int((bits(estimate) == bits(torch.tensor(-0.0))).sum())
    assert 0 < negative_zeros < estimate.numel()  # both zeros come out, as torch picks them


def test_non_finite_values_propagate_as_in_torch():
    numel, rows, columns = 10_000, 5, 50
    cs = CountSketch(numel, rows, columns, seed=3)
    v = spread((2, numel), seed=4)
    v[0, 17], v[0, 4000], v[1, 9999] = float("nan"), float("inf"), float("-inf")
    v[1, 5], v[1, 6] = float("inf"), float("-inf")  # inf - inf: a NaN made by the addition
    table, want = kernels_and_torch(lambda: cs.sketch(v))
    assert_same_bits(table, want)
    assert bool(table.isnan().any()) and bool(table.isinf().any())
    clean = cs.sketch(spread((1, numel), seed=5))
    for bad in (float("nan"), -float("nan"), float("inf"), -float("inf")):
        poisoned = clean.clone()
        poisoned[0, 1, 3], poisoned[0, 4, 40] = bad, -bad
        estimate, want = kernels_and_torch(lambda: cs.estimate(poisoned))
        assert_same_bits(estimate, want)
        if bad != bad:
            assert bool(estimate.isnan().any())


def test_lead_dimensions_and_non_contiguous_input():
    numel, rows, columns = 3_001, 4, 97
    cs = CountSketch(numel, rows, columns, seed=9)
    v = spread((numel, 2, 2), seed=10).permute(1, 2, 0)  # (2, 2, numel), not contiguous
    table, want = kernels_and_torch(lambda: cs.sketch(v))
    assert table.shape == (2, 2, rows, columns)
    assert_same_bits(table, want)
    estimate, want = kernels_and_torch(lambda: cs.estimate(table))
    assert estimate.shape == (2, 2, numel)
    assert_same_bits(estimate, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # (float64 never goes to the kernels)
def test_an_empty_batch_sketches_to_an_empty_table(dtype):
    cs = CountSketch(1_000, 5, 50, seed=1)
    table, want = kernels_and_torch(lambda: cs.sketch(torch.zeros(0, 1_000, dtype=dtype)))
    assert table.shape == want.shape == (0, 5, 50) and table.dtype == want.dtype == dtype


def test_a_large_sketch_with_a_few_heavy_coordinates():
    numel, rows, columns = 1_000_003, 5, 20_000
    cs = CountSketch(numel, rows, columns, seed=11)
    v = 0.01 * torch.randn(1, numel, generator=torch.Generator().manual_seed(12))
    heavy = torch.tensor([0, 12_345, numel - 1])
    v[0, heavy] = torch.tensor([30.0, -20.0, 10.0])
    table, want = kernels_and_torch(lambda: cs.sketch(v))
    assert_same_bits(table, want)
    estimate, want = kernels_and_torch(lambda: cs.estimate(table))
    assert_same_bits(estimate, want)
    assert set(torch.topk(estimate[0].abs(), 3).indices.tolist()) == set(heavy.tolist())


def test_the_kernels_decline_more_than_2_to_the_30_coordinates():
    lib = native.library()
    seeds = CountSketch(8, 2, 4).seeds
    table = torch.full((2, 4), 7.0)
    assert lib.hsc_sketch(None, 1, 2**30 + 1, seeds.data_ptr(), 2, 4, table.data_ptr()) == 1
    assert lib.hsc_estimate(table.data_ptr(), 1, 2**30 + 1, seeds.data_ptr(), 2, 4, None) == 1
    assert bool((table == 7.0).all())


def test_the_scalar_build_gives_the_same_floats(tmp_path):
    """This file again, with the kernels built without AVX-512."""
    rerun_with_scalar_kernels(__file__, tmp_path)
