"""One bucket's step of ScaleCom's DDP communication hook (:mod:`hvd_scalecom.ddp` states the
equations and the hook's contract): :class:`BucketStep` selects, exchanges the indices, reduces the
values and writes the bucket's buffer; :class:`Issuer` keeps every rank's collectives of a step in one
order (bucket 0's indices, bucket 0's values, bucket 1's indices, ...), whichever thread gets there
first."""

import threading
import time

import torch
import torch.distributed as dist

from hvd_scalecom.config import INT32_INDEX_MAX_NUMEL
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.health import measure

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int64": torch.int64}


class Issuer:
    """Issues one step's collectives in a fixed order on every rank: ``submit(seq, launch)`` runs
    ``launch`` once every ``launch`` of a lower ``seq`` has run, on whichever thread completes the
    sequence (the hook's, or a collective's callback), never two at once. :meth:`wait_issued` lets
    the last bucket's hook return only once all of the step's collectives are issued: DDP issues
    collectives of its own right after it (``find_unused_parameters``, a static graph's first
    step), which must find ours issued before them on every rank."""

    def __init__(self, t):
        self.t = t
        self.buckets = 0  # buckets of this step met so far (the hook meets them in the same order everywhere)
        self._ready = {}
        self._next = 0
        self._running = False
        self._failed = None
        self._changed = threading.Condition()

    def submit(self, seq, launch):
        with self._changed:
            self._ready[seq] = launch
            if self._running:
                return  # the thread running the sequence takes it (a callback run inside a launch, too)
            self._running = True
        while True:
            with self._changed:
                launch = self._ready.pop(self._next, None)
                if launch is None:
                    self._running = False
                    self._changed.notify_all()
                    return
            try:
                launch()
            except BaseException as error:
                self.fail(error)
                raise
            with self._changed:
                self._next += 1

    def fail(self, error):
        with self._changed:
            self._running = False
            self._failed = error
            self._changed.notify_all()

    def wait_issued(self, count):
        """Wait until the first ``count`` launches have run (or one failed: its error is raised)."""
        with self._changed:
            self._changed.wait_for(lambda: self._next >= count or self._failed is not None)
            if self._failed is not None:
                raise self._failed


class _Compressed:
    """One compressed parameter of a bucket at one step: its gradient (a flat view of the bucket's
    buffer), memory, k, leader; how it travels (``check``: a check step of the health check;
    ``dense``: sent densely by the fallback); its place in the bucket's index buffer (None where no
    indices travel: a fallback step that is no check); ``taken`` (``clt_k.Taken``) once step 3 ran,
    and ``sent``, what this rank hands to the values' allreduce (``p[I]``, or ``p`` where
    :attr:`sends_p`)."""

    __slots__ = ("name", "grad", "memory", "k", "leader", "check", "dense", "offset", "taken", "sent")

    def __init__(self, name, grad, memory, k, leader, check, dense):
        self.name, self.grad, self.memory, self.k, self.leader = name, grad, memory, k, leader
        self.check, self.dense = check, dense
        self.offset = self.taken = self.sent = None

    @property
    def sends_p(self):
        """Whether this rank sends ``p`` densely (a check step, or the fallback) instead of ``p[I]``."""
        return self.check or self.dense

    @property
    def exchanges_indices(self):
        return not self.dense or self.check

    @property
    def width(self):
        """The entries this parameter puts in the values' allreduce."""
        return self.grad.numel() if self.sends_p else self.k


