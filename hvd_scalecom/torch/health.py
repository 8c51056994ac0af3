"""The health check's measures in PyTorch (:mod:`hvd_scalecom.health` holds the schedule and the
decisions): shared by the Horovod compressor, the DDP hook and the simulator."""

import torch

from hvd_scalecom.health import Measures


def measure(reduced, indices, k):
    """:class:`Measures` of a check: ``reduced`` is ``P`` (the reduced ``p``, flat, any float dtype;
    a mean or a sum: the ratios are the same), ``indices`` the leader's ``I``, ``k = len(I)``.

    ``||P[I]||^2`` and ``||P[G]||^2`` sum their k squares (in float64) in ascending order, one after
    another, so that ranks holding the same ``P`` and ``I`` get the same bits (the fallback's decisions
    depend on them); ``G``'s is the same whichever of tied entries ``topk`` picks."""
    squares = reduced.detach().reshape(-1).to(torch.float64).square()
    indices = indices.reshape(-1).to(device=squares.device, dtype=torch.int64)
    top = torch.topk(squares, k, sorted=False).indices
    in_top = torch.zeros(squares.numel(), dtype=torch.bool, device=squares.device)
    in_top[top] = True
    return Measures(hits=int(in_top[indices].sum()), k=int(k), selected=ordered_sum(squares[indices]),
                    topk=ordered_sum(squares[top]), total=float(squares.sum()))


def ordered_sum(values):
    """The sum of ``values`` (float64) in ascending order, as a sequential (cumulative) sum: the same
    bits for the same multiset of values, whatever their order or the number of threads."""
    if values.numel() == 0:
        return 0.0
    return float(torch.cumsum(torch.sort(values.reshape(-1)).values, dim=0)[-1])
