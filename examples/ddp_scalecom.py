"""Train an MLP (167k parameters) on scikit-learn's handwritten digits with DistributedDataParallel
and a communication hook: ScaleCom (hvd_scalecom.ddp), dense, fp16 or PyTorch's PowerSGD.

    python -m torch.distributed.run --standalone --nproc_per_node 2 examples/ddp_scalecom.py --compression scalecom

Each worker trains on its shard of the 1,437 training images; accuracy is measured on the 360 held-out
ones. Rank 0 prints per-epoch loss, test accuracy and the gradient bytes this rank handed to
torch.distributed's collectives per step (counted in the calls themselves, for every hook alike:
``dense`` is torch's ``allreduce_hook``, DDP's own reduction written as a hook) against dense; with
``--check-every N`` also ScaleCom's health check (docs/ddp.md), with ``--fallback dense`` its fallback.
"""

import argparse
import functools
import json
import sys
import time

import torch
import torch.distributed as dist
from digits_common import (
    add_scalecom_arguments,
    check_scalecom_arguments,
    digits_split,
    epoch_steps,
    evaluate,
    health_figures,
    health_line,
    learning_rate,
    make_model,
    momentum_value,
    positive_int,
    result_path,
    seed_value,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from hvd_scalecom.ddp import ScaleComState, scalecom_hook
from hvd_scalecom.torch import log_stats


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--compression", choices=["scalecom", "dense", "fp16", "powersgd"], default="scalecom")
    add_scalecom_arguments(ap, ["float32", "float16", "bfloat16"])
    ap.add_argument("--powersgd-rank", type=positive_int, default=1, help="PowerSGD's matrix_approximation_rank")
    ap.add_argument("--powersgd-start", type=positive_int, default=2,
                    help="PowerSGD's start_powerSGD_iter (at least 2 with its error feedback)")
    ap.add_argument("--epochs", type=positive_int, default=25)
    ap.add_argument("--batch-size", type=positive_int, default=16,
                    help="per worker, at most its shard of the 1,437 training images")
    ap.add_argument("--lr", type=learning_rate, default=0.0125, help="per worker (x workers)")
    ap.add_argument("--momentum", type=momentum_value, default=0.9)
    ap.add_argument("--seed", type=seed_value, default=0)
    ap.add_argument("--result", type=result_path, help="rank 0 writes final figures here as JSON")
    ap.add_argument("--tensorboard", metavar="DIR", help="rank 0 logs loss, accuracy and ScaleCom's stats() here")
    args = ap.parse_args(argv)
    check_scalecom_arguments(ap, args)
    return args








class CollectiveBytes:
    """Counts the bytes of the tensors handed to torch.distributed's broadcast and all_reduce (what
    the hooks here call), by wrapping those two functions for the run."""

    def __init__(self):
        self.count = 0
        for name in ("broadcast", "all_reduce"):
            setattr(dist, name, self._counting(getattr(dist, name)))

    def _counting(self, collective):
        @functools.wraps(collective)
        def call(tensor, *args, **kwargs):
            self.count += tensor.numel() * tensor.element_size()
            return collective(tensor, *args, **kwargs)
        return call


def register(args, ddp, model):
    """The hook of ``--compression`` on ``ddp``; returns its state."""
    if args.compression == "scalecom":
        state = ScaleComState(ratio=args.ratio, beta=args.beta, warmup_steps=args.warmup_steps,
                              min_numel=args.min_numel, leader=args.leader, selection=args.selection,
                              value_dtype=args.value_dtype, index_dtype=args.index_dtype,
                              check_every=args.check_every, fallback=args.fallback, min_captured=args.min_captured,
                              named_parameters=model.named_parameters())
        ddp.register_comm_hook(state, scalecom_hook)
    elif args.compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        state = None
        ddp.register_comm_hook(state, default_hooks.fp16_compress_hook if args.compression == "fp16"
                               else default_hooks.allreduce_hook)
    return state


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    counter = CollectiveBytes()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = digits_split()
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    steps_per_epoch = epoch_steps(len(x_train), args.batch_size, size, rank, "dense")
    model = make_model()
    ddp = DDP(model)  # (broadcasts rank 0's weights)
    state = register(args, ddp, model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr * size, momentum=args.momentum)
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if rank == 0:
        print(f"{args.compression}: {size} workers, {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{steps_per_epoch} steps per epoch", flush=True)
    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)
    start = time.perf_counter()
    global_step, sent_total = 0, 0
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(shard_x), generator=gen)
        total_loss = 0.0
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(shard_x[batch]), shard_y[batch])
            before = counter.count
            loss.backward()
            sent = counter.count - before
            sent_total += sent
            optimizer.step()
            total_loss += loss.item()
            global_step += 1
            if writer is not None and args.compression == "scalecom":
                log_stats(writer, state, global_step)
        mean_loss = torch.tensor(total_loss / steps_per_epoch)
        dist.all_reduce(mean_loss)  # (outside the backward pass: not counted)
        mean_loss = mean_loss.item() / size
        accuracy = evaluate(model, x_test, y_test)
        reduction = dense_bytes * global_step / sent_total
        if writer is not None:
            writer.add_scalar("train/loss", mean_loss, global_step)
            writer.add_scalar("test/accuracy", accuracy, global_step)
        health = health_figures(state.stats()) if isinstance(state, ScaleComState) else None
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy "
                  f"{100 * accuracy:6.2f}%  gradient bytes/step {sent:9,} vs dense {dense_bytes:,} "
                  f"({reduction:5.1f}x fewer over the run)", flush=True)
            if health:
                print(health_line(health), flush=True)
    if writer is not None:
        writer.close()
    if rank == 0:
        result = {"compression": args.compression, "workers": size, "accuracy": accuracy, "loss": mean_loss,
                  "sent_bytes_last_step": sent, "sent_bytes_total": sent_total,
                  "dense_bytes_per_step": dense_bytes, "reduction": reduction,
                  "seconds": time.perf_counter() - start, "steps": global_step, "epochs": args.epochs}
        if args.compression == "powersgd":
            result["powersgd_rank"] = args.powersgd_rank
        if health:
            result["health"] = health
        print("result " + json.dumps(result), flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
