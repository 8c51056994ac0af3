"""``hvd_scalecom.torch.clt_k`` against the straightforward formulas, and the ``"threshold"`` selection
against ``torch.topk`` on random and adversarial inputs (ties, all-equal, mostly zeros, a biased
sample, fp16/bf16 gradients with fp32 memory)."""

import contextlib
import math

import pytest
import torch

from hvd_scalecom import native
from hvd_scalecom.torch import clt_k


def exact_magnitudes(p, k):
    return torch.topk(p.abs().reshape(-1), k).values


def assert_is_top_k(p, k, indices):
    """``indices`` is a valid top-k of ``|p|``: k distinct entries whose magnitudes are the k largest
    (equal to torch.topk's as multisets, so any choice among ties at the k-th value passes)."""
    flat = p.reshape(-1)
    assert indices.dtype == torch.int64 and indices.dim() == 1 and indices.numel() == k
    assert torch.unique(indices).numel() == k
    assert int(indices.min()) >= 0 and int(indices.max()) < flat.numel()
    chosen = torch.sort(flat[indices].abs(), descending=True).values
    assert torch.equal(chosen, exact_magnitudes(flat, k))


def assert_same_set(p, k, indices):
    """No ties at the k-th magnitude: the very same set as torch.topk's."""
    exact = clt_k.select_top_k(p, k, "exact")
    assert_is_top_k(p, k, indices)
    assert set(indices.tolist()) == set(exact.tolist())


def overlap(a, b):
    return len(set(a.tolist()) & set(b.tolist())) / max(1, len(b))


@pytest.mark.parametrize("numel", [1024, 1500, 4096, 5003, 60_000, 65_536, 100_003, 1_048_576, 4_200_001])
@pytest.mark.parametrize("ratio", [0.01, 0.001, 0.05])
def test_threshold_is_the_exact_set_on_random_data(numel, ratio):
    gen = torch.Generator().manual_seed(numel + int(1e4 * ratio))
    g = torch.randn(numel, generator=gen)
    m = 0.3 * torch.randn(numel, generator=gen)
    p = clt_k.error_compensated(m, g)
    k = max(1, math.ceil(ratio * numel))
    assert_same_set(p, k, clt_k.select_top_k(p, k, "threshold"))


