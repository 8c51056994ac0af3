"""Train an MLP (167k parameters) on scikit-learn's handwritten digits with ScaleCom and Horovod.

    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_scalecom.py --compression scalecom

Each worker trains on its shard of the 1,437 training images; accuracy is measured on the 360 held-out
ones. Rank 0 prints per-epoch loss, test accuracy and the gradient bytes this rank handed to Horovod
per step against what dense SGD would have sent.
"""

import argparse
import json
import os
import sys
import time

import horovod.torch as hvd
import torch
from digits_common import (
    add_scalecom_arguments,
    check_scalecom_arguments,
    check_trained_with,
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
    trained_with,
)

from hvd_scalecom.torch import ScaleCom, log_stats


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--compression", choices=["scalecom", "dense", "fp16"], default="scalecom")
    add_scalecom_arguments(ap, ["float32", "float16"])
    ap.add_argument("--pipelined", action="store_true", help="indices selected one step ahead")
    ap.add_argument("--epochs", type=positive_int, default=25)
    # batch 16 and lr 0.0125 per worker (0.05 at 4 workers): at ratio 0.01 the residue memory sends
    # held-back gradient in bursts that momentum 0.9 amplifies, and 0.2 at 4 workers diverged; the
    # smaller batch gives ScaleCom twice the steps in the same epochs
    ap.add_argument("--batch-size", type=positive_int, default=16,
                    help="per worker, at most its shard of the 1,437 training images")
    ap.add_argument("--lr", type=learning_rate, default=0.0125, help="per worker (see --lr-scaling)")
    ap.add_argument("--lr-scaling", choices=["linear", "sqrt"], default="linear",
                    help="learning rate = lr x workers (linear) or lr x sqrt(workers)")
    ap.add_argument("--momentum", type=momentum_value, default=0.9)
    ap.add_argument("--seed", type=seed_value, default=0)
    ap.add_argument("--result", type=result_path, help="rank 0 writes final figures here as JSON")
    ap.add_argument("--tensorboard", metavar="DIR", help="rank 0 logs loss, accuracy and stats() here")
    ap.add_argument("--progress", action="store_true", help="a progress bar per epoch (rank 0)")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="save a checkpoint here after every epoch (each rank its own file)")
    ap.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    args = ap.parse_args(argv)
    if args.resume and not args.checkpoint:
        ap.error("--resume needs --checkpoint DIR")
    check_scalecom_arguments(ap, args)
    if args.fallback is not None and args.pipelined:
        ap.error("--fallback needs exact ScaleCom (without --pipelined)")
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = digits_split()
    shard_x, shard_y = x_train[rank::size], y_train[rank::size]
    steps_per_epoch = epoch_steps(len(x_train), args.batch_size, size, rank, args.compression)
    model = make_model()

    if args.compression == "scalecom":
        compression = ScaleCom(model.named_parameters(), ratio=args.ratio, beta=args.beta,
                               warmup_steps=args.warmup_steps, min_numel=args.min_numel,
                               leader=args.leader, selection=args.selection,
                               value_dtype=args.value_dtype, index_dtype=args.index_dtype,
                               pipelined=args.pipelined, check_every=args.check_every, fallback=args.fallback,
                               min_captured=args.min_captured)
    elif args.compression == "fp16":
        compression = hvd.Compression.fp16
    else:
        compression = hvd.Compression.none
    lr = args.lr * (size if args.lr_scaling == "linear" else size ** 0.5)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    sent_by_dtype = {"fp16": dense_bytes // 2}.get(args.compression, dense_bytes)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{args.compression}: {size} workers, {n_params:,} parameters, "
              f"{steps_per_epoch} steps per epoch", flush=True)
    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)
    start = time.perf_counter()
    global_step, first_epoch = 0, 0
    if args.resume:
        first_epoch, global_step = load_checkpoint(args.checkpoint, rank, model, optimizer,
                                                   compression, trained_with(args, size), gen)
        if first_epoch >= args.epochs:
            raise SystemExit(f"--epochs {args.epochs}: the checkpoint in {args.checkpoint} has trained "
                             f"{first_epoch} epochs already; ask for more to resume")
    for epoch in range(first_epoch, args.epochs):
        model.train()
        order = torch.randperm(len(shard_x), generator=gen)
        total_loss = 0.0
        steps = range(steps_per_epoch)
        if args.progress and rank == 0:
            from tqdm import tqdm
            steps = tqdm(steps, desc=f"epoch {epoch + 1}", leave=False, file=sys.stdout)
        for step in steps:
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(shard_x[batch]), shard_y[batch])
            loss.backward()
            optimizer.step()
            total_loss += loss.item()
            global_step += 1
            if writer is not None and args.compression == "scalecom":
                log_stats(writer, compression, global_step)
        mean_loss = hvd.allreduce(torch.tensor(total_loss / steps_per_epoch), name="epoch_loss").item()
        accuracy = evaluate(model, x_test, y_test)
        health = None
        if args.compression == "scalecom":
            last, total = compression.stats(), compression.stats()["total"]
            health = health_figures(last)
            sent = last["sent_bytes"]  # (nothing at all with one process: then 1x)
            reduction = total["uncompressed_bytes"] / total["sent_bytes"] if total["sent_bytes"] else 1.0
        else:
            sent, reduction = sent_by_dtype, dense_bytes / sent_by_dtype
        if writer is not None:
            writer.add_scalar("train/loss", mean_loss, global_step)
            writer.add_scalar("test/accuracy", accuracy, global_step)
        if args.checkpoint:
            save_checkpoint(args.checkpoint, rank, epoch + 1, global_step, model, optimizer,
                            compression, trained_with(args, size), gen)
        if rank == 0:
            print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {mean_loss:.4f}  test accuracy "
                  f"{100 * accuracy:6.2f}%  gradient bytes/step {sent:9,} vs dense {dense_bytes:,} "
                  f"({reduction:5.1f}x fewer over the run)", flush=True)
            if health:
                print(health_line(health), flush=True)
    if writer is not None:
        writer.close()
    if rank == 0:
        result = {"compression": args.compression, "workers": size, "accuracy": accuracy,
                  "loss": mean_loss, "sent_bytes_last_step": sent, "dense_bytes_per_step": dense_bytes,
                  "reduction": reduction, "seconds": time.perf_counter() - start,
                  "steps": args.epochs * steps_per_epoch, "epochs": args.epochs}
        if health:
            result["health"] = health
        print("result " + json.dumps(result), flush=True)
        if args.result:
            with open(args.result, "w") as f:
                json.dump(result, f)


