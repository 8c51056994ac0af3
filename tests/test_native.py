"""The C kernels (hvd_scalecom.native) against the torch operations of clt_k: the same indices and the
same floats, bit for bit, on every path they take (vector body, unaligned heads, tails, fallbacks)."""

import contextlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from scalar_kernels import rerun_with_scalar_kernels

from hvd_scalecom import config, native
from hvd_scalecom.native import torch_operations
from hvd_scalecom.torch import clt_k

BETA = 0.1
CUT_PASS = native.library().has_cut_pass  # the leader's decompress finds I from its cut (AVX-512 builds)


def test_the_kernels_build_where_a_compiler_exists():
    assert shutil.which("cc") or shutil.which("gcc"), "a C compiler is part of the set-up"
    assert native.library() is not None


def test_the_leaders_cut_pass_is_built_with_avx512_and_taken_on_large_tensors():
    without = "-mno-avx512f" in os.environ.get("HVD_SCALECOM_CFLAGS", "").split()
    assert CUT_PASS == ("avx512f" in native._cpu_features().split() and not without)
    memory, grad = inputs(clt_k._CUT_MIN_NUMEL - 64)
    assert clt_k.select_and_take(memory, grad, 1000, "threshold")[1].cut is None
    memory, grad = inputs(clt_k._CUT_MIN_NUMEL)
    assert (clt_k.select_and_take(memory, grad, 1000, "threshold")[1].cut is not None) == CUT_PASS


def test_inference_tensors_have_no_version_counter_and_the_leader_takes_i_from_the_indices(monkeypatch):
    monkeypatch.setattr(clt_k, "_CUT_MIN_NUMEL", 0)
    memory, grad = inputs(100_000, seed=13)
    reference_memory = memory.clone()
    new, new_grad, _, _ = reference(memory, grad, torch.topk((memory + grad).abs(), 1000).indices.sort().values,
                                    torch.ones(1000))
    with torch.inference_mode():
        grad = grad.clone()
        indices, taken = clt_k.select_and_take(memory, grad, 1000, "threshold")
        assert taken.cut is None
        assert clt_k.filter_and_scatter_(memory, grad, indices, torch.ones(1000), taken, taken.values, BETA)
    assert torch.equal(memory, new) and torch.equal(grad, new_grad) and not torch.equal(memory, reference_memory)


@pytest.fixture
def cut_at_any_size(monkeypatch):
    """The leader's cut on the small tensors of these tests too."""
    monkeypatch.setattr(clt_k, "_CUT_MIN_NUMEL", 0)


def inputs(numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)


def reference(memory, grad, indices, reduced, beta=BETA):
    """Steps 3-5 with torch operations on copies: (new memory, new gradient, m[I], p[I])."""
    new = memory.clone()
    at, values = clt_k.take(new, grad, indices)
    kept = at.clone()
    clt_k.filter_memory_(new, grad, indices, at, values, values, beta)
    return new, clt_k.scatter_dense(reduced, indices, grad.numel(), grad.dtype), kept, values


def run_both_steps(memory, grad, indices, taken, reduced_of, sent_dtype=None):
    """compress's taken (a clt_k.Taken), then decompress's filter_and_scatter_, as the compressor
    calls them; returns (finite, updated, the reduced values)."""
    sent = taken.values if sent_dtype is None else taken.values.to(sent_dtype)
    reduced = reduced_of(taken.values)
    updated = clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, sent, BETA)
    return taken.finite, updated, reduced


