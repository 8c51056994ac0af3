"""Horovod (PyTorch) calls the schemes share: checking a process set, comparing configurations across
ranks, and waiting for an asynchronous collective with Horovod's stall warnings and time limit."""

import hashlib
import os
import re
import sys
import time

import torch

from hvd_scalecom import agreement


def check_process_set(process_set):
    """``process_set`` unchanged if it is None or a ``horovod.torch.ProcessSet``, else TypeError."""
    from horovod.torch import ProcessSet
    if process_set is not None and not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a horovod.torch.ProcessSet or None, "
                        f"got {type(process_set).__name__}")
    return process_set

def tensors_digest(tensors):
    """A short digest of the tensors' values (bit for bit)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def check_agreement(scheme, summary, process_set=None, hints=None, stall=(None, None)):
    """Every rank hands in its ``summary`` (a JSON-able dict); all ranks raise the same ValueError,
    naming the keys that differ and each rank's values, when the summaries differ
    (:mod:`hvd_scalecom.agreement`).

    Blocking: call it at a point every rank reaches without waiting on anything else (the first
    ``compress`` of a step, the first ``step()``). ``hints``: ``{key: sentence}`` added to the message
    when that key differs. ``stall``: as :func:`wait`, for a rank that never comes.
    """
    import horovod.torch as hvd

    local = torch.frombuffer(bytearray(agreement.encode(summary)), dtype=torch.uint8)
    kwargs = {} if process_set is None else {"process_set": process_set}
    prefix = f"{scheme.lower()}.agreement"
    what = (f"every rank's {scheme} configuration (compared at the first step). A rank that never "
            f"reduces through {scheme} keeps the others here: e.g. one outside the optimizer's "
            f"process_set when {scheme} was given a different one or none (pass it the optimizer's process_set)")
    sizes = wait(hvd.allgather_async(torch.tensor([local.numel()]), name=f"{prefix}.sizes", **kwargs),
                 stall, scheme, what)
    gathered = wait(hvd.allgather_async(local, name=prefix, **kwargs), stall, scheme, what)
    agreement.check_gathered(scheme, [c.numpy().tobytes() for c in torch.split(gathered, sizes.tolist())],
                             hints)


def stall_times(timeout=None):
    """(warning interval, time limit) in seconds, None for never: Horovod's own stall settings
    (``HOROVOD_STALL_CHECK_TIME_SECONDS``, 60, and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, integers;
    ``HOROVOD_STALL_CHECK_DISABLE`` above 0 turns both off), read as Horovod reads them, ``timeout``
    taking precedence over the latter. ValueError naming the variable where one is not an integer."""
    disabled = _leading_int(os.environ.get("HOROVOD_STALL_CHECK_DISABLE", "")) > 0  # (strtol: "false" is 0)
    check = _stall_setting("HOROVOD_STALL_CHECK_TIME_SECONDS", 60)
    shutdown = _stall_setting("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0)
    warn_every = None if disabled or check <= 0 else float(check)
    limit = timeout if timeout is not None else (float(shutdown) if shutdown > 0 and not disabled else None)
    return warn_every, limit


def _leading_int(text):
    """The integer ``text`` starts with, 0 if none (C's strtol, as Horovod reads a flag)."""
    match = re.match(r"\s*([+-]?\d+)", text)
    return int(match.group(1)) if match else 0


def _stall_setting(variable, default):
    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{variable} must be an integer number of seconds (as Horovod reads it), "
                         f"got {text!r}") from None


# wait() polls without sleeping for this long first, yielding the CPU between polls as Horovod's own
# synchronize() does: a sleep of 1e-4 s lasts about 0.25 ms here, and most exchanges complete within
# a few of Horovod's cycles (python -m benchmarks.per_tensor, docs/performance.md).
_SPIN_SECONDS = 0.005


def wait(handle, stall, scheme, what, advice=""):
    """The result of Horovod's async ``handle``, printing ``"<scheme> warning: still waiting after N s
    for <what>. <advice>"`` every ``stall[0]`` seconds while it is late and raising RuntimeError after
    ``stall[1]`` (:func:`stall_times`; None: never), as Horovod's stall check does for its own."""
    import horovod.torch as hvd

    warn_every, limit = stall
    start = warned = time.monotonic()
    while not hvd.poll(handle):
        now = time.monotonic()
        if limit is not None and now - start > limit:
            raise RuntimeError(f"{scheme}: still waiting after {limit:g} s for {what}.")
        if warn_every is not None and now - warned > warn_every:
            warned = now
            print(f"{scheme} warning: still waiting after {now - start:.0f} s for {what}. {advice}".rstrip(),
                  file=sys.stderr, flush=True)
        if now - start > _SPIN_SECONDS:
            time.sleep(1e-4)
        else:
            os.sched_yield()
    return hvd.synchronize(handle)
