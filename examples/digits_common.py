"""What the two digits examples share: argument checks and the steps per epoch."""

import argparse


def positive_int(text):
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


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