def save_checkpoint(directory, rank, epoch, global_step, model, optimizer, compression, record, gen):
    """What a resumable checkpoint holds, per rank: the model and optimizer (momentum) state, the
    position in training and the data order, and ScaleCom's state (this rank's residue memory and
    step counters: every rank's memory differs, so every rank writes its own file), and ``record``,
    the arguments it trained with (``digits_common.trained_with``)."""
    os.makedirs(directory, exist_ok=True)
    state = {"epoch": epoch, "global_step": global_step, "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "data_order": gen.get_state(),
             "compression": compression.state_dict() if isinstance(compression, ScaleCom) else None,
             "trained_with": record}
    torch.save(state, os.path.join(directory, f"rank{rank}.pt"))


def load_checkpoint(directory, rank, model, optimizer, compression, record, gen):
    """Restore what :func:`save_checkpoint` wrote for this rank; returns (epoch, global step). A
    checkpoint trained with other arguments than ``record`` says (another --compression, or another
    --lr, --momentum, --lr-scaling or number of workers, which the restored optimizer would
    silently keep) is refused."""
    state = torch.load(os.path.join(directory, f"rank{rank}.pt"), weights_only=False)
    check_trained_with(state.get("trained_with", {}), record, directory)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["data_order"])
    if isinstance(compression, ScaleCom):
        compression.load_state_dict(state["compression"])
    return state["epoch"], state["global_step"]


if __name__ == "__main__":
    sys.exit(main())