@pytest.mark.parametrize("numel", [70_001, 1 << 20, 1_000_003])
@pytest.mark.parametrize("ratio", [0.01, 0.001])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_leader_steps_equal_top_k_and_the_torch_memory_update(numel, ratio, index_dtype, cut_at_any_size):
    memory, grad = inputs(numel)
    k = max(1, round(ratio * numel))
    exact = torch.topk((memory + grad).abs(), k).indices.sort().values
    new, new_grad, kept, values = reference(memory, grad, exact, 0.5 * (memory + grad)[exact])
    indices, taken = clt_k.select_and_take(memory, grad, k, "threshold", index_dtype=index_dtype)
    assert taken.finite and (taken.cut.ties == -1 if CUT_PASS else taken.cut is None)  # I again: |p| >= kth
    assert indices.dtype == index_dtype and torch.equal(indices.long(), exact)  # ascending
    assert torch.equal(clt_k.memory_at(memory, indices, taken), kept) and torch.equal(taken.values, values)
    _, updated, _ = run_both_steps(memory, grad, indices, taken, lambda v: 0.5 * v)
    assert updated
    assert torch.equal(memory, new) and torch.equal(grad, new_grad)


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
@pytest.mark.parametrize("tail", [0, 5, 15])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_non_leader_steps_in_any_order_and_with_tails(order, tail, index_dtype):
    numel = 300_000 + tail
    memory, grad = inputs(numel, seed=1)
    indices = torch.randperm(numel, generator=torch.Generator().manual_seed(2))[:3000]
    indices[0], indices[1] = numel - 1, 0  # the scalar tail and the first lane
    indices = (indices.sort().values if order == "ascending" else indices).to(index_dtype)
    reduced = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    new, new_grad, kept, values = reference(memory, grad, indices.long(), reduced)
    taken = clt_k.take_checking(memory, grad, indices)
    assert taken.finite and torch.equal(taken.memory_at, kept) and torch.equal(taken.values, values)  # in order
    _, updated, _ = run_both_steps(memory, grad, indices, taken, lambda v: reduced)
    assert updated and torch.equal(memory, new) and torch.equal(grad, new_grad)


def test_repeated_indices_in_place_give_what_torch_operations_give():
    memory, grad = inputs(10_000, seed=11)
    indices = torch.tensor([7, 300, 7, 9_999])
    reduced = torch.tensor([1.0, 2.0, 1.0, 3.0])
    results = []
    for use_torch in (False, True):
        m, g = memory.clone(), grad.clone()
        with torch_operations() if use_torch else contextlib.nullcontext():
            taken = clt_k.take_checking(m, g, indices)
            assert clt_k.filter_and_scatter_(m, g, indices, reduced, taken, taken.values, BETA)
        results.append((m, g))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[0][1][7] == 1.0 and results[0][1][300] == 2.0 and results[0][1].count_nonzero() == 3


def advance_both_steps(memory, grad, indices, reduced_of, sent_dtype=None, marks=None):
    """take_advancing_, then filter_and_scatter_advanced, as the compressor calls them on a rank that
    did not select: returns (p[I], finite, gradient, memory, updated)."""
    taken = clt_k.take_advancing_(memory, grad, indices, BETA, marks)
    sent = taken.values if sent_dtype is None else taken.values.to(sent_dtype)
    out, new_memory, updated = clt_k.filter_and_scatter_advanced(memory, grad, indices, reduced_of(taken.values),
                                                                 taken, sent, BETA, marks)
    return taken.values, taken.finite, out, new_memory, updated


@pytest.mark.parametrize("order", ["ascending", "shuffled"])
@pytest.mark.parametrize("tail", [0, 5, 15, 63])
@pytest.mark.parametrize("ratio", [0.01, 0.3])
@pytest.mark.parametrize("marks", ["kept", "rebuilt"])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])  # int32: as broadcast
def test_advancing_pass_equals_the_in_place_passes_with_the_buffers_traded(order, tail, ratio, marks, index_dtype):
    numel = 300_032 + tail  # a whole number of 64-entry words, then the tail
    memory, grad = inputs(numel, seed=7)
    k = int(ratio * numel)
    indices = torch.randperm(numel, generator=torch.Generator().manual_seed(8))[:k]
    indices[0], indices[1] = numel - 1, 0  # the scalar tail and the first lane
    indices = torch.unique(indices)  # ascending, each once
    if order == "shuffled":
        indices = indices[torch.randperm(indices.numel(), generator=torch.Generator().manual_seed(10))]
    reduced = torch.randn(indices.numel(), generator=torch.Generator().manual_seed(9))
    new, new_grad, _, values = reference(memory, grad, indices, reduced)
    memory_buffer, grad_buffer = memory.data_ptr(), grad.data_ptr()
    marks = clt_k.Marks(numel) if marks == "kept" else None
    taken, finite, out, new_memory, updated = advance_both_steps(memory, grad, indices.to(index_dtype),
                                                                 lambda v: reduced, marks=marks)
    assert finite and updated
    assert torch.equal(taken, values)
    assert torch.equal(new_memory, new) and torch.equal(out, new_grad)
    assert new_memory.data_ptr() == grad_buffer and out.data_ptr() == memory_buffer  # traded, not copied
    grad.set_(out)  # as Horovod does with the gradient decompress returns: the memory stays
    assert torch.equal(new_memory, new) and new_memory.data_ptr() == grad_buffer


