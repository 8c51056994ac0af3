"""Dense SGD, FP16, ScaleCom (CLT-k) and the top-k baselines for the simulator.

Every sparsifier here follows ScaleCom's Algorithm 1 with a different choice of indices, and runs the
memory update through :func:`hvd_scalecom.torch.clt_k.take` and
:func:`~hvd_scalecom.torch.clt_k.filter_memory_`, the functions the Horovod compressor calls:
``p_i = m_i + g_i``; values ``p_i[I]``;
``m_i <- (1 - beta) m_i + beta (p_i - scatter(I, p_i[I]))`` (``beta = 1``: classic error feedback).

=====================  =============================================  =====================================
scheme                 indices I                                      collectives per compressed tensor
=====================  =============================================  =====================================
``ScaleCom``           leader's ``top_k(|p_j|)``, ``j = t mod n``     broadcast k indices, allreduce k values
``GlobalTopK``         ``top_k(|mean_i p_i|)`` (the ideal)            allreduce of ``p`` (numel values)
``LocalTopK``          worker i's own ``top_k(|p_i|)``                allgather k indices + k values
``GTopK``              local top-k merged pairwise (Shi et al.)       log2 n exchanges of k indices + k values
``RandomK``            k random indices from a shared seed            allreduce k values
=====================  =============================================  =====================================
"""

import math

import torch

from hvd_scalecom.config import VALUE_DTYPES, ScaleComConfig, check_dtype_name, check_int
from hvd_scalecom.health import HealthCheck, HealthMonitor, Measures
from hvd_scalecom.sim.base import Scheme, mean_over_workers
from hvd_scalecom.state_checks import check_next_indices
from hvd_scalecom.torch import clt_k
from hvd_scalecom.torch.health import measure
from hvd_scalecom.torch.topk import flat_indices, gtopk_merge, select_top_k_rows, shared_random_indices
from hvd_scalecom.traffic import dtype_name


class Dense(Scheme):
    """Dense SGD: a ring allreduce of every gradient (``wire_dtype``: cast for the wire, e.g. fp16)."""

    name = "dense"

    def __init__(self, wire_dtype=None):
        wire_dtype = check_dtype_name(wire_dtype, "wire_dtype", VALUE_DTYPES)
        super().__init__(ScaleComConfig(ratio=1.0, min_numel=0, value_dtype=wire_dtype))
        self.wire_dtype = wire_dtype

    def is_compressed(self, spec, t):
        return self.wire_dtype is not None

    def compress(self, spec, G, t, record, diagnostics):
        """``mean_i cast(g_i)``: the allreduce modelled as one fp32 sum, rounded once to the wire dtype
        (a sum beyond its range Inf, as Horovod's sum in that dtype)."""
        wire = self.sent_dtype(G)
        record.dense(spec.name, spec.numel, wire)
        return mean_over_workers(G.to(wire)).to(G.dtype)

    def describe(self):
        return {"wire_dtype": self.wire_dtype}


class FP16(Dense):
    """Horovod's ``Compression.fp16``: gradients cast to fp16 for the allreduce, no error feedback."""

    name = "fp16"

    def __init__(self):
        super().__init__(wire_dtype="float16")


class _ErrorFeedback(Scheme):
    """Schemes that keep what they did not send in clt_k's memory (Algorithm 1's steps 3-4). As in
    the Horovod compressor, a worker whose gradient is not finite (anywhere) sends NaN, and a
    non-finite reduction (that, or an overflow, e.g. of fp16 values) leaves every worker's memory as
    it was (counted in ``nonfinite_skips``)."""

    beta = 1.0
    nonfinite_skips = 0  # compressed tensor-steps whose memory update a non-finite reduction skipped

    def take_sent(self, M, G, flat):
        """Step 3 for all workers: ``(m[I], p[I], sent)``, ``sent`` the ``(n, k)`` values as they
        travel (the value dtype), NaN on a worker whose gradient is not finite."""
        memory_at, values = clt_k.take(M.view(-1), G, flat)
        sent = values.to(self.sent_dtype(G)).view(G.shape[0], -1)
        if not clt_k.all_finite(G):
            sent = sent.masked_fill(~torch.isfinite(G).all(dim=1, keepdim=True), float("nan"))
        return memory_at, values, sent

    def filter_if_finite(self, M, G, flat, memory_at, values, sent, reduced):
        """Step 4 for all workers, in place, unless ``reduced`` (what every worker received) is not
        finite; ``sent`` as :meth:`take_sent` gave it (flat or not)."""
        if clt_k.all_finite(reduced):
            clt_k.filter_memory_(M.view(-1), G, flat, memory_at, values, sent.reshape(-1), self.beta)
        else:
            self.nonfinite_skips += 1


