"""Single-process references of the schemes' equations, written from the papers in NumPy.

Deliberately independent of ``hvd_scalecom``: ScaleCom's materialises every quantity the equations
name, in float32, exactly as Chen et al. (NeurIPS 2020), Algorithm 1 states them; Qsparse-local-SGD's
(:class:`QsparseReference`, Basu et al., NeurIPS 2019, Alg. 1) and Sketched SGD's
(:class:`SketchedReference`, Ivkin et al., NeurIPS 2019, Alg. 1) run in float64, worker by worker. The
only things they share with the code under test are random choices both must make alike (QSGD's
noise, the count sketch's hash functions).
"""

import math
from fractions import Fraction

import numpy as np


def scalecom_reference(raw_grads, names, size, ratio, beta, warmup_steps, min_numel,
                       leader="cyclic", value_dtype=np.float32, pipelined=False, skip_memory=(), chosen_sets=None,
                       check_every=None, fallback=None, min_captured=0.5, patience=2, health_log=None):
    """Applied (averaged) gradients of every step.

    raw_grads[t][rank][name]: each rank's gradient at step t (any shape).
    value_dtype: the dtype the selected values are sent in (v_i = value_dtype(p_i[I])).
    skip_memory: (t, name) pairs whose reduction was non-finite: the memory keeps its value (as it
        does wherever the mean is not finite: a rank whose gradient is not finite sends NaN).
    pipelined: I at step t is the top-k of the step-t leader's p at step t - 1 (fresh at the first
        compressed step). A leader whose gradient is not finite selects from its memory instead.
    chosen_sets: {(t, name): indices} the code under test chose, where ties at the k-th magnitude
        are likely (bfloat16 gradients): each must be a top-k of the leader's |p| and is taken as I;
        elsewhere ties go to the lowest indices.
    check_every, fallback, min_captured, patience: the health check. A compressed step t with
        (t - warmup_steps) % check_every == 0 reduces P = mean_i p_i densely (in value_dtype); its output
        is P at I, and G = top_k |P| gives overlap |I n G| / k and captured ||P[I]||^2 / ||P[G]||^2. With
        fallback="dense", ``patience`` captured values below min_captured in a row make the tensor's
        later steps send p densely (output P, m <- 0) until ``patience`` checks in a row reach
        min_captured. health_log (a list) receives (t, name, hits, k, selected, topk, total, dense) per
        finite check, ``dense``: whether the tensor is sent densely after it.
    Returns (applied, memories): applied[t][name] is the dense averaged update; memories[rank][name]
    the residue memory after the last step.
    """
    streaks = {name: {"low": 0, "good": 0, "dense": False} for name in names}
    memories = [{n: np.zeros(raw_grads[0][0][n].size, np.float32) for n in names} for _ in range(size)]
    applied = []
    previous_p = {}
    for t, per_rank in enumerate(raw_grads):
        out = {}
        for index, name in enumerate(names):
            g = [per_rank[r][name].astype(np.float32).reshape(-1) for r in range(size)]
            numel = g[0].size
            if numel < min_numel or t < warmup_steps:
                out[name] = (np.sum(g, axis=0) / size).reshape(per_rank[0][name].shape)
                continue
            p = [memories[r][name] + g[r] for r in range(size)]                     # p_i = m_i + g_i
            state = streaks[name]
            is_check = check_every is not None and (t - warmup_steps) % check_every == 0
            if state["dense"] and not is_check:                                      # fallback: every entry
                P = np.sum([x.astype(value_dtype).astype(np.float32) for x in p], axis=0) / size
                if (t, name) not in skip_memory and np.isfinite(P).all():
                    for r in range(size):
                        memories[r][name] = np.zeros(numel, np.float32)                # all was sent
                out[name] = P.reshape(per_rank[0][name].shape)
                continue
            # what a leader selects from: p, or its memory where its gradient is not finite
            selectable = [p[r] if np.isfinite(g[r]).all() else memories[r][name] for r in range(size)]
            j = t % size if leader == "cyclic" else (t + index) % size               # leader
            k = max(1, math.ceil(ratio * numel))
            source = selectable[j] if not pipelined or t == warmup_steps else previous_p[name][j]
            chosen = np.argsort(-np.abs(source), kind="stable")[:k]                  # I = top_k |p_j|
            if chosen_sets is not None and (t, name) in chosen_sets:
                given = np.asarray(chosen_sets[(t, name)]).reshape(-1)
                magnitudes = np.abs(source)
                assert given.size == k == np.unique(given).size, (t, name, given.size, k)
                assert given.size == numel or magnitudes[given].min() >= np.delete(magnitudes, given).max(), \
                    f"step {t}, {name}: the chosen indices are not a top-k of the leader's |p|"
                chosen = given
            previous_p[name] = selectable
            v = [p[r][chosen].astype(value_dtype).astype(np.float32) if np.isfinite(g[r]).all()
                 else np.full(k, np.nan, np.float32) for r in range(size)]           # v_i = p_i[I]
            sent = [np.zeros(numel, np.float32) for _ in range(size)]
            for r in range(size):
                sent[r][chosen] = v[r]                                               # scatter(I, v_i)
            dense = np.zeros(numel, np.float32)
            dense[chosen] = np.sum(v, axis=0) / size                                 # mean_i v_i
            was_dense = state["dense"]
            if is_check:
                P = np.sum([x.astype(value_dtype).astype(np.float32) if np.isfinite(g[r]).all()
                            else np.full(numel, np.nan, np.float32) for r, x in enumerate(p)], axis=0) / size
                if was_dense:
                    dense = P                                                        # every entry sent
                _check(P, chosen, k, name, t, state, fallback, min_captured, patience, health_log)
            for r in range(size):
                if (t, name) in skip_memory or not np.isfinite(dense).all():
                    continue
                if is_check and was_dense:
                    memories[r][name] = np.zeros(numel, np.float32)                  # all was sent
                    continue
                memories[r][name] = ((1 - beta) * memories[r][name]
                                     + beta * (p[r] - sent[r])).astype(np.float32)  # low-pass filter
            out[name] = dense.reshape(per_rank[0][name].shape)
        applied.append(out)
    return applied, memories


