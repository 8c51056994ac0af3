"""What the DDP hook's workers share: the models, each rank's deterministic data, and the training
loop the Horovod comparison runs alike under torchrun (DDP) and horovodrun (Horovod)."""

import torch


class Net(torch.nn.Module):
    """Two compressed weights (2,048 and 2,560 entries), two dense biases (64 and 40, below
    min_numel 100) and, with ``unused``, a layer the forward pass never uses (1,280 + 40)."""

    def __init__(self, unused=False):
        super().__init__()
        self.first = torch.nn.Linear(32, 64)
        self.second = torch.nn.Linear(64, 40)
        self.unused = torch.nn.Linear(32, 40) if unused else None

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def make_net(seed=0, unused=False, dtype=torch.float32):
    torch.manual_seed(seed)
    return Net(unused).to(dtype)


def batch(step, rank, micro=0, dtype=torch.float32, size=8):
    """Rank ``rank``'s inputs and targets at ``step`` (``micro``: the micro-batch of an accumulation)."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(size, 32, generator=gen)
    y = torch.randn(size, 40, generator=gen)
    return x.to(dtype), y.to(dtype)


def loss_of(model, step, rank, micro=0, dtype=torch.float32):
    x, y = batch(step, rank, micro, dtype)
    return (model(x) - y).float().square().mean()


# The Horovod comparison: both jobs train this model with these settings on the same data.
MATCH = {"ratio": 0.05, "beta": 0.3, "warmup_steps": 1, "min_numel": 100, "steps": 6, "lr": 0.1,
         "momentum": 0.9}


class HealthNet(torch.nn.Module):
    """The health check's model: each parameter's gradient is the input multiplied with it, so a test
    chooses every rank's gradients. ``a`` and ``b`` (400 and 300 entries) are compressed, ``bias`` (10)
    is dense."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(20, 20))
        self.b = torch.nn.Parameter(torch.zeros(12, 25))
        self.bias = torch.nn.Parameter(torch.zeros(10))

    def forward(self, ca, cb, cbias):
        return (self.a * ca).sum() + (self.b * cb).sum() + (self.bias * cbias).sum()


# At these steps the ranks' gradients of ``a`` are disjoint, and the leader's own entries small: its
# top-k misses the sum's (captured ~0). At the others every rank's gradient of ``a`` is large on the
# same 20 entries (captured ~1); ``b``'s always is (on its first 15).
HEALTH_LOW_STEPS = (1, 3)


def health_loss(model, step, rank, size):
    """Rank ``rank``'s loss at ``step``, whose gradients are those the comment above describes (the
    leader of ``a``, its first parameter, is ``step mod size`` with either leader rule)."""
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + 7)

    def large(n):
        return 1000 * (1 + 0.1 * torch.rand(n, generator=gen))
    ca = 0.01 * torch.randn(400, generator=gen)
    cb = 0.01 * torch.randn(300, generator=gen)
    cbias = torch.randn(10, generator=gen)
    if step in HEALTH_LOW_STEPS:
        ca[20 * rank:20 * rank + 20] += 1.0 if rank == step % size else large(20)
    else:
        ca[100:120] += large(20)
    cb[:15] += large(15)
    return model(ca.view(20, 20), cb.view(12, 25), cbias)