class _SharedIndices(_ErrorFeedback):
    """Schemes whose workers all use the same indices ``I``: the values add up in an allreduce."""

    def filtered_update(self, spec, G, indices):
        """Steps 3-5 of Algorithm 1 for all workers: update ``scatter(I, mean v)``, the memory filter
        in place unless the mean is not finite (:class:`_ErrorFeedback`)."""
        n, numel = G.shape
        M = self.memory(spec, G)
        flat = flat_indices(indices, n, numel)
        memory_at, values, sent = self.take_sent(M, G, flat)
        reduced = mean_over_workers(sent)
        self.filter_if_finite(M, G, flat, memory_at, values, sent, reduced)
        return clt_k.scatter_dense(reduced, indices, numel, G.dtype)


class ScaleCom(_SharedIndices):
    """ScaleCom (Chen et al., NeurIPS 2020, Alg. 1): CLT-k with a low-pass-filtered residue memory.

    Arguments as :class:`hvd_scalecom.torch.ScaleCom` (the Horovod compressor), which shares
    :mod:`hvd_scalecom.torch.clt_k` and :class:`hvd_scalecom.config.ScaleComConfig` with this class.
    ``pipelined=True``: step t uses the indices the leader of step t selected at step t - 1 from its
    ``p`` then, as the Horovod compressor's pipelined mode does (fresh at the first compressed step).
    ``check_every``, ``fallback``, ``min_captured``, ``patience``: the health check and the dense
    fallback of :mod:`hvd_scalecom.health` (a :class:`~hvd_scalecom.health.HealthCheck`; off by default),
    measured by :func:`hvd_scalecom.torch.health.measure` as on the Horovod path; ``monitor`` holds the
    decisions, ``health_summary()`` what the compressor's ``stats()["health"]`` holds.
    Diagnostics per step: ``overlap = |I_leader ∩ I_true| / k`` with ``I_true = top_k(|mean_i p_i|)``,
    k-weighted over the compressed tensors, and per tensor in ``overlap_by_tensor``; at check steps
    ``health_overlap`` and ``health_captured`` (over the tensors checked, k- and energy-weighted),
    ``health_checks`` and ``health_by_tensor``; with checks on, ``health_dense_tensors`` (tensors the
    fallback sends densely from the next step) at every step.
    """

    name = "scalecom"

    def __init__(self, ratio=0.01, beta=0.1, warmup_steps=0, min_numel=1024, *, leader="cyclic",
                 selection="threshold", value_dtype=None, index_dtype="int32", pipelined=False,
                 check_every=None, fallback=None, min_captured=0.5, patience=2):
        super().__init__(ScaleComConfig(ratio=ratio, beta=beta, warmup_steps=warmup_steps,
                                        min_numel=min_numel, leader=leader, selection=selection,
                                        value_dtype=value_dtype, index_dtype=index_dtype,
                                        pipelined=pipelined))
        self.health = HealthCheck(check_every=check_every, fallback=fallback, min_captured=min_captured,
                                  patience=patience)
        if self.health.fallback is not None and self.config.pipelined:
            raise ValueError(f"fallback={self.health.fallback!r} cannot be used with pipelined=True: the "
                             f"fallback decides at a step's end, after a pipelined step has already shared "
                             f"the next step's indices")
        self.beta = self.config.beta
        self.monitor = None

    def bind(self, specs, n, params):
        super().bind(specs, n, params)
        self.monitor = HealthMonitor(self.health, [s.name for s in self.specs]) if self.health.enabled else None

    def state_shapes(self, spec):
        return {**super().state_shapes(spec), "ahead": (self.config.num_selected(spec.numel),)}

    def made_later(self):
        return (*super().made_later(), "ahead")

    def state_dtype(self, spec, key):
        return None if key == "ahead" else super().state_dtype(spec, key)

    def check_state(self, spec, key, value):
        if key == "ahead":  # the indices selected a step ahead (pipelined)
            check_next_indices(spec.name, (0, value), self.config.num_selected(spec.numel),
                               spec.numel, self.config.pipelined and self.config.compresses(spec.numel))

    def step(self, grads, t):
        updates, record, diagnostics = super().step(grads, t)
        if self.monitor is not None:
            diagnostics["health_dense_tensors"] = sum(self.monitor.sends_dense(s.name) for s in self.specs)
        return updates, record, diagnostics

    def compress(self, spec, G, t, record, diagnostics):
        n, numel = G.shape
        k = self.config.num_selected(numel)
        check = self.health.is_check_step(t, self.config.warmup_steps)
        falling_back = self.monitor is not None and self.monitor.sends_dense(spec.name)
        if falling_back and not check:                                           # every entry, no indices
            record.dense(spec.name, numel, dtype_name(self.sent_dtype(G)))
            self.monitor.count_dense_step(spec.name)
            return self.dense_update(spec, G)
        leader = self.config.leader_rank(t, n, spec.index)
        M = self.memory(spec, G)
        entry = self.state[spec.name]
        if "ahead" in entry:                                                     # pipelined, chosen at t - 1
            indices = entry.pop("ahead")
        else:
            indices = self.leader_top_k(M, G, leader, k)                         # I = top_k |p_j|
            record.add("broadcast", "index", spec.name, k, self.index_dtype(numel), root=leader)
        if self.config.pipelined and self.config.is_compressed(numel, t + 1):
            ahead_leader = self.config.leader_rank(t + 1, n, spec.index)
            entry["ahead"] = self.leader_top_k(M, G, ahead_leader, k)            # step t + 1's, shared now
            record.add("broadcast", "index", spec.name, k, self.index_dtype(numel), root=ahead_leader)
        if self.diagnose:
            P = clt_k.error_compensated(M.view(-1), G).view(n, numel)
            true = clt_k.select_top_k(P.mean(dim=0), k, "exact")
            hit = torch.zeros(numel, dtype=torch.bool, device=G.device)
            hit[true] = True
            _add_overlap(diagnostics, spec.name, int(hit[indices].sum()), k)
        if not check:
            record.add("allreduce", "value", spec.name, k, dtype_name(self.sent_dtype(G)))
            return self.filtered_update(spec, G, indices)
        record.add("allreduce", "value", spec.name, numel, dtype_name(self.sent_dtype(G)))  # p, densely
        if falling_back:                                                         # a check while dense
            self.monitor.count_dense_step(spec.name)
            update, reduced = self.dense_update(spec, G, with_reduced=True)
        else:                                                                    # the compressed step's own
            update, reduced = self.checked_update(spec, G, indices)
        measures = measure(reduced, indices, k)
        self.monitor.record(spec.name, t, measures)
        _add_health(diagnostics, spec.name, measures)
        return update

    def checked_update(self, spec, G, indices):
        """A check step while compressed: every worker sends ``p`` densely, ``P = mean_i p_i``; the
        output ``scatter(I, P[I])`` and the memory filter are those of the compressed step (skipped
        where ``P[I]`` is not finite). Returns ``(update, P)``."""
        n, numel = G.shape
        M = self.memory(spec, G)
        flat = flat_indices(indices, n, numel)
        memory_at, values, sent = self.take_sent(M, G, flat)
        reduced = mean_over_workers(self.sent_dense(M, G))
        self.filter_if_finite(M, G, flat, memory_at, values, sent, reduced[indices])
        return clt_k.scatter_dense(reduced[indices], indices, numel, G.dtype), reduced

    def dense_update(self, spec, G, with_reduced=False):
        """A fallback step: ``out = P = mean_i p_i`` and ``m_i <- 0``, everything owed was sent (kept
        where ``P`` is not finite)."""
        M = self.memory(spec, G)
        reduced = mean_over_workers(self.sent_dense(M, G))
        if clt_k.all_finite(reduced):
            M.zero_()
        else:
            self.nonfinite_skips += 1
        update = reduced.to(G.dtype)
        return (update, reduced) if with_reduced else update

    def sent_dense(self, M, G):
        """Every worker's ``p_i = m_i + g_i`` as it travels densely (the value dtype), NaN on a worker
        whose gradient is not finite."""
        sent = clt_k.error_compensated(M.view(-1), G).view(G.shape).to(self.sent_dtype(G))
        if not clt_k.all_finite(G):
            sent = sent.masked_fill(~torch.isfinite(G).all(dim=1, keepdim=True), float("nan"))
        return sent

    def leader_top_k(self, M, G, leader, k):
        """The leader's ``top_k(|p_j|)``, ``p_j = m_j + g_j`` (``top_k(|m_j|)`` where ``g_j`` is not
        finite), with the Horovod path's function (:func:`clt_k.select_top_k_of_sum`)."""
        return clt_k.select_top_k_of_sum(M[leader], G[leader], k, self.config.selection)

    def health_summary(self):
        """The health check's figures as the compressor's ``stats()["health"]`` holds them (None when
        checks are off)."""
        return None if self.monitor is None else self.monitor.summary()

    def describe(self):
        out = super().describe()
        return {**out, "health": self.health.as_dict()} if self.health.enabled else out

    def extra_state(self):
        return {"health": self.monitor.state_dict()} if self.monitor is not None else {}

    def load_extra_state(self, extra):
        if self.monitor is not None:
            fresh = HealthMonitor(self.health, [s.name for s in self.specs])
            if "health" in extra:
                fresh.load_state_dict(extra["health"])
            self.monitor = fresh


