"""The numbers of ``selection="threshold"``, framework-neutral: when a sampled threshold is used, how
many entries are sampled, at which positions, and which sampled magnitude is the threshold.

CLT-k's leader selects ``I = top_k(|p|)`` (Chen et al., NeurIPS 2020, Algorithm 1, step 2). The
threshold rule finds the same set (ties at the k-th magnitude aside) without a full top-k: the
rank-th largest of ``size`` sampled magnitudes is a threshold a little below the k-th largest, the
entries reaching it are the candidates, and an exact top-k among them picks the k; where fewer than
k reach it (or it is 0), an exact top-k of the whole tensor is taken. The PyTorch equations
(:mod:`hvd_scalecom.torch.clt_k`, its C kernels) and the TensorFlow ones
(:mod:`hvd_scalecom.tensorflow.clt_k`) take their numbers from here.
"""

import math

import numpy as np

# Below these sizes an exact top-k is about as fast: with torch (or TensorFlow) operations, in C, and
# on CUDA, where a tensor that small is bound by kernel launches and host reads (docs/performance.md,
# GPU section: python -m benchmarks.gpu_kernels).
THRESHOLD_MIN_NUMEL = 1 << 16
NATIVE_THRESHOLD_MIN_NUMEL = 1 << 10
CUDA_THRESHOLD_MIN_NUMEL = 1 << 22
MAX_RATIO_DENOMINATOR = 16  # ratios above 1/16 take the exact top-k
SAMPLE_EXCESS = 2048  # candidates beyond k that a small sample may let through, on average (in C)
_GOLDEN = 0.6180339887498949


def thresholded(numel, k, native=False, cuda=False):
    """Whether ``"threshold"`` samples a threshold for ``k`` of ``numel`` entries (else it is an exact
    top-k), in C (``native``) or with framework operations (on a CUDA device: ``cuda``)."""
    least = NATIVE_THRESHOLD_MIN_NUMEL if native else CUDA_THRESHOLD_MIN_NUMEL if cuda else THRESHOLD_MIN_NUMEL
    return numel >= least and k * MAX_RATIO_DENOMINATOR <= numel


def sample_plan(numel, k, native=False):
    """``(size, rank)``: the threshold is the rank-th largest of ``size`` sampled magnitudes.

    Of ``size`` sampled entries about ``e = k size / numel`` reach the k-th largest magnitude;
    ``rank`` is four standard deviations above ``e`` (:func:`sample_rank`). With framework operations
    the sample is ``numel / 256`` entries within [4,096, 65,536]; in C (``native``), the smallest of
    512, 1,024 and 2,048 that lets through at most ``SAMPLE_EXCESS`` more than k on average, else
    ``numel / 1024`` within [4,096, 16,384]. Never more than ``numel``. ``rank >= size`` means no
    threshold (an exact top-k).
    """
    if not native:
        size = min(numel, max(4096, min(65536, numel // 256)))
        return size, sample_rank(numel, k, size)
    largest = min(numel, max(4096, min(16384, numel // 1024)))
    for size in (512, 1024, 2048, largest):
        size = min(size, largest)
        rank = sample_rank(numel, k, size)
        if size == largest or expected_candidates(numel, size, rank) - k <= SAMPLE_EXCESS:
            return size, rank


def sample_rank(numel, k, size):
    """Four standard deviations above the ``k size / numel`` sampled entries expected to reach the
    k-th largest magnitude."""
    expected = k * size / numel
    return int(math.ceil(expected + 4.0 * math.sqrt(expected) + 4.0))


def expected_candidates(numel, size, rank):
    """About how many entries reach the rank-th largest of ``size`` sampled magnitudes."""
    return rank * numel / size


def sample_positions(numel, size):
    """``size`` sorted positions in ``[0, numel)`` spread by the golden ratio (no periodic bias), as
    an int64 NumPy array."""
    i = np.arange(size, dtype=np.float64)
    positions = (np.modf(i * _GOLDEN + 0.5)[0] * numel).astype(np.int64)
    return np.sort(np.clip(positions, 0, numel - 1))