@pytest.mark.parametrize("aligned", [True, False])
def test_advancing_a_gradient_larger_than_the_caches_writes_the_same_gradient(aligned):
    """From 2**22 entries on, the gradient goes out by non-temporal stores (AVX-512 and AVX2 builds)
    where the old memory's buffer is 64-byte aligned, by plain stores where it is not."""
    numel = (1 << 22) + 64 + 5  # one more word, then a tail
    memory, grad = inputs(numel, seed=11)
    if not aligned:
        memory = torch.cat([torch.zeros(1), memory])[1:]  # 4 bytes past an aligned allocation
    assert (memory.data_ptr() % 64 == 0) == aligned
    indices = torch.randperm(numel, generator=torch.Generator().manual_seed(12))[:numel // 100]
    indices[0], indices[1], indices[2] = numel - 1, 0, 1 << 22  # the tail, the first lane, the last word
    indices = torch.unique(indices)
    reduced = torch.randn(indices.numel(), generator=torch.Generator().manual_seed(13))
    new, new_grad, _, values = reference(memory, grad, indices, reduced)
    memory_buffer = memory.data_ptr()
    taken, finite, out, new_memory, updated = advance_both_steps(memory, grad, indices.to(torch.int32),
                                                                 lambda v: reduced)
    assert finite and updated and torch.equal(taken, values)
    assert out.data_ptr() == memory_buffer
    assert torch.equal(out, new_grad) and torch.equal(new_memory, new)


@pytest.mark.parametrize("path", ["in place", "traded buffers", "leader"])
def test_fp16_values_keep_their_rounding_error_in_the_memory(path, cut_at_any_size):
    numel = 200_000
    memory, grad = inputs(numel, seed=5)
    reference_memory, reference_grad = memory.clone(), grad.clone()
    if path == "leader":  # I found again from the selection's cut
        indices, taken = clt_k.select_and_take(memory, grad, 2_000, "threshold")
        assert (taken.cut is not None) == CUT_PASS
    else:
        indices = torch.arange(0, numel, 97)
    at, values = clt_k.take(reference_memory, reference_grad, indices)
    clt_k.filter_memory_(reference_memory, reference_grad, indices, at, values, values.to(torch.float16), BETA)
    if path != "traded buffers":
        if path == "in place":
            taken = clt_k.take_checking(memory, grad, indices)
        _, updated, _ = run_both_steps(memory, grad, indices, taken, lambda v: v.to(torch.float16), torch.float16)
    else:
        *_, memory, updated = advance_both_steps(memory, grad, indices, lambda v: v.to(torch.float16),
                                                 torch.float16)
    assert updated and torch.equal(memory, reference_memory)


@pytest.mark.parametrize("where", ["gradient", "reduction"])
def test_advancing_a_non_finite_step_keeps_the_memory_and_its_buffer(where):
    memory, grad = inputs(100_000, seed=6)
    before = memory.clone()
    indices = torch.tensor([3, 50, 99_998])
    if where == "gradient":
        grad[777] = float("inf")
    reduced = torch.tensor([1.0, float("nan") if where == "reduction" else 4.0, 2.0])
    memory_buffer, grad_buffer = memory.data_ptr(), grad.data_ptr()
    _, finite, out, new_memory, updated = advance_both_steps(memory, grad, indices, lambda v: reduced)
    assert finite == (where == "reduction")
    assert not updated if where == "reduction" else updated
    if where == "reduction":
        assert new_memory.data_ptr() == memory_buffer and torch.equal(new_memory, before)
        assert out.data_ptr() == grad_buffer
    expected = torch.zeros(100_000)
    expected[indices] = reduced
    assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_advancing_declines_repeated_indices_and_rejects_out_of_range_ones_before_writing():
    memory, grad = inputs(10_000)
    grad_before = grad.clone()
    for dtype in (torch.int64, torch.int32):
        assert clt_k.take_advancing_(memory, grad, torch.tensor([4, 9, 4], dtype=dtype), BETA) is None
        for bad in ([5, 10_000], [9, 4, -1], [-3, 7]):
            with pytest.raises(IndexError, match=r"indices must lie in \[0, 10000\)"):
                clt_k.take_advancing_(memory, grad, torch.tensor(bad, dtype=dtype), BETA)
    assert torch.equal(grad, grad_before)


def test_the_advancing_passes_refuse_tensors_the_c_passes_cannot_take_before_any_pointer_reaches_c():
    memory, grad, indices = torch.zeros(4096), torch.randn(4096), torch.tensor([3, 9])
    bad_pairs = [(memory, grad.half(), "grad must be a contiguous fp32 CPU tensor"),
                 (memory.double(), grad, "memory must be a contiguous fp32 CPU tensor"),
                 (memory, torch.randn(64, 64).t(), "not contiguous"),
                 (torch.zeros(10), grad, "memory has 10 entries, grad 4096")]
    for m, g, message in bad_pairs:
        before = g.clone()
        with pytest.raises(ValueError, match=message):
            clt_k.take_advancing_(m, g, indices, BETA)
        with pytest.raises(ValueError, match=message):
            clt_k.filter_and_scatter_advanced(m, g, indices, torch.ones(2), None, torch.ones(2), BETA)
        assert torch.equal(g, before)


def test_the_advancing_passes_refuse_marks_and_tensors_they_cannot_take_before_any_pointer_reaches_c():
    """Marks made for another tensor or other indices (the C pass scatters one reduced value per
    mark), indices or reduced values that are not on the CPU, repeated indices without marks."""
    memory, grad = inputs(1 << 19)
    indices = torch.arange(0, 1 << 19, 256, dtype=torch.int32)
    marks = clt_k.Marks(grad.numel())
    taken = clt_k.take_advancing_(memory, grad, indices, BETA, marks)
    memory_before, grad_before = memory.clone(), grad.clone()
    reduced = torch.ones(indices.numel())
    cases = [(indices[:8], reduced[:8], marks, "marks hold 2048 indices of a tensor of 524288 entries, for 8 reduced"),
             (indices, reduced, clt_k.Marks(64), "marks hold None indices of a tensor of 64 entries"),
             (indices, reduced.to("meta"), marks, "reduced must be a CPU tensor here"),
             (indices.to("meta"), reduced, marks, "indices must be a CPU tensor here"),
             (torch.tensor([3, 3]), torch.ones(2), None, "indices repeat")]
    for bad_indices, bad_reduced, bad_marks, message in cases:
        with pytest.raises(ValueError, match=message):
            clt_k.filter_and_scatter_advanced(memory, grad, bad_indices, bad_reduced, taken, taken.values, BETA,
                                              bad_marks)
    with pytest.raises(ValueError, match="indices must be a CPU tensor here"):
        clt_k.take_advancing_(memory, grad, indices.to("meta"), BETA, marks)
    assert torch.equal(grad, grad_before) and torch.equal(memory, memory_before)


def test_threads_each_have_their_own_scratch():
    """The C passes run without the GIL: two threads' bitmaps (and candidate buffers) must not be
    shared (with one shared bitmap, 67 of 600 gradients here came out wrong)."""
    import threading

    together = threading.Barrier(2)  # both threads inside the C passes at once, call after call

    def work(seed, k, wrong):
        memory, grad = inputs(1 << 20, seed=seed)
        indices = torch.randperm(1 << 20, generator=torch.Generator().manual_seed(seed))[:k].sort().values
        taken = clt_k.take_checking(memory, grad, indices)
        reduced = 0.5 * taken.values
        expected = torch.zeros(1 << 20).index_copy_(0, indices, reduced)
        for _ in range(150):
            together.wait(timeout=60)
            clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, taken.values, 0.3)
            wrong[seed] += not torch.equal(grad, expected)
            wrong[seed] += not torch.equal(clt_k.select_and_take(memory, grad, k, "threshold")[0],
                                           clt_k.select_and_take(memory, grad, k, "exact")[0])

    wrong = {1: 0, 2: 0}
    threads = [threading.Thread(target=work, args=(seed, k, wrong)) for seed, k in ((1, 50), (2, 50_000))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == {1: 0, 2: 0}


def test_only_large_fp32_gradients_owning_their_storage_advance():
    big = clt_k._ADVANCE_MIN_NUMEL
    memory = torch.zeros(big)
    assert clt_k.may_advance(memory, torch.zeros(big))
    assert clt_k.may_advance(memory, torch.zeros(big // 64, 64))
    assert not clt_k.may_advance(memory, torch.zeros(big + 1)[1:])  # a view into a larger buffer
    assert not clt_k.may_advance(memory, torch.zeros(2 * big)[:big])
    assert not clt_k.may_advance(memory, torch.zeros(big // 64, 64).t())  # not contiguous
    assert not clt_k.may_advance(torch.zeros(big - 1), torch.zeros(big - 1))
    assert not clt_k.may_advance(memory.double(), torch.zeros(big, dtype=torch.float64))


def test_select_of_p_and_of_the_sum_agree_with_the_torch_threshold_path():
    memory, grad = inputs(2_000_000, seed=3)
    p = memory + grad
    k = 20_000
    fast = clt_k.select_top_k(p, k, "threshold")
    assert torch.equal(fast, clt_k.select_top_k_of_sum(memory, grad, k, "threshold"))
    assert torch.equal(fast, torch.topk(p.abs(), k).indices.sort().values)
    threshold = clt_k._sampled_threshold(p, k)  # the torch version of the same threshold
    candidates, magnitudes = clt_k._at_least(p, threshold)
    torch_path = candidates.index_select(0, torch.topk(magnitudes, k).indices)
    assert torch.equal(fast, torch_path.sort().values)


def test_ties_zeros_and_fallbacks_still_give_an_exact_top_k():
    numel = 100_000
    ties = torch.ones(numel)
    ties[::7] = 2.0
    indices, _ = clt_k.select_and_take(ties, torch.zeros(numel), 1000, "threshold")
    assert torch.equal(indices, torch.arange(0, 7000, 7))  # ties go to the lowest indices
    zeros = torch.zeros(numel)
    zeros[5] = 3.0
    indices, taken = clt_k.select_and_take(zeros, torch.zeros(numel), 10, "threshold")
    assert taken.finite and 5 in indices.tolist() and taken.values.abs().sum() == 3.0  # t = 0: the full top-k
    assert taken.cut is None and torch.equal(taken.memory_at, zeros[indices])


def exact_lowest_on_ties(p, k):
    """The exact top-k of |p|, ties at the k-th magnitude going to the lowest indices, ascending."""
    order = torch.sort(p.abs(), descending=True, stable=True).indices  # stable: lower index first
    return order[:k].sort().values


@pytest.mark.parametrize("case", ["few distinct values", "infinite entries", "wide exponents"])
def test_the_radix_selection_of_the_k_th_magnitude_is_exact(case, cut_at_any_size):
    gen = torch.Generator().manual_seed(9)
    numel, k = 200_003, 2_000
    if case == "few distinct values":  # many candidates tie with the k-th magnitude
        p = torch.randint(1, 40, (numel,), generator=gen).float().sub_(20.0).div_(8.0)
    elif case == "infinite entries":  # +-inf magnitudes rank first (bit pattern 0x7f800000)
        p = torch.randn(numel, generator=gen)
        p[torch.randint(0, numel, (300,), generator=gen)] = float("inf")
        p[torch.randint(0, numel, (300,), generator=gen)] = -float("inf")
    else:  # subnormals to 1e30: the bit patterns span most of the float range
        p = torch.randn(numel, generator=gen) * torch.pow(10.0, torch.randint(-44, 30, (numel,), generator=gen).float())
    memory = p.clone()
    indices, taken = clt_k.select_and_take(memory, torch.zeros(numel), k, "threshold")
    assert torch.equal(indices, exact_lowest_on_ties(p, k)) and torch.equal(taken.values, p[indices])
    if case == "few distinct values" and CUT_PASS:  # some of the entries at the k-th magnitude only
        assert taken.cut.ties > 0
    # decompress finds the same I from the cut, ties included: as the torch operations on these indices
    reduced = torch.arange(k, dtype=torch.float32)  # finite, also where p is infinite
    new, new_grad, _, _ = reference(p, torch.zeros(numel), indices, reduced)
    grad = torch.zeros(numel)
    assert clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, taken.values, BETA)
    assert torch.equal(memory, new) and torch.equal(grad, new_grad)


def test_a_gradient_changed_in_place_after_the_selection_is_scattered_by_its_indices(cut_at_any_size):
    """E.g. clipped before the optimizer's synchronize(): the version counter tells, and I is then
    read from the indices (as on a non-leader); a change that the counter misses is an error."""
    memory, grad = inputs(100_000, seed=12)
    indices, taken = clt_k.select_and_take(memory, grad, 1000, "threshold")
    reduced = torch.arange(1000, dtype=torch.float32)
    m, g = memory.clone(), grad.clone()
    g[indices[0]] = -m[indices[0]]  # |p| = 0 there: the cut would find k - 1 entries
    new, new_grad, _, _ = reference(m, g, indices, reduced)
    grad[indices[0]] = -memory[indices[0]]  # in place: the version counter moves
    assert clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, taken.values, BETA)
    assert torch.equal(grad, new_grad) and torch.equal(memory, new)
    memory, grad = inputs(100_000, seed=12)
    indices, taken = clt_k.select_and_take(memory, grad, 1000, "threshold")
    grad.data[indices[0]] = -memory[indices[0]]  # through .data: the counter stays
    if CUT_PASS:
        with pytest.raises(RuntimeError, match="changed between compress and decompress"):
            clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, taken.values, BETA)
    else:  # I is always read from the indices
        assert clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, taken.values, BETA)
        assert torch.equal(grad, new_grad) and torch.equal(memory, new)


@pytest.mark.parametrize("where", [0, 17, 99_999])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_is_reported(where, bad):
    memory, grad = inputs(100_000, seed=4)
    grad[where] = bad
    assert not clt_k.select_and_take(memory, grad, 1000, "threshold")[1].finite
    assert not clt_k.take_checking(memory, grad, torch.arange(10)).finite
    assert not clt_k.take_checking(memory, grad, torch.arange(10, 0, -1)).finite


def test_a_non_finite_reduction_leaves_the_memory_and_still_writes_the_gradient():
    memory, grad = inputs(100_000, seed=6)
    before = memory.clone()
    indices = torch.tensor([3, 50, 99_998])
    reduced = torch.tensor([1.0, float("nan"), 2.0])
    taken = clt_k.Taken(reduced, True, memory[indices])
    assert not clt_k.filter_and_scatter_(memory, grad, indices, reduced, taken, reduced, BETA)
    assert torch.equal(memory, before)
    expected = torch.zeros(100_000)
    expected[indices] = reduced
    assert torch.equal(grad.nan_to_num(7.0), expected.nan_to_num(7.0))


def test_bad_indices_raise_before_anything_is_written():
    memory, grad = inputs(10_000)
    memory_before, grad_before = memory.clone(), grad.clone()
    with pytest.raises(IndexError, match=r"indices must lie in \[0, 10000\)"):
        clt_k.take_checking(memory, grad, torch.tensor([5, 10_000]))
    with pytest.raises(IndexError, match="indices must lie"):
        clt_k.filter_and_scatter_(memory, grad, torch.tensor([-1, 4]), torch.ones(2),
                                  clt_k.Taken(torch.ones(2), True, torch.ones(2)), torch.ones(2), BETA)
    assert torch.equal(grad, grad_before) and torch.equal(memory, memory_before)


@pytest.mark.parametrize("path", ["C", "torch operations"])
def test_mismatched_or_out_of_range_pairs_raise_before_anything_is_written(path):
    """filter_and_scatter_ on either path, and filter_and_scatter_advanced (C), check the reduced values
    against the indices before writing the memory or the gradient."""
    memory, grad = inputs(10_000)
    memory_before, grad_before = memory.clone(), grad.clone()
    taken = clt_k.Taken(torch.ones(3), True, torch.ones(3))
    block = torch_operations() if path == "torch operations" else contextlib.nullcontext()
    with block:
        with pytest.raises(ValueError, match="2 reduced values for 3 indices"):
            clt_k.filter_and_scatter_(memory, grad, torch.tensor([1, 5, 9]), torch.ones(2), taken, torch.ones(3), BETA)
        with pytest.raises(IndexError, match=r"indices must lie in \[0, 10000\)"):
            clt_k.filter_and_scatter_(memory, grad, torch.tensor([1, 5, 10_000]), torch.ones(3), taken,
                                      torch.ones(3), BETA)
    assert torch.equal(grad, grad_before) and torch.equal(memory, memory_before)
    memory, grad = inputs(1 << 19)
    indices = torch.tensor([10, 100, 1000, 3000], dtype=torch.int32)
    marks = clt_k.Marks(grad.numel())
    taken = clt_k.take_advancing_(memory, grad, indices, BETA, marks)
    memory_before, grad_before = memory.clone(), grad.clone()
    for reduced in (torch.ones(1), torch.ones(5)):
        with pytest.raises(ValueError, match=f"{reduced.numel()} reduced values for 4 indices"):
            clt_k.filter_and_scatter_advanced(memory, grad, indices, reduced, taken, taken.values, BETA, marks)
    assert torch.equal(grad, grad_before) and torch.equal(memory, memory_before)


@pytest.mark.parametrize("default", [torch.float64, torch.float16])
def test_the_kernels_outputs_are_fp32_whatever_the_default_dtype(default):
    """The buffers the C passes fill are made fp32 (a default fp16 buffer would be overrun, an fp64
    one read as garbage): under another default dtype every pass gives what it gives under fp32."""
    numel, k = (1 << 19) + 3, 5000
    g0, m0 = torch.randn(numel), 0.5 * torch.randn(numel)
    indices = torch.arange(7, numel, 100, dtype=torch.int32)[:k]

    def run():
        m, g = m0.clone(), g0.clone()
        chosen, taken = clt_k.select_and_take(m, g, k, "threshold", index_dtype=torch.int32)
        checked = clt_k.take_checking(m, g, indices.long())
        advanced = clt_k.take_advancing_(m, g, indices, 0.1, clt_k.Marks(numel))
        return chosen, taken.values, checked.values, checked.memory_at, advanced.values, g

    want = run()
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = run()
    finally:
        torch.set_default_dtype(before)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_disabled_by_the_environment_variable():
    code = ("import torch; from hvd_scalecom import native; from hvd_scalecom.torch import clt_k; "
            "assert native.library() is None; "
            "assert clt_k.take_checking(torch.zeros(4), torch.zeros(4), torch.tensor([1])).finite")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ,
                                                                 "HVD_SCALECOM_NATIVE": "0"})