def _add_health(diagnostics, name, m):
    """One check's figures into the step's diagnostics, summed over the tensors checked at this step."""
    diagnostics["health_checks"] = diagnostics.get("health_checks", 0) + 1
    if not m.is_finite():  # (a skipped step: as the monitor, no figures)
        return
    diagnostics.setdefault("health_by_tensor", {})[name] = {"overlap": m.overlap, "captured": m.captured}
    totals = diagnostics.setdefault("_health_totals", [0, 0, 0.0, 0.0, 0.0])
    for i, x in enumerate((m.hits, m.k, m.selected, m.topk, m.total)):
        totals[i] += x
    step = Measures(*totals)
    diagnostics.update(health_overlap=step.overlap, health_captured=step.captured)


def _add_overlap(diagnostics, name, hits, k):
    diagnostics.setdefault("overlap_by_tensor", {})[name] = hits / k
    totals = diagnostics.setdefault("_overlap_counts", [0, 0])
    totals[0] += hits
    totals[1] += k
    diagnostics["overlap"] = totals[0] / totals[1]


class GlobalTopK(_SharedIndices):
    """The ideal CLT-k approximates: ``I = top_k(|mean_i p_i|)`` of the summed error-compensated vector.

    Finding it exactly needs every worker's ``p_i``: ``traffic="dense"`` (default) counts the allreduce of
    ``p`` that realises it; ``traffic="clt-k"`` counts it as if an oracle supplied ``I`` (k indices
    broadcast from ScaleCom's leader of the step, k values allreduced, ScaleCom's cost), to compare
    selection quality at equal traffic.
    """

    name = "global_topk"

    def __init__(self, ratio=0.01, beta=1.0, warmup_steps=0, min_numel=1024, *, value_dtype=None,
                 index_dtype="int32", traffic="dense"):
        super().__init__(ScaleComConfig(ratio=ratio, beta=beta, warmup_steps=warmup_steps,
                                        min_numel=min_numel, value_dtype=value_dtype,
                                        index_dtype=index_dtype))
        if traffic not in ("dense", "clt-k"):
            raise ValueError(f"traffic must be 'dense' or 'clt-k', got {traffic!r}")
        self.beta = self.config.beta
        self.traffic = traffic

    def compress(self, spec, G, t, record, diagnostics):
        n, numel = G.shape
        k = self.config.num_selected(numel)
        P = clt_k.error_compensated(self.memory(spec, G).view(-1), G).view(n, numel)
        indices = clt_k.select_top_k(P.mean(dim=0), k, "exact")
        values = dtype_name(self.sent_dtype(G))
        if self.traffic == "dense":
            record.add("allreduce", "value", spec.name, numel, values)
        else:
            root = self.config.leader_rank(t, n, spec.index)  # (ScaleCom's leader, so the split matches)
            record.add("broadcast", "index", spec.name, k, self.index_dtype(numel), root=root)
            record.add("allreduce", "value", spec.name, k, values)
        return self.filtered_update(spec, G, indices)

    def describe(self):
        return {"config": self.config.as_dict(), "traffic": self.traffic}


