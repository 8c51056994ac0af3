"""Reproduce when torch's PowerSGD DDP hook fails on Gloo ("collective size mismatch"), 2 ranks.

    python scripts/ddp_powersgd_gloo.py            # every configuration below, one torchrun job each
    python scripts/ddp_powersgd_gloo.py --only mlp-64-512-256-bucket-0.2mb

Each configuration trains a small model for ``--steps`` steps under torchrun (Gloo, 2 processes)
with ``powerSGD_hook`` and prints one line: ``ok`` (every step done, weights equal on both ranks;
with the number of buckets DDP reduced in the last step),
``diverged`` (done, weights differ: reductions paired different tensors), ``error: ...`` (the
first Gloo or hook error), or ``hang`` (no end within ``--timeout`` s).

What it shows (see docs/ddp.md): ``powerSGD_hook`` issues its second and third allreduce (of P, then
of Q) from the callbacks of the previous one. On Gloo a callback runs on one of the process group's
threads when that collective completes, at a time no other rank shares; with two buckets or more,
one rank can issue bucket 1's first allreduce before bucket 0's P allreduce and the other rank
after, and Gloo pairs collectives by the order they were issued: sizes differ ("Received data size
doesn't match expected size") or the callbacks, waiting inside the group's threads, stall (a hang).
Whether the ranks' orders part is a matter of timing: small buckets whose reductions overlap fail.
"""

import argparse
import json
import os
import re
import subprocess
import sys

CONFIGS = {
    # name: (model layer widths, DDP options, PowerSGDState options); DDP's default buckets unless
    # bucket_cap_mb is given (its first bucket holds at most 1 MB)
    "mlp-1024-4096": ([1024, 4096, 10], {}, {"matrix_approximation_rank": 2}),
    "mlp-1024-4096-rank4-no-feedback": ([1024, 4096, 10], {}, {"matrix_approximation_rank": 4,
                                                               "use_error_feedback": False, "warm_start": False}),
    "mlp-1024-4096-bucket-1mb": ([1024, 4096, 10], {"bucket_cap_mb": 1}, {"matrix_approximation_rank": 2}),
    "mlp-64-256-256-batched": ([64, 256, 256, 10], {}, {"matrix_approximation_rank": 1,
                                                        "batch_tensors_with_same_shape": True}),
    "mlp-64-256-unused": ([64, 256, 10], {"find_unused_parameters": True}, {"matrix_approximation_rank": 1}),
    "mlp-64-512-256": ([64, 512, 256, 10], {}, {"matrix_approximation_rank": 1}),
    "mlp-64-512-256-bucket-0.2mb": ([64, 512, 256, 10], {"bucket_cap_mb": 0.2}, {"matrix_approximation_rank": 1}),
    "mlp-64-512-256-bucket-0.2mb-rank3-no-feedback": ([64, 512, 256, 10], {"bucket_cap_mb": 0.2},
                                                      {"matrix_approximation_rank": 3, "use_error_feedback": False,
                                                       "warm_start": False}),
    "mlp-64-512-256-bucket-0.2mb-start10": ([64, 512, 256, 10], {"bucket_cap_mb": 0.2},
                                            {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10}),
}


def worker(name, steps, timeout):
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    layers, ddp_options, hook_options = CONFIGS[name]
    faulthandler.dump_traceback_later(timeout, exit=True)  # a hang: every thread's stack, then exit
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    modules = []
    for fan_in, fan_out in zip(layers, layers[1:]):
        modules += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]  # (1-D biases: reduced uncompressed)
    model = torch.nn.Sequential(*modules[:-1])
    if ddp_options.get("find_unused_parameters"):
        body = model
        model = torch.nn.Module()
        model.body, model.unused = body, torch.nn.Linear(layers[0], layers[-1])  # unused: never called
        model.forward = body.forward
    ddp = DDP(model, **ddp_options)
    hook_options = {"start_powerSGD_iter": 2, **hook_options}
    buckets = set()  # bucket indices of the last step

    def counting_hook(state, bucket):
        buckets.add(bucket.index())
        return powerSGD_hook.powerSGD_hook(state, bucket)
    ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=None, **hook_options), counting_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        buckets.clear()
        x = torch.randn(16, layers[0], generator=gen)
        loss = ddp(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    if rank == 0:
        print("result " + json.dumps({"in_sync": all(torch.equal(g, flat) for g in gathered)}), flush=True)
        print(f"buckets {len(buckets)}", flush=True)
    dist.destroy_process_group()


def launch(name, steps, timeout):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", name, "--steps", str(steps), "--timeout", str(timeout)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return "hang"
    found = re.search(r'result (\{"in_sync": (true|false)\})', output)
    if found:
        buckets = re.search(r"buckets (\d+)", output)
        return (("ok" if json.loads(found.group(1))["in_sync"] else "diverged")
                + (f" ({buckets.group(1)} buckets a step)" if buckets else ""))
    mismatch = re.search(r"Received data size doesn't match expected size", output)
    if mismatch:
        sizes = re.search(r"op.preamble.length <= op.nbytes. (\d+ vs \d+)", output)
        return f"error: Gloo: Received data size doesn't match expected size ({sizes.group(1) if sizes else '?'})"
    if "Timeout (0:" in output:  # faulthandler's dump: no step ended in time
        waits = sorted(set(re.findall(r'line \d+ in (\w+)', output))
                       & {"wait", "unpack_uncompressed_tensors_and_allreduce_ps",
                          "compute_qs", "backward", "decompress"})
        return f"hang (stopped after --timeout; stacks in: {', '.join(waits)})"
    errors = [line.strip() for line in output.splitlines() if line.startswith("[rank") and "Error" in line]
    return "error: " + (errors[0][:200] if errors else f"exit {proc.returncode}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=sorted(CONFIGS), action="append")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--timeout", type=float, default=90, help="seconds a job may take")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.timeout)
    for name in args.only or CONFIGS:
        layers, ddp_options, hook_options = CONFIGS[name]
        print(f"{name:32s} layers {layers} ddp {ddp_options} powersgd {hook_options}: "
              f"{launch(name, args.steps, args.timeout)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
