"""Which parameter a gradient belongs to: checking ``named_parameters``, finding the parameter whose
gradient Horovod hands to ``compress``, and refusing a gradient reduced twice. Used by every PyTorch
scheme (and ``named_parameter_list`` by the simulator)."""

import torch

_USAGE = "named_parameters must be an iterable of (name, parameter) pairs, such as model.named_parameters()"

def named_parameter_list(named_parameters, scheme):
    """``[(name, parameter)]`` from ``named_parameters``; TypeError/ValueError naming the problem."""
    if named_parameters is None or isinstance(named_parameters, (str, bytes, torch.Tensor)):
        raise TypeError(_USAGE)
    try:
        pairs = list(named_parameters)
    except TypeError:
        raise TypeError(_USAGE) from None
    if not pairs:
        raise ValueError("named_parameters is empty")
    names, ids = set(), set()
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_parameters must hold (str, torch.Tensor) pairs, got {pair!r:.80}")
        name, param = pair
        if name in names:
            raise ValueError(f"named_parameters has the name {name!r} twice")
        if id(param) in ids:
            raise ValueError(f"named_parameters has the parameter {name!r} under two names")
        if not param.dtype.is_floating_point:
            raise TypeError(f"named_parameters: {name!r} is {param.dtype}, {scheme} needs "
                            f"floating-point parameters")
        names.add(name)
        ids.add(id(param))
    return pairs


def handed_back(original, out):
    """What :func:`refuse_second_reduction` compares: the gradient handed to ``compress`` (``original``,
    a weak reference) as Horovod's ``p.grad.set_(out)`` leaves it, ``out``'s address and its version
    counter one ahead; None where that gradient is gone."""
    grad = original()
    return None if grad is None else (original, out.data_ptr(), grad._version + 1)


def refuse_second_reduction(handed_back, tensor, scheme, name, detail=""):
    """RuntimeError where ``tensor`` is the gradient of parameter ``name`` that ``scheme``'s last
    ``decompress`` gave back, unchanged (``handed_back``: what :func:`handed_back` recorded, or None). Horovod
    is then reducing it a second time, which would count as another step (``detail``: what it would do)."""
    if handed_back is None or handed_back[0]() is not tensor:
        return
    if (tensor.data_ptr(), tensor._version) == tuple(handed_back[1:]):
        raise RuntimeError(
            f"{scheme}: the gradient of {name!r} is the one {scheme}'s last decompress gave back, unchanged: "
            f"Horovod is reducing it a second time, which {scheme} would count as another step{detail}. "
            f"Either optimizer.step() came after optimizer.synchronize() outside optimizer.skip_synchronize() "
            f"(step inside `with optimizer.skip_synchronize():`), or the parameter has no gradient this step "
            f"and its old one was not cleared (call optimizer.zero_grad() every step). Nothing was changed")

class GradientLookup:
    """Which parameter a gradient handed to ``compress`` belongs to.

    Horovod calls ``compress(p.grad)`` without the name. ``p.grad is tensor`` identifies it; the order
    in which hooks fire is learned, so the usual lookup is one comparison. With
    ``sparse_as_dense=True`` Horovod hands over ``p.grad.to_dense()``: matched by shape among the
    parameters with sparse gradients (and by value if several share the shape).
    """

    def __init__(self, params, names, scheme):
        self.params, self.names, self.scheme = list(params), list(names), scheme
        self._after = {}
        self._last = None

    def index_of(self, tensor, not_yet=None):
        """The parameter index; ``not_yet(i)`` tells, among ambiguous sparse matches, which one has
        not been reduced in the current step."""
        guess = self._after.get(self._last)
        if guess is not None and self.params[guess].grad is tensor:
            index = guess
        else:
            index = next((i for i, p in enumerate(self.params) if p.grad is tensor), None)
            if index is None and any(p is tensor for p in self.params):
                raise ValueError(
                    f"{self.scheme} was handed a parameter, not its gradient: hvd.DistributedOptimizer "
                    f"was built with op=hvd.Adasum, which compresses parameter deltas. {self.scheme} "
                    f"compresses gradients; use op=hvd.Average or op=hvd.Sum.")
            if index is None:
                index = self._sparse_index_of(tensor, not_yet)
        if self._last is not None:
            self._after[self._last] = index
        self._last = index
        return index

    def _sparse_index_of(self, tensor, not_yet):
        candidates = [i for i, p in enumerate(self.params) if p.grad is not None and p.grad.is_sparse
                      and p.shape == tensor.shape]
        if len(candidates) > 1 and not_yet is not None:
            candidates = [i for i in candidates if not_yet(i)] or candidates
        if len(candidates) > 1:
            candidates = [i for i in candidates if torch.equal(self.params[i].grad.to_dense(), tensor)]
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise ValueError(f"{self.scheme} cannot tell which of {[self.names[i] for i in candidates]} "
                             f"this densified sparse gradient belongs to")
        raise ValueError(
            f"{self.scheme} was asked to compress a tensor of shape {tuple(tensor.shape)} that is not "
            f"the gradient of any parameter in named_parameters. Pass the model's named_parameters to "
            f"{self.scheme}.")

    def reset(self):
        self._after.clear()
        self._last = None
