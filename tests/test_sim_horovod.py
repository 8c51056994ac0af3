"""The simulator's ScaleCom against a real ``horovodrun -np 3`` job of the Horovod compressor.

The job is ``tests/workers/torch_scalecom.py`` (it records each rank's raw gradients, the gradients
the optimizer applied, the final weights and ``stats()``). Two checks per configuration:

* open loop: the job's raw per-rank gradients, fed to the simulator, give the job's applied gradients;
* closed loop: the simulator drives the same training itself (same model, seed, data, SGD) from
  gradients it computes at its own weights, and ends at the job's final weights.

Dense reductions sum in a different order under Horovod, so values agree to rounding, not bit for bit.
"""

import json

import numpy as np
import pytest
import torch
from jobs import add_run

from hvd_scalecom.sim import Dense, ScaleCom, Simulator

NAMES = ["hidden.weight", "hidden.bias", "out.weight", "out.bias"]
SIZE = 3
STEPS = 7


class Net(torch.nn.Module):
    """The worker's model (same layers, same construction order, so the same initial weights)."""

    def __init__(self):
        super().__init__()
        self.hidden = torch.nn.Linear(48, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def worker_batch(t, rank):
    """The worker's data for step t on ``rank`` (one backward pass per step)."""
    generator = torch.Generator().manual_seed(10000 * t + rank)
    x = torch.randn(16, 48, generator=generator)
    y = torch.randint(0, 10, (16,), generator=generator)
    return x, y


def scheme_for(opts):
    return ScaleCom(ratio=opts["ratio"], beta=opts["beta"], warmup_steps=opts.get("warmup_steps", 0),
                    min_numel=opts["min_numel"], leader=opts.get("leader", "cyclic"),
                    value_dtype=opts.get("value_dtype"), index_dtype=opts["index_dtype"],
                    pipelined=opts.get("pipelined", False))


CASES = {
    "cyclic-beta0.3-warmup": ({"ratio": 0.05, "beta": 0.3, "warmup_steps": 1, "min_numel": 600,
                               "steps": STEPS, "index_dtype": "int32"}, 1e-5, 1e-7),
    "staggered-beta1-fp16-int64": ({"ratio": 0.05, "beta": 1.0, "min_numel": 600, "steps": STEPS,
                                    "leader": "staggered", "value_dtype": "float16",
                                    "index_dtype": "int64"}, 2e-3, 5e-5),
    "cyclic-beta0.5-pipelined": ({"ratio": 0.05, "beta": 0.5, "warmup_steps": 1, "min_numel": 600,
                                  "steps": STEPS, "index_dtype": "int32", "pipelined": True}, 1e-5, 1e-7),
}


for case, (opts, _, _) in CASES.items():  # runs of the job torch_np3 (tests/jobs.py)
    add_run("torch_np3", f"simulator_{case}", "torch_scalecom.py", opts, ["test_simulator_reproduces_horovodrun"],
            timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_simulator_reproduces_horovodrun(horovod_jobs, case):
    opts, rtol, atol = CASES[case]
    results = horovod_jobs("torch_np3").completed(f"simulator_{case}")
    assert len(results) == SIZE

    # Open loop: the job's raw gradients through the simulator give the job's applied gradients.
    model = Net()
    sim = Simulator(scheme_for(opts), SIZE, model.named_parameters())
    index_bytes = 0  # over all steps: pipelined, the first compressed step exchanges its indices and the next's
    for t in range(STEPS):
        step = sim.step([[torch.from_numpy(r[f"raw/{t}/{n}"]) for n in NAMES] for r in results])
        index_bytes += step.traffic.step_traffic().index_bytes
        for n, update in zip(NAMES, step.update):
            for rank, r in enumerate(results):
                np.testing.assert_allclose(update.numpy(), r[f"applied/{t}/{n}"], rtol=rtol, atol=atol,
                                           err_msg=f"open loop, step {t}, {n}, rank {rank}")
    # Payload of the last step, as the compressor's stats() counts it on every rank.
    stats = json.loads(str(results[0]["stats"]))
    payload = step.traffic.step_traffic()
    assert stats["step"] == STEPS - 1
    for field in ("index_bytes", "value_bytes", "dense_bytes", "uncompressed_bytes", "tensors"):
        assert getattr(payload, field) == stats[field], field
    k_hidden, k_out = 154, 32  # ceil(0.05 * 3072), ceil(0.05 * 640)
    assert payload.index_bytes == (4 if opts["index_dtype"] == "int32" else 8) * (k_hidden + k_out)
    assert stats["total"]["index_bytes"] == index_bytes

    # Closed loop: the simulator trains the same model from the same seed on the same data.
    params = closed_loop(scheme_for(opts), check_against=results, rtol=rtol, atol=atol)
    for n, p in zip(NAMES, params):
        for rank, r in enumerate(results):
            np.testing.assert_allclose(p.numpy(), r[f"final/{n}"], rtol=rtol, atol=max(atol, 1e-6),
                                       err_msg=f"final weights, {n}, rank {rank}")
    # Control: dense SGD on the same data ends measurably elsewhere.
    dense = closed_loop(Dense())
    assert np.abs(dense[0].numpy() - results[0]["final/hidden.weight"]).max() > 1e-3


def closed_loop(scheme, check_against=None, rtol=0, atol=0):
    """Train the worker's model for STEPS steps in the simulator; returns the final weights."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sim = Simulator(scheme, SIZE, model.named_parameters())
    params = list(model.parameters())
    for t in range(STEPS):
        grads = []
        for rank in range(SIZE):
            x, y = worker_batch(t, rank)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            grads.append(list(torch.autograd.grad(loss, params)))
            for n, g in zip(NAMES, grads[-1] if check_against else []):
                np.testing.assert_allclose(g.numpy(), check_against[rank][f"raw/{t}/{n}"], rtol=rtol,
                                           atol=max(atol, 1e-7),
                                           err_msg=f"closed loop gradient, step {t}, {n}, rank {rank}")
        sim.step(grads).apply_to(params, optimizer)
    return [p.detach() for p in params]
