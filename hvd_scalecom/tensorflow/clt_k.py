"""ScaleCom's equations on TensorFlow tensors (the TF twin of :mod:`hvd_scalecom.torch.clt_k`).

Notation of Chen et al. (NeurIPS 2020), Algorithm 1, for one tensor on rank i at step t:

1. ``p_i = m_i + g_i``                                     (error-compensated gradient)
2. ``I = top_k(|p_j|)`` on the leader j                     (CLT-k, :func:`select_top_k`; ``top_k(|m_j|)``
   where ``g_j`` is not finite, :func:`selection_source`)
3. ``v_i = p_i[I]``, averaged over ranks                    (:func:`take`)
4. ``m_i <- (1 - beta) m_i + beta (p_i - scatter(I, v_i))`` (low-pass filter, :func:`filter_memory`)
5. the update applies ``scatter(I, mean_i v_i)``            (:func:`scatter_dense`)

Every function builds ops on flat (1-D) tensors with static sizes, so it works eagerly and inside a
``tf.function`` alike; none loops over entries in Python.
"""

import math

import tensorflow as tf

# Tensors smaller than this always take the exact top-k (the sampled threshold does not pay off).
THRESHOLD_MIN_NUMEL = 65536
_THRESHOLD_SAMPLE = 16384


def memory_dtype(grad_dtype):
    """Residue memory is kept in at least fp32 (fp16/bf16 gradients get an fp32 memory)."""
    grad_dtype = tf.as_dtype(grad_dtype)
    return tf.float64 if grad_dtype == tf.float64 else tf.float32


def error_compensated(memory, grad):
    """Step 1: ``p = m + g``, flat, in the memory's dtype."""
    return memory + tf.cast(tf.reshape(grad, [-1]), memory.dtype)


def selection_source(memory, grad, finite):
    """What the leader's step 2 selects from: ``p = m + g`` (:func:`error_compensated`), or ``m``
    where ``g`` holds a NaN or Inf (``finite``, a boolean scalar, false; the caller has it already).
    Such a leader sends NaN, so every rank keeps its memory: ``m`` is what the step leaves, and
    ``top_k(|m + g|)`` is not defined (as :func:`hvd_scalecom.torch.clt_k.selection_of_nonfinite`)."""
    return tf.cond(finite, lambda: error_compensated(memory, grad), lambda: tf.identity(memory))


def select_top_k(p, k, selection="exact", index_dtype=tf.int32):
    """Step 2: flat indices (``index_dtype``, shape ``[k]``) of the ``k`` largest ``|p|``, unordered.

    ``"threshold"`` finds the same set as ``"exact"`` (ties aside): it estimates the k-th largest
    magnitude from a strided sample, keeps the entries at or above a slightly lower threshold and runs
    the exact top-k on those candidates only; if too few entries pass, it falls back to the exact one.
    """
    numel = int(p.shape[0])
    if k >= numel:
        return tf.range(numel, dtype=index_dtype)
    magnitude = tf.abs(p)
    if selection == "exact" or numel < THRESHOLD_MIN_NUMEL:
        return tf.math.top_k(magnitude, k, sorted=False, index_type=index_dtype).indices
    if selection != "threshold":
        raise ValueError(f"selection must be 'exact' or 'threshold', got {selection!r}")
    stride = numel // _THRESHOLD_SAMPLE
    sample = magnitude[::stride]
    sample_size = int(sample.shape[0])
    want = min(sample_size, max(1, math.ceil(1.3 * k * sample_size / numel) + 2))
    threshold = tf.reduce_min(tf.math.top_k(sample, want, sorted=False).values)
    candidates = tf.cast(tf.reshape(tf.where(magnitude >= threshold), [-1]), index_dtype)

    def exact():
        return tf.math.top_k(magnitude, k, sorted=False, index_type=index_dtype).indices

    def among_candidates():
        best = tf.math.top_k(tf.gather(magnitude, candidates), k, sorted=False, index_type=index_dtype)
        return tf.gather(candidates, best.indices)

    indices = tf.cond(tf.size(candidates) < k, exact, among_candidates)
    return tf.ensure_shape(indices, [k])


def take(memory, grad, indices):
    """Step 3 without a dense pass: ``(m[I], p[I])`` from k-sized gathers, in the memory's dtype."""
    memory_at_indices = tf.gather(memory, indices)
    g = tf.cast(tf.reshape(grad, [-1]), memory.dtype)
    return memory_at_indices, memory_at_indices + tf.gather(g, indices)


def filter_memory(memory, grad, indices, memory_at_indices, values, beta, sent_dtype):
    """Step 4 on the ``memory`` variable, with ``(m[I], p[I])`` from :func:`take` (read before).

    ``(1 - beta) m + beta (p - scatter(I, v))`` with ``p = m + g`` equals ``m + beta g`` off I and
    ``(1 - beta) m + beta (p - v)`` on I: one dense pass (``m += beta g``) plus a k-sized scatter;
    ``p`` is never materialised. ``p - v`` is zero unless the values travel in a narrower dtype
    (``sent_dtype``, e.g. fp16), whose rounding error then stays in the memory. Returns the last op.
    """
    g = tf.cast(tf.reshape(grad, [-1]), memory.dtype)
    memory.assign_add(beta * g)
    kept = (1.0 - beta) * memory_at_indices
    sent_dtype = tf.as_dtype(sent_dtype)
    if sent_dtype != values.dtype:
        kept = kept + beta * (values - tf.cast(tf.cast(values, sent_dtype), values.dtype))
    return memory.scatter_update(tf.IndexedSlices(kept, indices))


def scatter_dense(values, indices, shape, dtype):
    """Step 5: a tensor of zeros of ``shape`` holding ``values`` at the flat ``indices``."""
    numel = math.prod(shape)
    flat = tf.scatter_nd(tf.expand_dims(indices, 1), tf.cast(values, dtype),
                         tf.constant([numel], dtype=indices.dtype))
    return tf.reshape(flat, shape)
