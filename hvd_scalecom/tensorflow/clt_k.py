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

from hvd_scalecom import selection_rule
from hvd_scalecom.config import SELECTIONS


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
    """Step 2: flat indices (``index_dtype``, shape ``[k]``) of the ``k`` largest ``|p|``: ascending
    where "threshold" samples, so that the gathers and scatters at them walk memory forward; else
    unordered.

    ``"threshold"`` finds the same set as ``"exact"`` (ties aside) by the rule of
    :mod:`hvd_scalecom.selection_rule`: the threshold is a sampled magnitude a little below the k-th
    largest, and the exact top-k runs on the entries reaching it; if fewer than k do (or it is 0),
    on the whole tensor.
    """
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
    numel = int(p.shape[0])
    if k >= numel:
        return tf.range(numel, dtype=index_dtype)
    magnitude = tf.abs(p)

    def exact():
        return tf.math.top_k(magnitude, k, sorted=False, index_type=index_dtype).indices

    size, rank = selection_rule.sample_plan(numel, k)
    if selection == "exact" or not selection_rule.thresholded(numel, k) or rank >= size:
        return exact()
    sample = tf.gather(magnitude, tf.constant(selection_rule.sample_positions(numel, size)))
    threshold = tf.reduce_min(tf.math.top_k(sample, rank, sorted=False).values)  # the rank-th largest
    candidates = tf.cast(tf.reshape(tf.where(magnitude >= threshold), [-1]), index_dtype)

    def among_candidates():
        best = tf.math.top_k(tf.gather(magnitude, candidates), k, sorted=False, index_type=index_dtype)
        # In ascending order (candidates are; a mask over them restores it): later gathers and scatters
        # of the k entries then walk memory forward instead of at random.
        chosen = tf.raw_ops.SparseToDense(sparse_indices=best.indices,
                                          output_shape=tf.shape(candidates, out_type=index_dtype),
                                          sparse_values=True, default_value=False, validate_indices=False)
        return tf.gather(candidates, tf.reshape(tf.where(chosen), [-1]))

    too_few = tf.logical_or(tf.size(candidates) < k, tf.logical_not(threshold > 0))
    indices = tf.cond(too_few, exact, among_candidates)
    return tf.ensure_shape(indices, [k])


def take(memory, grad, indices):
    """Step 3 without a dense pass: ``(m[I], p[I])`` from k-sized gathers, in the memory's dtype.

    A memory variable is read densely first (no copy): a gather from the variable itself would put it
    in TensorFlow's copy-on-read mode, where every later dense read copies it whole."""
    memory_at_indices = tf.gather(tf.convert_to_tensor(memory), indices)
    g = tf.cast(tf.reshape(grad, [-1]), memory.dtype)
    return memory_at_indices, memory_at_indices + tf.gather(g, indices)


def filter_memory(memory, grad, indices, memory_at_indices, values, beta, sent_dtype):
    """Step 4 on the ``memory`` variable, with ``(m[I], p[I])`` from :func:`take` (read before).

    ``(1 - beta) m + beta (p - scatter(I, v))`` with ``p = m + g`` equals ``m + beta g`` off I and
    ``(1 - beta) m + beta (p - v)`` on I: one dense pass (``m += beta g``) plus a k-sized scatter;
    ``p`` is never materialised. ``p - v`` is zero unless the values travel in a narrower dtype
    (``sent_dtype``, e.g. fp16), whose rounding error then stays in the memory. Returns the last op.

    The dense pass is one op (``m - (-beta) g``: the bits of ``m + beta g``). The k-sized scatter puts
    the variable in TensorFlow's copy-on-read mode, where every dense read would copy it whole; the
    update ends by turning that off again.
    """
    g = tf.cast(tf.reshape(grad, [-1]), memory.dtype)
    kept = (1.0 - beta) * memory_at_indices
    sent_dtype = tf.as_dtype(sent_dtype)
    if sent_dtype != values.dtype:
        kept = kept + beta * (values - tf.cast(tf.cast(values, sent_dtype), values.dtype))
    tf.raw_ops.ResourceApplyGradientDescent(var=memory.handle, alpha=tf.constant(-beta, memory.dtype), delta=g)
    updated = memory.scatter_update(tf.IndexedSlices(kept, indices))
    with tf.control_dependencies([updated]):
        return tf.raw_ops.DisableCopyOnRead(resource=memory.handle)


def scatter_dense(values, indices, shape, dtype):
    """Step 5: a tensor of zeros of ``shape`` holding ``values`` at the flat ``indices`` (distinct, as
    a top-k's are; ``SparseToDense``, which checks their range, writes them several times faster
    than ``scatter_nd``)."""
    numel = math.prod(shape)
    flat = tf.raw_ops.SparseToDense(sparse_indices=indices, output_shape=tf.constant([numel], indices.dtype),
                                    sparse_values=tf.cast(values, dtype), default_value=tf.zeros([], dtype),
                                    validate_indices=False)
    return tf.reshape(flat, shape)