def assert_applied_steps(results, applied, names, first=0, rtol=2e-5, atol=1e-6, skip=()):
    """Each rank's ``applied/<first + t>/<name>`` (the workers' records) equals the reference's step ``t``
    of ``applied`` within ``rtol``/``atol``, with exactly its non-zero entries (k of them on a compressed
    step), for every step but the ``(t, name)`` pairs of ``skip``."""
    for t in range(len(applied)):
        for n in names:
            if (t, n) in skip:
                continue
            for rank, r in enumerate(results):
                got = r[f"applied/{first + t}/{n}"]
                np.testing.assert_allclose(got, applied[t][n], rtol=rtol, atol=atol,
                                           err_msg=f"step {first + t}, {n}, rank {rank}")
                np.testing.assert_array_equal(got.reshape(-1) != 0, applied[t][n].reshape(-1) != 0,
                                              err_msg=f"step {first + t}, {n}, rank {rank}: non-zeros")


def _check(P, chosen, k, name, t, state, fallback, min_captured, patience, health_log):
    """One check of the health check: its measures, then the fallback's streaks."""
    if not np.isfinite(P).all():
        return
    squares = P.astype(np.float64) ** 2
    top = np.argsort(-squares, kind="stable")[:k]                                    # G = top_k |P|
    selected, topk = squares[chosen].sum(), squares[top].sum()
    low = (selected / topk if topk > 0 else 1.0) < min_captured
    if state["dense"]:
        state["good"] = 0 if low else state["good"] + 1
        if state["good"] >= patience:
            state.update(dense=False, good=0)
    else:
        state["low"] = state["low"] + 1 if low else 0
        if state["low"] >= patience and fallback == "dense":
            state.update(dense=True, low=0)
    if health_log is not None:
        health_log.append((t, name, len(set(top.tolist()) & set(np.asarray(chosen).tolist())), k,
                           float(selected), float(topk), float(squares.sum()), state["dense"]))


