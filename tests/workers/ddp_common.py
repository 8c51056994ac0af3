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