class BucketStep:
    """ScaleCom for one bucket at one step: :meth:`start` runs in the hook; :meth:`_take` once the
    indices have arrived; :meth:`_finish` once the values are reduced. With the health check
    (:mod:`hvd_scalecom.health`), a compressed parameter's step is one of: plain; a check step (``p``
    sent densely, the output and memory those of a plain step, then the measures recorded); a
    fallback step (no indices; ``p`` sent densely; output ``P``, ``m <- 0``); or a check
    step while falling back (the leader's indices travel for the measures, otherwise a fallback step).
    Every rank takes the same decisions (from reduced values), so the collectives stay the same."""

    def __init__(self, state, bucket):
        self.state = state
        self.bucket = bucket
        self.buffer = bucket.buffer()

    def start(self):
        state, config, health = self.state, self.state.config, self.state.health
        began = time.perf_counter()
        group = state._group()
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.group = group
        if not state._agreed:
            state._check_agreement(group, self.buffer.device)
        state._bind_warning(self.rank)
        t = self.t = state.iter
        if state._issuer is None or state._issuer.t != t:
            state._issuer = Issuer(t)
        issuer = self.issuer = state._issuer
        self.position = issuer.buckets
        issuer.buckets += 1
        if self.bucket.is_last():
            state.iter += 1  # (every earlier bucket of the step has been met: DDP reduces them in order)
        self.result = torch.futures.Future(devices=[self.buffer.device]) if self.buffer.is_cuda \
            else torch.futures.Future()
        self.compressed, self.dense = [], []
        value_itemsize = self._value_dtype().itemsize
        check = health.is_check_step(t, config.warmup_steps)
        offset, widest = 0, 0
        for param, grad in zip(self.bucket.parameters(), self.bucket.gradients()):
            name, index = state._describe(param)
            numel = grad.numel()
            flat = grad.view(-1)
            if not config.is_compressed(numel, t):
                self.dense.append(flat)
                state._record(t, dense_bytes=numel * grad.element_size(),
                              uncompressed_bytes=numel * grad.element_size())
                continue
            entry = _Compressed(name, flat, state._memory(name, grad), config.num_selected(numel),
                                config.leader_rank(t, self.size, index), check, state._sends_dense(name))
            self.compressed.append(entry)
            if entry.exchanges_indices:
                entry.offset = offset
                offset, widest = offset + entry.k, max(widest, numel)
                state._record(t, index_bytes=entry.k * config.index_itemsize(numel),
                              value_bytes=entry.width * value_itemsize, uncompressed_bytes=numel * grad.element_size())
            else:  # a fallback step: p densely, no indices
                state._record(t, dense_bytes=numel * value_itemsize, uncompressed_bytes=numel * grad.element_size())
        self.indexed = [entry for entry in self.compressed if entry.exchanges_indices]
        seq = 2 * self.position
        if not self.indexed:
            self.issuer.submit(seq, lambda: None)
            self._submit_values()
            state._add_time(t, time.perf_counter() - began)
            return self._returned()
        index_dtype = TORCH_DTYPES["int64" if widest > INT32_INDEX_MAX_NUMEL else config.index_dtype]
        self.indices = torch.zeros(offset, dtype=index_dtype, device=self.buffer.device)
        for entry in self.indexed:
            if entry.leader == self.rank:  # steps 1-3 on the leader
                chosen, entry.taken = clt_k.select_and_take(entry.memory, entry.grad, entry.k, config.selection,
                                                            index_dtype=index_dtype)
                self.indices[entry.offset:entry.offset + entry.k] = chosen
        state._add_time(t, time.perf_counter() - began)
        self.issuer.submit(seq, self._launch_indices)
        return self._returned()

    def _returned(self):
        """The bucket's future; at the step's last bucket, once every collective of the step is issued."""
        if self.bucket.is_last():
            self.issuer.wait_issued(2 * self.issuer.buckets)
        return self.result

    def _value_dtype(self):
        return self.state._value_dtype or self.buffer.dtype

    def _launch_indices(self):
        """Step 2: one collective for the bucket's indices."""
        if self.state.config.leader == "cyclic":
            work = dist.broadcast(self.indices, group=self.group, group_src=self.indexed[0].leader, async_op=True)
        else:  # several leaders: each gives the indices it leads, zeros elsewhere
            work = dist.all_reduce(self.indices, group=self.group, async_op=True)
        work.get_future().then(self._guarded(self._take))

    def _guarded(self, step):
        """``step(future)`` as a callback whose exception fails the bucket's result (DDP raises it)."""
        def callback(future):
            try:
                future.wait()
                step(future)
            except BaseException as error:  # (a callback's own error would go unseen)
                self.issuer.fail(error)
                if not self.result.done():
                    self.result.set_exception(error)
        return callback

    def _chosen(self, entry):
        return self.indices[entry.offset:entry.offset + entry.k]

    def _take(self, _):
        """Step 3 on the ranks that did not select: ``p_i[I]``; then the values' allreduce."""
        began = time.perf_counter()
        for entry in self.indexed:
            if entry.taken is None and not entry.dense:
                entry.taken = clt_k.take_checking(entry.memory, entry.grad, self._chosen(entry).to(torch.int64))
        self.state._add_time(self.t, time.perf_counter() - began)
        self._submit_values()

    def _submit_values(self):
        """What each parameter sends: ``p[I]`` in the values' dtype, or ``p`` where it is sent densely. A
        rank whose gradient is not finite sends NaN (in ``p[I]``'s place, and in a check step's ``p``),
        so that every rank sees a non-finite reduction and keeps its memory."""
        dtype = self._value_dtype()
        parts = []
        for entry in self.compressed:
            if entry.sends_p:
                sent = clt_k.error_compensated(entry.memory, entry.grad).to(dtype)
                finite = not entry.check or (entry.taken.finite if entry.taken is not None
                                             else clt_k.all_finite(entry.grad))
            else:
                sent, finite = entry.taken.values.to(dtype), entry.taken.finite
            if not finite:
                sent = torch.full_like(sent, float("nan"))
            entry.sent = sent
            parts.append(sent)
        together = dtype == self.buffer.dtype
        if together:
            parts += self.dense
        self.values = torch.cat(parts) if parts else None
        self.dense_sum = None if together or not self.dense else torch.cat(self.dense)
        self.issuer.submit(2 * self.position + 1, self._launch_values)

    def _launch_values(self):
        """Step 3's reduction: one allreduce of the values (and the dense gradients, where they share a
        dtype), else a second one of the dense gradients."""
        futures = [dist.all_reduce(tensor, group=self.group, async_op=True).get_future()
                   for tensor in (self.values, self.dense_sum) if tensor is not None]
        if not futures:
            self.result.set_result(self.buffer)
            return
        combined = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)
        combined.then(self._guarded(self._finish))

    def _finish(self, _):
        """Steps 4-5: the memory update and the averaged update written into the bucket's buffer; the
        health check's measures of a check step."""
        began = time.perf_counter()
        beta, skips = self.state.config.beta, 0
        reduced = self.values.div_(self.size) if self.values is not None else None
        at = 0
        for entry in self.compressed:
            part = reduced[at:at + entry.width]
            at += entry.width
            if entry.dense:  # everything owed, p = m + g, is sent: out = P, m <- 0
                updated = clt_k.all_finite(part)
                if updated:
                    entry.memory.zero_()
                entry.grad.copy_(part)
                self.state._count_dense_step(entry.name)
            elif entry.check:  # the plain step's output and memory, from P[I]
                chosen = self._chosen(entry).to(torch.int64)
                updated = clt_k.filter_and_scatter_(entry.memory, entry.grad, chosen, part.index_select(0, chosen),
                                                    entry.taken, entry.sent.index_select(0, chosen), beta)
            else:
                updated = clt_k.filter_and_scatter_(entry.memory, entry.grad, self._chosen(entry), part,
                                                    entry.taken, entry.sent, beta)
            if entry.check:
                self.state._record_check(entry.name, self.t, measure(part, self._chosen(entry), entry.k))
            skips += not updated
        dense = reduced[at:] if self.dense_sum is None else self.dense_sum.div_(self.size)
        at = 0
        for grad in self.dense:
            grad.copy_(dense[at:at + grad.numel()])
            at += grad.numel()
        self.state._add_time(self.t, time.perf_counter() - began, skips)
        self.result.set_result(self.buffer)