def selected_count(ratio, numel, max_k=None):
    """k = max(1, ceil(ratio numel)) for the decimal ``ratio`` (at most numel, and max_k if given)."""
    exact = Fraction(repr(float(ratio))) * numel
    k = min(numel, max(1, -(-exact.numerator // exact.denominator)))
    return k if max_k is None else min(k, max_k)


class QsparseReference:
    """Qsparse-local-SGD, Alg. 1 of Basu et al. (NeurIPS 2019), for ``n`` workers in float64.

    Every worker takes local SGD steps (``buf = momentum buf + g``, ``x_i -= lr buf``); every
    ``local_steps``-th step ends with a synchronisation: per tensor of at least ``min_numel`` entries,
    ``delta_i = m_i + x_i - x_last``, ``c_i = Q(Top_k(delta_i))``, ``m_i = delta_i - c_i``,
    ``x_new = x_last + mean_i c_i``; smaller tensors average, ``x_new = mean_i x_i``; every worker
    restarts from ``x_new`` (a worker whose delta is not finite sends NaN, and a non-finite sum leaves
    every memory as it was). Q: ``top_k`` (the values), ``sign_top_k`` (``||v||_1 / k sign(v)``) or
    ``qsgd_top_k`` (QSGD with s = ``levels``, divided by ``1 + min(k / s^2, sqrt(k) / s)``), whose
    uniform draws come, per synchronisation and compressed tensor in order, as ``n x k`` draws of a
    ``torch.Generator`` seeded with ``seed`` (rank i's row, in the order of its ascending indices).
    """

    def __init__(self, x0, n, lr, local_steps, ratio, operator, levels=256, momentum=0.0, max_k=None,
                 min_numel=0, seed=0):
        import torch  # (only for the shared random stream)

        self.names, self.n, self.lr, self.local_steps = list(x0), n, lr, local_steps
        self.ratio, self.operator, self.levels, self.momentum = ratio, operator, levels, momentum
        self.max_k, self.min_numel = max_k, min_numel
        self.generator = torch.Generator().manual_seed(seed)
        self.shared = {m: np.asarray(v, np.float64).reshape(-1).copy() for m, v in x0.items()}
        self.local = [{m: v.copy() for m, v in self.shared.items()} for _ in range(n)]
        self.memory = [{m: np.zeros(v.size) for m, v in self.shared.items()} for _ in range(n)]
        self.buf = [{m: np.zeros(v.size) for m, v in self.shared.items()} for _ in range(n)]
        self.t = 0

    def step(self, grads):
        """One step from ``grads[i][name]``, worker i's gradient at its own weights."""
        for i in range(self.n):
            for m in self.names:
                self.buf[i][m] = self.momentum * self.buf[i][m] + np.asarray(grads[i][m], np.float64).reshape(-1)
                self.local[i][m] = self.local[i][m] - self.lr * self.buf[i][m]
        if (self.t + 1) % self.local_steps == 0:
            self._synchronise()
        self.t += 1

    def _synchronise(self):
        import torch

        for m in self.names:
            numel = self.shared[m].size
            if numel == 0 or numel < self.min_numel:
                new = np.mean([self.local[i][m] for i in range(self.n)], axis=0)
            else:
                k = selected_count(self.ratio, numel, self.max_k)
                noise = (torch.rand(self.n, k, generator=self.generator).numpy().astype(np.float64)
                         if self.operator == "qsgd_top_k" else None)
                total, memories = np.zeros(numel), []
                for i in range(self.n):
                    delta = self.memory[i][m] + self.local[i][m] - self.shared[m]
                    magnitude = np.where(np.isnan(delta), np.inf, np.abs(delta))  # (NaN first, as torch.topk)
                    chosen = np.sort(np.argsort(-magnitude, kind="stable")[:k])
                    c = self._quantise(delta[chosen], None if noise is None else noise[i])
                    if not np.isfinite(delta).all():
                        c = np.full(k, np.nan)  # a worker with a non-finite delta sends NaN
                    memories.append(delta.copy())
                    memories[i][chosen] -= c
                    total[chosen] += c
                if np.isfinite(total).all():  # else every worker keeps its memory
                    for i in range(self.n):
                        self.memory[i][m] = memories[i]
                new = self.shared[m] + total / self.n
            self.shared[m] = new
            for i in range(self.n):
                self.local[i][m] = new.copy()

    def _quantise(self, kept, noise):
        k = kept.size
        if self.operator == "top_k":
            return kept
        if self.operator == "sign_top_k":
            return np.abs(kept).sum() / k * np.sign(kept)
        s = self.levels
        norm = np.linalg.norm(kept)
        scaled = np.abs(kept) / norm * s if norm > 0 else np.zeros(k)
        xi = np.floor(scaled) + (noise < scaled - np.floor(scaled))
        return norm * np.sign(kept) * xi / s / (1 + min(k / s ** 2, math.sqrt(k) / s))


class SketchedReference:
    """Sketched SGD, Alg. 1 of Ivkin et al. (NeurIPS 2019), for ``n`` workers in float64.

    ``shapes``: ``{name: shape}`` in parameter order. The sketched tensors (two or more dimensions and
    at least ``min_numel`` entries) form one vector; per step and worker ``u_i = rho u_i + g_i``,
    ``v_i = v_i + u_i``; the summed sketches ``S = sum_i S(v_i)`` (``rows x columns``, ``columns``
    default ``10 k``) estimate ``sum_i v_i``; its ``candidates k`` largest estimated magnitudes get
    their exact sums, whose ``k`` largest are applied, ``/ n``, and zeroed in every ``u_i`` and ``v_i``.
    Other tensors, and every tensor during the first ``warmup_steps`` steps, apply ``mean_i u_i``.
    A non-finite ``S`` applies NaN to the sketched tensors and sets the non-finite entries of every
    ``u_i`` and ``v_i`` to 0 (this project's rule: the paper has none); a dense tensor's non-finite
    momentum is applied, then set to 0.
    ``hashes(numel, rows, columns)`` gives the sketch's ``(buckets, signs)``, ``(rows, numel)`` each.
    """

    def __init__(self, shapes, n, ratio, rows, columns, candidates, momentum, warmup_steps, min_numel,
                 hashes):
        self.shapes, self.n, self.rho, self.warmup_steps = dict(shapes), n, momentum, warmup_steps
        self.sketched = [m for m, shape in shapes.items()
                         if len(shape) >= 2 and 0 < math.prod(shape) and math.prod(shape) >= min_numel]
        numels = [math.prod(shapes[m]) for m in self.sketched]
        self.numel = sum(numels)
        self.k = min(self.numel, sum(selected_count(ratio, d) for d in numels))
        self.columns = columns if columns is not None else 10 * self.k
        self.count = min(self.numel, candidates * self.k)
        self.rows = rows
        self.buckets, self.signs = (np.asarray(a) for a in hashes(self.numel, rows, self.columns))
        self.u = np.zeros((n, self.numel))
        self.v = np.zeros((n, self.numel))
        self.dense_u = {m: np.zeros((n, math.prod(shape))) for m, shape in shapes.items() if m not in self.sketched}
        self.t = 0

    def step(self, grads):
        """``{name: applied update}`` (each in its shape) from ``grads[i][name]``."""
        out = {}
        for m, u in self.dense_u.items():
            u *= self.rho
            u += np.array([np.asarray(g[m], np.float64).reshape(-1) for g in grads])
            out[m] = u.mean(axis=0)
            u[~np.isfinite(u)] = 0.0
        g = np.array([np.concatenate([np.asarray(gi[m], np.float64).reshape(-1) for m in self.sketched])
                      for gi in grads]) if self.sketched else np.zeros((self.n, 0))
        self.u = self.rho * self.u + g
        if self.t < self.warmup_steps:
            update = self.u.mean(axis=0)
            self.u[~np.isfinite(self.u)] = 0.0
        else:
            self.v = self.v + self.u
            total = self.v.sum(axis=0)
            table = np.zeros((self.rows, self.columns))
            for j in range(self.rows):  # the sum of the workers' sketches is the sketch of the sum
                np.add.at(table[j], self.buckets[j], self.signs[j] * total)
            if not np.isfinite(table).all():  # a non-finite gradient somewhere: no round 2, a NaN
                update = np.full(self.numel, np.nan)  # update, and no non-finite entry kept
                self.u[~np.isfinite(self.u)] = 0.0
                self.v[~np.isfinite(self.v)] = 0.0
                return self._split(out, update)
            estimate = np.median([self.signs[j] * table[j, self.buckets[j]] for j in range(self.rows)], axis=0)
            candidates = np.argsort(-np.abs(estimate), kind="stable")[:self.count]
            exact = total[candidates]
            chosen = candidates[np.argsort(-np.abs(exact), kind="stable")[:self.k]]
            update = np.zeros(self.numel)
            update[chosen] = total[chosen] / self.n
            self.u[:, chosen] = 0.0
            self.v[:, chosen] = 0.0
        return self._split(out, update)

    def _split(self, out, update):
        """The step's result: ``out`` (the dense tensors) and the sketched vector's ``update``, cut
        into the sketched tensors."""
        at = 0
        for m in self.sketched:
            d = math.prod(self.shapes[m])
            out[m] = update[at:at + d]
            at += d
        self.t += 1
        return {m: out[m].reshape(self.shapes[m]) for m in self.shapes}

