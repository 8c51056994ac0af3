"""Qsparse-local-SGD's composed operators on the k kept values (Basu et al., NeurIPS 2019, Sec. 2).

``values`` holds ``Top_k(x)``'s non-zero entries, shape ``(..., k)`` (one row per worker). Each operator
returns what stands in for those entries; the positions stay those of the top-k.

* TopK: the values themselves.
* SignTopK ``= (||Top_k(x)||_1 / k) * sign(Top_k(x))``: one scale and k signs.
* QSGD-TopK ``= Q_s(Top_k(x)) / (1 + beta_{k,s})``, ``beta_{k,s} = min(k / s^2, sqrt(k) / s)``, where
  ``Q_s`` is QSGD's stochastic quantizer with ``s`` levels (Alistarh et al., NeurIPS 2017):
  ``Q_s(v)_i = ||v||_2 * sign(v_i) * xi_i / s`` with ``xi_i`` the integer level ``floor(s |v_i| / ||v||_2)``
  rounded up with probability equal to the remainder. The division by ``1 + beta_{k,s}`` makes the
  composition a contraction, which error compensation needs (their Lemma 1 / Corollary).
"""

import math

import torch


def _per_row(homogeneous, values):
    """``homogeneous(values)``, one value per row, for a function with ``f(a v) = a f(v)`` (a norm, a
    mean of |v|); a row whose result overflows though its entries are finite (a sum of squares or of
    |v| beyond the dtype's range) gets ``max|v| * f(v / max|v|)``, equal in exact arithmetic. Other
    rows keep the plain result, bit for bit."""
    out = homogeneous(values)
    overflowed = torch.isinf(out)
    if not bool(overflowed.any()):
        return out
    peak = values.abs().amax(dim=-1, keepdim=True)
    overflowed &= torch.isfinite(peak)
    peak = torch.where(overflowed, peak, torch.ones_like(peak))
    return torch.where(overflowed, peak * homogeneous(values / peak), out)


def _mean_abs(values):
    return values.abs().sum(dim=-1, keepdim=True) / values.shape[-1]


def _norm(values):
    return values.norm(dim=-1, keepdim=True)


def sign_top_k(values):
    """SignTopK on the kept values: ``(||v||_1 / k) * sign(v)`` per row."""
    return _per_row(_mean_abs, values) * torch.sign(values)


def qsgd_levels(values, levels, noise):
    """QSGD's integer levels ``xi`` (0..s) and the row norms ``||v||_2``.

    noise: uniform [0, 1) draws of ``values``' shape; the level rounds up where ``noise < remainder``.
    """
    norm = _per_row(_norm, values)
    scaled = values.abs() / torch.where(norm > 0, norm, torch.ones_like(norm)) * levels
    lower = scaled.floor()
    # |v| <= ||v|| in exact arithmetic, so xi <= s; near float underflow the computed norm can fall
    # below |v|, and a level above s would overflow the narrow integer it is sent as.
    return (lower + (noise < scaled - lower).to(values.dtype)).clamp_(max=levels), norm


def qsgd(values, levels, noise):
    """``Q_s(v) = ||v||_2 * sign(v) * xi / s`` per row (zero rows stay zero)."""
    xi, norm = qsgd_levels(values, levels, noise)
    return norm * torch.sign(values) * xi / levels


def qsgd_scale(k, levels):
    """``1 / (1 + beta_{k,s})`` with ``beta_{k,s} = min(k / s^2, sqrt(k) / s)``."""
    return 1.0 / (1.0 + min(k / levels**2, math.sqrt(k) / levels))


def qsgd_top_k(values, levels, noise):
    """QSGD-TopK on the kept values: ``Q_s(v) / (1 + beta_{k,s})``."""
    return qsgd(values, levels, noise) * qsgd_scale(values.shape[-1], levels)