class RandomK(_SharedIndices):
    """Random-k with error feedback (Stich et al., NeurIPS 2018): ``I`` drawn from ``(seed, step, tensor)``.

    Every worker draws the same indices (:func:`hvd_scalecom.torch.topk.shared_random_indices`), so
    only the k values travel, in one allreduce.
    """

    name = "random_k"

    def __init__(self, ratio=0.01, warmup_steps=0, min_numel=1024, *, seed=0, value_dtype=None):
        super().__init__(ScaleComConfig(ratio=ratio, beta=1.0, warmup_steps=warmup_steps,
                                        min_numel=min_numel, value_dtype=value_dtype))
        self.seed = check_int(seed, "seed", 0)

    def compress(self, spec, G, t, record, diagnostics):
        k = self.config.num_selected(spec.numel)
        indices = shared_random_indices(spec.numel, k, self.seed, t, spec.index, device=G.device)
        record.add("allreduce", "value", spec.name, k, dtype_name(self.sent_dtype(G)))
        return self.filtered_update(spec, G, indices)

    def describe(self):
        return {"config": self.config.as_dict(), "seed": self.seed}


class LocalTopK(_ErrorFeedback):
    """Local top-k with error feedback: every worker sends its own ``top_k(|p_i|)`` as (index, value)
    pairs by allgather; each worker sums the n sets. Traffic per worker grows linearly with n.
    ``beta`` < 1 applies ScaleCom's low-pass filter to this baseline's memory too. Non-finite
    gradients and sums as in :class:`_ErrorFeedback` (every worker receives the same n sets).
    """

    name = "local_topk"

    def __init__(self, ratio=0.01, beta=1.0, warmup_steps=0, min_numel=1024, *, value_dtype=None,
                 index_dtype="int32"):
        super().__init__(ScaleComConfig(ratio=ratio, beta=beta, warmup_steps=warmup_steps,
                                        min_numel=min_numel, value_dtype=value_dtype,
                                        index_dtype=index_dtype))
        self.beta = self.config.beta

    def compress(self, spec, G, t, record, diagnostics):
        n, numel = G.shape
        k = self.config.num_selected(numel)
        M = self.memory(spec, G)
        indices = select_top_k_rows(clt_k.error_compensated(M.view(-1), G).view(n, numel), k)  # I_i = top_k |p_i|
        flat = flat_indices(indices, n, numel)
        memory_at, values, sent = self.take_sent(M, G, flat)
        record.add("allgather", "index", spec.name, k, self.index_dtype(numel))
        record.add("allgather", "value", spec.name, k, dtype_name(sent.dtype))
        summed = torch.zeros(numel, dtype=clt_k.memory_dtype(sent.dtype), device=G.device)
        summed.index_add_(0, indices.reshape(-1), sent.reshape(-1).to(summed.dtype))
        self.filter_if_finite(M, G, flat, memory_at, values, sent, summed)
        return (summed / n).to(G.dtype)


