"""What the digits examples share: argument checks, the steps per epoch, what a checkpoint records of
the run that trained it, and the PyTorch examples' data, model and evaluation."""

import argparse
import math
import os


def positive_int(text):
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonnegative_int(text):
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def fraction(text):
    """argparse type: a float in (0, 1] (ScaleCom's ratio and beta; checked here, not by every rank's
    traceback from the compressor once Horovod has started)."""
    value = float(text)
    if not 0 < value <= 1:  # (false for nan)
        raise argparse.ArgumentTypeError(f"must be a number > 0 and <= 1, got {text}")
    return value


def learning_rate(text):
    """argparse type: a finite float > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def momentum_value(text):
    """argparse type: a float in [0, 1) (SGD's velocity must decay: at 1 or more it never does)."""
    value = float(text)
    if not 0 <= value < 1:  # (false for nan)
        raise argparse.ArgumentTypeError(f"must be a number >= 0 and < 1, got {text}")
    return value


def seed_value(text):
    """argparse type: an int in [0, 2**32 - 1] (what numpy's seeding takes)."""
    value = int(text)
    if not 0 <= value <= 2 ** 32 - 1:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to 2**32 - 1, got {text}")
    return value


def result_path(text):
    """argparse type: a file path whose directory exists (checked before training, not after)."""
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory} does not exist")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it")
    return text


def epoch_steps(train_images, batch_size, size, rank, compression):
    """Batches per epoch on every rank: from the smallest shard (shards of ``train_images[rank::size]``
    differ by up to one image, and ranks taking different numbers of steps would wait for each
    other's collectives). SystemExit where ``batch_size`` exceeds that shard; with one process,
    a note that no gradient is compressed (Horovod reduces nothing)."""
    smallest_shard = train_images // size
    if batch_size > smallest_shard:
        raise SystemExit(f"--batch-size {batch_size} is larger than the smallest worker's shard of "
                         f"{smallest_shard} training images at {size} workers")
    if size == 1 and compression != "dense" and rank == 0:
        print("note: with one process Horovod reduces nothing, so no gradient is compressed "
              "(run under horovodrun -np 2 or more)", flush=True)
    return smallest_shard // batch_size


def trained_with(args, size):
    """What a checkpoint records of the run that trained it, by argument: --compression (a resume
    with another would drop ScaleCom's memories, or miss them) and what sets the optimizer (which
    the checkpoint restores): --lr, --momentum, --lr-scaling where the example has it, and -np, the
    number of workers that scales the learning rate."""
    record = {"--compression": args.compression, "--lr": args.lr, "--momentum": args.momentum}
    if hasattr(args, "lr_scaling"):
        record["--lr-scaling"] = args.lr_scaling
    record["-np"] = size
    return record


def check_trained_with(saved, current, directory):
    """SystemExit naming each argument whose value in ``current`` differs from the checkpoint's
    record ``saved`` (both :func:`trained_with`), with both values. A record lacking an argument
    passes it; a bare string is an older checkpoint's --compression."""
    if isinstance(saved, str):
        saved = {"--compression": saved}
    differ = [name for name in current if name in saved and saved[name] != current[name]]
    if differ:
        now = ", ".join(f"{name} {current[name]}" for name in differ)
        then = ", ".join(f"{name} {saved[name]}" for name in differ)
        raise SystemExit(f"{now}: the checkpoint in {directory} was trained with {then}; resume with "
                         f"{'that' if len(differ) == 1 else 'those'}")


def digits_split():
    """Standardised digits as torch tensors: the first 1,437 images train, the last 360 test (no
    download)."""
    import torch
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5) / 0.5
    return (torch.tensor(x[:1437], dtype=torch.float32), torch.tensor(y[:1437]),
            torch.tensor(x[1437:], dtype=torch.float32), torch.tensor(y[1437:]))


def make_model():
    """The PyTorch examples' MLP: 64-512-256-10, 167,178 parameters."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def evaluate(model, x, y):
    """Test accuracy of ``model`` on ``(x, y)``."""
    import torch

    model.eval()
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def add_scalecom_arguments(ap, value_dtypes):
    """The ScaleCom options every example shares (``value_dtypes``: the choices of --value-dtype)."""
    ap.add_argument("--ratio", type=fraction, default=0.01)
    ap.add_argument("--beta", type=fraction, default=0.5)
    ap.add_argument("--warmup-steps", type=nonnegative_int, default=0)
    ap.add_argument("--min-numel", type=nonnegative_int, default=1024)
    ap.add_argument("--leader", choices=["cyclic", "staggered"], default="cyclic")
    ap.add_argument("--selection", choices=["exact", "threshold"], default="threshold")
    ap.add_argument("--value-dtype", choices=value_dtypes, default=None)
    ap.add_argument("--index-dtype", choices=["int32", "int64"], default="int32")
    ap.add_argument("--check-every", type=positive_int, default=None,
                    help="the health check: one compressed step in N also reduces p densely and measures how "
                         "much of the global top-k's energy the leader's indices carry (stats()['health'])")
    ap.add_argument("--fallback", choices=["dense"], default=None,
                    help="send a parameter densely while its checks stay below --min-captured (needs --check-every)")
    ap.add_argument("--min-captured", type=fraction, default=0.5)


def health_figures(stats):
    """ScaleCom's health check over every parameter (``stats["health"]`` without ``by_tensor``), or
    None without ``--check-every``."""
    health = stats.get("health")
    return None if health is None else {k: v for k, v in health.items() if k != "by_tensor"}


def health_line(health):
    """One line of :func:`health_figures` for the epoch's report."""
    return (f"  health check: captured {health.get('captured', 1.0):.3f}, overlap {health.get('overlap', 1.0):.3f}, "
            f"{health['dense_tensors']} tensors sent densely now, {health['checks']} checks and "
            f"{health['dense_steps']} dense tensor-steps so far")


def check_scalecom_arguments(ap, args):
    """Refuses (``ap.error``) ScaleCom options that do not go together."""
    if args.fallback is not None and args.check_every is None:
        ap.error(f"--fallback {args.fallback} needs --check-every (the checks decide when to fall back)")