@pytest.mark.parametrize("dist", ["cauchy", "lognormal_blocks", "laplace", "all_negative", "sparse_spikes"])
def test_threshold_is_the_exact_set_on_other_distributions(dist):
    numel, k = 1_000_000, 10_000
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(numel, generator=gen)
    if dist == "cauchy":
        p = torch.tan(math.pi * (torch.rand(numel, generator=gen) - 0.5))
    elif dist == "lognormal_blocks":
        p = x * torch.exp(2 * torch.randn(numel // 1000, generator=gen)).repeat_interleave(1000)
    elif dist == "laplace":
        p = torch.log(torch.rand(numel, generator=gen)) * torch.sign(x)
    elif dist == "all_negative":
        p = -x.abs() - 1.0
    else:  # a few huge entries, the rest tiny
        p = 1e-6 * x
        p[torch.randperm(numel, generator=gen)[:3 * k]] = 1e3 * torch.rand(3 * k, generator=gen) + 1.0
    assert_same_set(p, k, clt_k.select_top_k(p, k, "threshold"))


@pytest.mark.parametrize("numel", [65_536, 100_003, 4_200_001])
def test_the_masked_candidates_of_cuda_equal_the_column_pre_filter(numel):
    """CUDA's step 2 (one mask of |p| >= t, ``_at_least_masked``) finds the candidates, magnitudes and
    order of the CPU's column pre-filter (``_at_least``), NaN and the tail past the grid included;
    its selection is an exact top-k (run here on CPU tensors: the same torch operations)."""
    gen = torch.Generator().manual_seed(numel)
    p = torch.randn(numel, generator=gen)
    p[torch.randperm(numel, generator=gen)[:50]] = float("nan")
    p[-3:] = torch.tensor([9.0, -8.0, float("inf")])
    k = numel // 100
    threshold = clt_k._sampled_threshold(p, k)
    masked, grid = clt_k._at_least_masked(p, threshold), clt_k._at_least(p, threshold)
    order = grid[0].argsort()  # (the grid gives them column by column)
    assert torch.equal(masked[0], grid[0][order]) and torch.equal(masked[1], grid[1][order])
    assert masked[0].numel() >= k and not torch.isnan(masked[1]).any()
    clean = torch.nan_to_num(p, nan=0.0)
    assert_is_top_k(clean, k, clt_k._sampled_selection(clean, k))  # (4.2M normal floats tie at the k-th)
    assert clt_k._thresholded(numel, k, False, cuda=True) == (numel >= 1 << 22)


def test_ties_all_equal_and_mostly_zeros():
    numel = 200_000
    gen = torch.Generator().manual_seed(3)
    ties = torch.randint(-5, 6, (numel,), generator=gen).float()  # 11 values: ties at the k-th one
    for k in (1, 100, 2000, 20_000):
        assert_is_top_k(ties, k, clt_k.select_top_k(ties, k, "threshold"))
    for small in (1024, 3000, 50_000):  # the C selection from 1,024 entries; its sample is all of p below 4,096
        for k in (1, small // 100, small // 16):
            assert_is_top_k(ties[:small], k, clt_k.select_top_k(ties[:small], k, "threshold"))
    equal = torch.full((numel,), -0.25)
    assert_is_top_k(equal, 2000, clt_k.select_top_k(equal, 2000, "threshold"))
    zeros = torch.zeros(numel)
    assert_is_top_k(zeros, 2000, clt_k.select_top_k(zeros, 2000, "threshold"))
    mostly = torch.zeros(numel)
    mostly[torch.randperm(numel, generator=gen)[:500]] = torch.randn(500, generator=gen)
    for k in (200, 500, 2000):  # fewer, as many, more non-zeros than k
        assert_is_top_k(mostly, k, clt_k.select_top_k(mostly, k, "threshold"))
    assert_same_set(mostly, 200, clt_k.select_top_k(mostly, 200, "threshold"))


def test_a_nan_does_not_hide_the_finite_entries_of_its_column():
    """NaN entries are never selected by "threshold", on either path; a large finite entry sharing
    the torch path's grid column with a NaN is still found."""
    from hvd_scalecom.native import torch_operations

    numel = 1 << 17
    p = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    p[12345], p[12345 + numel // 8], p[777] = 50.0, float("nan"), float("inf")  # 12345's column: the NaN
    finite = torch.where(torch.isnan(p), torch.zeros(()), p)
    expected = torch.topk(finite.abs(), 100).indices.sort().values
    with torch_operations():
        on_torch = clt_k.select_top_k(p, 100, "threshold").sort().values
    assert torch.equal(on_torch, expected)
    assert torch.equal(clt_k.select_top_k(p, 100, "threshold").sort().values, expected)


@pytest.mark.parametrize("selection", ["exact", "threshold"])
@pytest.mark.parametrize("poison", ["one nan", "all nan", "all inf"])
def test_a_leader_whose_gradient_is_not_finite_selects_the_top_k_of_its_memory(selection, poison):
    """A NaN or Inf in g makes ``top_k(|m + g|)`` undefined (torch.topk ranks NaN first, the threshold
    pass takes none, both take Inf, and an all-NaN p gave k arbitrary entries): the leader selects
    ``top_k(|m|)``, the memory the non-finite step leaves, alike on the C and the torch paths, in the
    step (select_and_take, whose values it still sends as NaN) or a step ahead (select_top_k_of_sum)."""
    from hvd_scalecom.native import torch_operations

    numel, k = 1 << 17, 500
    generator = torch.Generator().manual_seed(5)
    memory, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator)
    if poison == "one nan":
        grad[int(torch.topk(memory.abs(), 1).indices) + 1] = float("nan")
    else:
        grad.fill_(float("nan") if poison == "all nan" else float("inf"))
    expected = torch.topk(memory.abs(), k).indices.sort().values
    for path in (torch_operations, contextlib.nullcontext):
        with path():
            assert torch.equal(clt_k.select_top_k_of_sum(memory, grad, k, selection).sort().values, expected)
            indices, taken = clt_k.select_and_take(memory, grad, k, selection, index_dtype=torch.int32)
            assert torch.equal(indices.long(), expected) and not taken.finite


def test_biased_sample_falls_back_or_keeps_many_candidates():
    """The sample positions hold values unlike the rest: the threshold is then far off in either
    direction, and the result must still be exact (fallback, or a large candidate set)."""
    numel, k = 500_000, 5000
    size, _ = clt_k._sample_plan(numel, k, native=True)  # the C selection (CPU fp32)
    sampled = clt_k._sample_positions(numel, size, torch.device("cpu"))
    gen = torch.Generator().manual_seed(11)
    high = torch.randn(numel, generator=gen)
    high[sampled] = 100.0 + torch.rand(size, generator=gen)  # threshold too high: too few pass
    assert_same_set(high, k, clt_k.select_top_k(high, k, "threshold"))
    low = torch.randn(numel, generator=gen)
    low[sampled] = 1e-9  # threshold too low: nearly everything is a candidate
    assert_same_set(low, k, clt_k.select_top_k(low, k, "threshold"))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_gradients_with_fp32_memory(grad_dtype):
    numel, k = 300_000, 3000
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(numel, generator=gen).to(grad_dtype)
    m = 0.1 * torch.randn(numel, generator=gen)
    p = clt_k.error_compensated(m, g)
    assert p.dtype == torch.float32
    assert torch.equal(p, m + g.float())
    chosen = clt_k.select_top_k(p, k, "threshold")
    # Low-precision gradients are coarse, so ties at the k-th magnitude are possible.
    assert_is_top_k(p, k, chosen)
    assert overlap(chosen, clt_k.select_top_k(p, k, "exact")) > 0.99


def test_shapes_dtypes_and_edge_cases():
    gen = torch.Generator().manual_seed(9)
    p = torch.randn(100_007, generator=gen, dtype=torch.float64)  # not a multiple of 8, fp64
    p[-1] = 1e6  # the largest entry sits after the (8, numel // 8) grid
    chosen = clt_k.select_top_k(p, 500, "threshold")
    assert_same_set(p, 500, chosen)
    assert 100_006 in set(chosen.tolist())
    strided = torch.randn(400_000, generator=gen)[::2]  # not contiguous
    assert_same_set(strided, 2000, clt_k.select_top_k(strided, 2000, "threshold"))
    assert_same_set(p, 1, clt_k.select_top_k(p, 1, "threshold"))
    for k in (p.numel(), p.numel() + 5):
        assert torch.equal(clt_k.select_top_k(p, k, "threshold"), torch.arange(p.numel()))
    small = torch.randn(1000, generator=gen)
    assert_same_set(small, 10, clt_k.select_top_k(small, 10, "threshold"))
    inf = torch.randn(200_000, generator=gen)
    inf[123] = float("inf")
    inf[456] = float("-inf")
    chosen = clt_k.select_top_k(inf, 1000, "threshold")
    assert {123, 456} <= set(chosen.tolist())
    with pytest.raises(ValueError, match="selection"):
        clt_k.select_top_k(small, 10, "approximate")


def straightforward(memory, grad, indices, beta, sent_dtype):
    """The paper's step 3-4 with every quantity materialised (float64 to show the formula, not
    the rounding)."""
    m = memory.double()
    p = m + grad.reshape(-1).double()
    v = p[indices]
    sent = v.to(sent_dtype).double() if sent_dtype is not None else v
    scattered = torch.zeros_like(p)
    scattered[indices] = sent
    return (1 - beta) * m + beta * (p - scattered), v


def take_and_filter(memory, grad, indices, beta, sent_dtype=None):
    """Steps 3-4 as the simulator's schemes run them: ``take``, then ``filter_memory_``; returns what is sent."""
    memory_at, values = clt_k.take(memory, grad, indices)
    sent = values if sent_dtype is None else values.to(sent_dtype)
    clt_k.filter_memory_(memory, grad, indices, memory_at, values, sent, beta)
    return sent


@pytest.mark.parametrize("grad_dtype,sent_dtype", [
    (torch.float32, None), (torch.float32, torch.float16), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_take_and_filter_memory_are_the_formula(grad_dtype, sent_dtype, beta):
    numel, k = 50_000, 700
    gen = torch.Generator().manual_seed(13)
    grad = torch.randn(numel, generator=gen).to(grad_dtype).view(100, 500)
    memory = 0.5 * torch.randn(numel, generator=gen)
    indices = torch.randperm(numel, generator=gen)[:k]
    expected_memory, expected_values = straightforward(memory, grad, indices, beta, sent_dtype)
    p_at = memory[indices] + grad.reshape(-1)[indices].float()  # what the leader's p holds at I
    values = take_and_filter(memory, grad, indices, beta, sent_dtype=sent_dtype)
    want = sent_dtype or torch.float32
    assert values.dtype == want and values.shape == (k,)
    assert torch.equal(values, p_at.to(want))  # bitwise p[I], rounded once to the sent dtype
    torch.testing.assert_close(memory.double(), expected_memory, rtol=1e-6, atol=1e-6)
    rounding = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[want]
    torch.testing.assert_close(values.double(), expected_values, rtol=rounding, atol=0)


def test_take_and_filter_memory_take_rows_of_workers():
    gen = torch.Generator().manual_seed(17)
    n, numel, k = 3, 10_000, 50
    M = torch.randn(n, numel, generator=gen)
    G = torch.randn(n, numel, generator=gen)
    rows = torch.randperm(numel, generator=gen)[:k]
    flat = (rows + torch.arange(n).view(n, 1) * numel).reshape(-1)  # the simulator's layout
    expected_memory, _ = straightforward(M.reshape(-1), G, flat, 0.3, None)
    p_at = (M + G).reshape(-1)[flat]
    values = take_and_filter(M.view(-1), G, flat, 0.3)
    torch.testing.assert_close(M.view(-1).double(), expected_memory, rtol=1e-6, atol=1e-6)
    assert torch.equal(values, p_at)


def test_scatter_dense_and_into_an_existing_tensor():
    gen = torch.Generator().manual_seed(19)
    indices = torch.randperm(4000, generator=gen)[:40]
    values = torch.randn(40, generator=gen)
    expected = torch.zeros(4000)
    expected[indices] = values
    out = clt_k.scatter_dense(values, indices, 4000, torch.float32)
    assert torch.equal(out, expected)
    half = clt_k.scatter_dense(values, indices.to(torch.int32), 4000, torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, expected.half())
    grad = torch.randn(40, 100, generator=gen)  # the gradient's own storage, any shape
    same = clt_k.scatter_dense_(grad, values, indices)
    assert same is grad and torch.equal(grad.view(-1), expected)


def test_error_compensated_into_a_larger_scratch_buffer():
    gen = torch.Generator().manual_seed(23)
    memory = torch.randn(1000, generator=gen)
    grad = torch.randn(10, 100, generator=gen).half()
    scratch = torch.full((5000,), float("nan"))
    p = clt_k.error_compensated_into(scratch, memory, grad)
    assert p.shape == (1000,) and p.data_ptr() == scratch.data_ptr()
    assert torch.equal(p, clt_k.error_compensated(memory, grad))


def test_a_negative_k_is_refused_alike_on_every_path():
    p = torch.randn(5000)
    for run in (lambda: clt_k.select_top_k(p, -1, "threshold"), lambda: clt_k.select_top_k(p, -1, "exact"),
                lambda: clt_k.select_and_take(torch.zeros(5000), p, -1, "threshold")):
        with pytest.raises(ValueError, match="k must be >= 0, got -1"):
            run()
        with native.torch_operations(), pytest.raises(ValueError, match="k must be >= 0, got -1"):
            run()
