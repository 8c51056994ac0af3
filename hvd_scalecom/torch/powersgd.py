"""PowerSGD's rank-r compression (Vogels, Karimireddy & Jaggi, NeurIPS 2019, Alg. 1), on torch tensors.

For a gradient reshaped to a matrix ``M`` (rows x cols) on every worker, with the shared ``Q`` (cols x r)
of the previous step (warm start):

1. ``P_i = M_i Q``; allreduce-average: ``P = mean_i P_i``          (:func:`left_factor`)
2. ``P_hat = orthogonalise(P)`` (Gram-Schmidt on the r columns)     (:func:`orthogonalise_`)
3. ``Q_i = M_i^T P_hat``; allreduce-average: ``Q = mean_i Q_i``     (:func:`right_factor`)
4. every worker applies ``P_hat Q^T``                              (:func:`approximation`)

With error feedback (their Alg. 2) ``M_i = g_i + e_i`` and ``e_i <- M_i - P_hat Q^T``. The functions take
leading batch dimensions, so the same code serves one worker or a stack of workers.
"""

import torch


def as_matrix(tensor_shape):
    """PowerSGD's matrix view of a parameter: ``(shape[0], prod(shape[1:]))``."""
    rows = tensor_shape[0]
    cols = 1
    for s in tensor_shape[1:]:
        cols *= s
    return rows, cols


def left_factor(M, Q):
    """Step 1 on each worker: ``M Q``, ``(..., rows, r)``."""
    return torch.matmul(M, Q)


def orthogonalise_(P):
    """Step 2 in place: Gram-Schmidt on the columns of ``P`` (``(..., rows, r)``), loop over r only.
    A column is divided by its own norm, with no epsilon added: the authors' code adds 1e-8, which
    makes the result depend on the gradients' scale (``P`` grows as the square of ``M`` under the
    warm start, so for entries near 1e-5 the 1e-8 dominates); a zero column stays zero."""
    r = P.shape[-1]
    for i in range(r):
        column = P[..., :, i:i + 1]
        norm = column.norm(dim=-2, keepdim=True)
        column.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
        if i + 1 < r:
            rest = P[..., :, i + 1:]
            rest.sub_(column * (column * rest).sum(dim=-2, keepdim=True))
    return P


def right_factor(M, P_hat):
    """Step 3 on each worker: ``M^T P_hat``, ``(..., cols, r)``."""
    return torch.matmul(M.transpose(-1, -2), P_hat)


def approximation(P_hat, Q):
    """Step 4: the rank-r matrix ``P_hat Q^T`` every worker applies."""
    return torch.matmul(P_hat, Q.transpose(-1, -2))