class GTopK(_ErrorFeedback):
    """gTop-k S-SGD (Shi et al., arXiv:1901.04359, Alg. 3) with exact residuals.

    Every worker takes its local top-k of ``p_i = m_i + g_i``; :func:`~hvd_scalecom.torch.topk.gtopk_merge`
    reduces the n sets pairwise over ``log2 n`` rounds (recursive doubling: each round every worker
    sends k indices and k values to its partner) into the global k-set; every worker applies its values
    divided by n. Residuals keep everything that did not reach the final sum: ``m_i = p_i`` except on
    the entries of worker i that survived every merge (the memory update is clt_k's with those indices
    and ``beta = 1``). The paper puts back only the local top-k entries whose index is outside the
    global set; here a value a merge dropped is kept even where its index reached the global set
    through other workers, so no value is lost. Needs a power-of-two number of workers. A non-finite value
    sent (a worker's
    non-finite gradient, an overflow) makes the merged sums NaN and skips every memory update, as in
    :class:`_ErrorFeedback` (a merge could otherwise drop a NaN: the flag travels with the sums).
    """

    name = "gtopk"

    def __init__(self, ratio=0.01, warmup_steps=0, min_numel=1024, *, value_dtype=None, index_dtype="int32"):
        super().__init__(ScaleComConfig(ratio=ratio, beta=1.0, warmup_steps=warmup_steps,
                                        min_numel=min_numel, value_dtype=value_dtype,
                                        index_dtype=index_dtype))

    def bind(self, specs, n, params):
        if n & (n - 1):
            raise ValueError(f"GTopK needs a power-of-two number of workers, got {n}")
        super().bind(specs, n, params)

    def compress(self, spec, G, t, record, diagnostics):
        n, numel = G.shape
        k = self.config.num_selected(numel)
        M = self.memory(spec, G)
        local = select_top_k_rows(clt_k.error_compensated(M.view(-1), G).view(n, numel), k)
        flat = flat_indices(local, n, numel)
        memory_at, values, sent = self.take_sent(M, G, flat)
        indices, summed, contributed = gtopk_merge(local, sent.to(values.dtype), numel)  # widened for the sums
        if not clt_k.all_finite(sent):
            summed.fill_(float("nan"))
        kept = contributed.reshape(-1)
        self.filter_if_finite(M, G, flat[kept], memory_at[kept], values[kept], sent.reshape(-1)[kept], summed)
        rounds = int(math.log2(n))
        if rounds:
            record.add("exchange", "index", spec.name, k, self.index_dtype(numel), rounds=rounds)
            record.add("exchange", "value", spec.name, k, dtype_name(sent.dtype), rounds=rounds)
        if self.diagnose:
            diagnostics.setdefault("contributed_by_tensor", {})[spec.name] = float(contributed.float().mean())
        return clt_k.scatter_dense((summed / n).to(sent.dtype), indices, numel, G.dtype)