def test_torch_operations_within_a_block_give_the_kernels_floats():
    memory, grad = inputs(200_000, seed=7)
    results = []
    for block in (native.torch_operations, contextlib.nullcontext):
        m, g = memory.clone(), grad.clone()
        with block():
            assert (native.library() is None) == (block is native.torch_operations)
            indices, taken = clt_k.select_and_take(m, g, 2000, "threshold")
            clt_k.filter_and_scatter_(m, g, indices, 0.5 * taken.values, taken, taken.values, BETA)
        results.append((indices.sort().values, m, g))
    assert native.library() is not None  # enabled again after the block
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_all_finite_sees_nan_and_both_infinities(dtype):
    clean = torch.randn(1000).to(dtype)
    assert clt_k.all_finite(clean) and clt_k.all_finite(clean[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (123, 999):  # a whole vector, the tail
            poisoned = clean.clone()
            poisoned[where] = bad
            assert not clt_k.all_finite(poisoned)


@pytest.mark.parametrize("numel", [1, 16, 1000, 4099])
def test_the_benchmarks_fused_pass_updates_the_memory_as_torch_and_zeroes_the_gradient(numel):
    memory, grad = inputs(numel)
    expected = memory.clone().add_(grad, alpha=BETA)
    native.library().hsc_fused_pass(memory.data_ptr(), grad.data_ptr(), numel, BETA)
    assert torch.equal(memory, expected)
    assert torch.equal(grad, torch.zeros(numel))


def test_processes_building_at_once_into_an_empty_cache_all_load_one_library(tmp_path):
    """Ranks start together: each may compile, each installs a whole library atomically."""
    code = ("import torch, warnings; warnings.simplefilter('error'); from hvd_scalecom import native; "
            "from hvd_scalecom.torch import clt_k; assert native.library() is not None; "
            "m, g = torch.zeros(100), torch.ones(100); "
            "assert clt_k.take_checking(m, g, torch.tensor([3])).values.item() == 1.0")
    env = {**os.environ, "HVD_SCALECOM_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    built = sorted(path.name for path in (tmp_path / "native").iterdir())  # $HVD_SCALECOM_CACHE/native
    assert len(built) == 1 and built[0].startswith("scalecom_kernels_") and built[0].endswith(".so")


def test_a_missing_compiler_warns_and_falls_back_to_torch_operations(tmp_path):
    code = ("import torch, warnings; from hvd_scalecom import native; from hvd_scalecom.torch import clt_k\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    assert native.library() is None\n"
            "assert 'C kernels are unavailable' in str(caught[0].message)\n"
            "assert clt_k.take_checking(torch.zeros(4), torch.ones(4), torch.tensor([1])).values.item() == 1.0")
    env = {**os.environ, "HVD_SCALECOM_CACHE": str(tmp_path), "PATH": str(tmp_path)}
    env.pop("CC", None)
    subprocess.run([sys.executable, "-c", code + "\nassert 'neither cc nor gcc' in str(caught[0].message)"],
                   env=env, check=True)
    # a $CC that is not found is not replaced by another compiler (gcc was used, unnoticed)
    env = {**os.environ, "HVD_SCALECOM_CACHE": str(tmp_path / "cc"), "CC": "no-such-compiler"}
    subprocess.run([sys.executable, "-c",
                    code + "\nassert 'CC=no-such-compiler is not found' in str(caught[0].message)"],
                   env=env, check=True)
    assert not list((tmp_path / "cc").glob("native/*.so"))


@pytest.mark.parametrize("flags", ["-mno-avx512f", "-mno-avx512f -mno-avx2"])
def test_the_scalar_build_gives_the_same_results(tmp_path, flags):
    """This file again, with the kernels built without AVX-512 (their AVX2 loops, where the CPU has
    AVX2), and without AVX2 either (plain C)."""
    rerun_with_scalar_kernels(__file__, tmp_path, flags)


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_leader_indices_in_the_dtype_asked_for_on_every_path(index_dtype):
    memory, grad = inputs(200_000, seed=8)
    indices, taken = clt_k.select_and_take(memory, grad, 2_000, "threshold", index_dtype=index_dtype)
    with torch_operations():
        torch_indices, torch_taken = clt_k.select_and_take(memory, grad, 2_000, "threshold", index_dtype=index_dtype)
    assert indices.dtype == torch_indices.dtype == index_dtype
    assert torch.equal(indices, torch_indices) and torch.equal(taken.values, torch_taken.values)
    with pytest.raises(ValueError, match="index_dtype must be torch.int64 or torch.int32"):
        clt_k.select_and_take(memory, grad, 2_000, "threshold", index_dtype=torch.int16)


def test_int32_indices_of_a_tensor_too_large_for_them_are_an_error(monkeypatch):
    memory, grad = inputs(200_000, seed=9)
    monkeypatch.setattr(config, "INT32_INDEX_MAX_NUMEL", 199_999)  # as 2**31 - 1 is for larger tensors
    with pytest.raises(ValueError, match="index_dtype torch.int32 cannot index a tensor of 200000 entries"):
        clt_k.select_and_take(memory, grad, 2_000, "threshold", index_dtype=torch.int32)
    indices, _ = clt_k.select_and_take(memory, grad, 2_000, "threshold", index_dtype=torch.int64)
    assert indices.dtype == torch.int64 and indices.numel() == 2_000
