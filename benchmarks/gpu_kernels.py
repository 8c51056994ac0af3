"""ScaleCom's per-tensor compute on a CUDA device against the one-pass floor there, the same steps
checked against the CPU, and the simulator's schemes run on the device; writes the "GPU" section of
docs/performance.md.

    python -m benchmarks.gpu_kernels --rounds 200             # on a CUDA machine: 1M and 25M entries
    python -m benchmarks.gpu_kernels --smoke --device cpu     # a small tensor, on any machine

Needs torch and this package only (no Horovod, no C kernels: on CUDA tensors ``clt_k`` runs torch
operations), so that it runs on a GPU machine with its own torch. For each size and ratio, on fp32
gradient ``g`` and memory ``m`` (``benchmarks.kernels.make_inputs``, beta 0.1):

* floor: ``m.add_(g, alpha=beta)``, one pass reading g and m and writing m (12 bytes per entry);
* gradient write alone: ``g.zero_()``, the dense gradient ``decompress`` owes Horovod;
* synchronisation alone: ``torch.cuda.synchronize()`` with nothing queued, the least a call that
  waits for the device costs;
* leader / non-leader: the ``clt_k`` calls ``ScaleCom.compress`` + ``decompress`` make for one
  tensor (without the communication): ``select_and_take`` (threshold or exact top-k) and
  ``filter_and_scatter_`` on the leader, ``take_checking`` and ``filter_and_scatter_`` on a rank
  that received the indices;
* the selection alone on a given ``p``: ``"threshold"`` and ``"exact"`` (``torch.topk``), and the
  sampled threshold's own path (``clt_k._sampled_selection``: on CUDA a mask of ``|p| >= t`` and its
  ``nonzero``), which ``"threshold"`` takes on CUDA from ``clt_k._CUDA_THRESHOLD_MIN_NUMEL`` entries on.

Every call is timed from the host to the end of its work on the device (``torch.cuda.synchronize``
after it), as a gradient hook sees it; the compressor's steps read a few scalars back to the host
(the sampled threshold, whether g is finite), each a synchronisation. Variants are timed in turn,
round by round, each timed call right after an untimed one of the same variant
(``benchmarks._report.interleaved``), on inputs restored before every call.

Checks on the device (reported, and the run fails where a check fails): the threshold selection
finds the exact top-k (overlap); the leader and non-leader on the device select the same indices as
on the CPU and give the same gradient and memory up to float rounding (the device may fuse
``m + beta g`` into one multiply-add); and every scheme of ``hvd_scalecom.sim`` trains a small model
on the device for a few steps, giving the byte counts and (but for Sketched SGD, whose estimates
tie: ``TIE_PRONE``) the weights it gives on the CPU.
"""

import argparse
import json
import sys

import torch

from benchmarks import kernels
from benchmarks._report import (
    COUNT,
    RATIO,
    command_line,
    interleaved,
    number,
    output_file,
    output_path,
    replace_section,
    write_text,
)
from hvd_scalecom import sim
from hvd_scalecom.config import ScaleComConfig
from hvd_scalecom.native import torch_operations
from hvd_scalecom.torch import clt_k

BETA = kernels.BETA
SIZES = [1 << 20, 25_000_000]
RATIOS = [0.01, 0.001]
# Schemes whose top-k runs over values with many exact ties: Sketched SGD's estimates are medians of
# count-sketch cells that coordinates share, and torch.topk (or the C selection) picks among the
# entries tied at the k-th value differently on each device, from the first such tie on.
TIE_PRONE = ("SketchedSGD",)


def _leader(m, g, k, selection, scratch):
    indices, taken = clt_k.select_and_take(m, g, k, selection, scratch=scratch, index_dtype=torch.int32)
    clt_k.filter_and_scatter_(m, g, indices, taken.values, taken, taken.values, BETA)
    return indices


def _non_leader(m, g, received):
    indices = received.to(torch.int64)  # as the compressor widens the int32 it received
    taken = clt_k.take_checking(m, g, indices)
    clt_k.filter_and_scatter_(m, g, indices, taken.values, taken, taken.values, BETA)


def _on_cpu_as_reference(g0, m0, k, received):
    """The leader's indices, and the leader's and a non-leader's (m, g) after one step, from torch
    operations on the CPU."""
    with torch_operations():
        m, g = m0.clone(), g0.clone()
        indices = _leader(m, g, k, "threshold", None).to(torch.int64).sort().values
        leader = (m, g)
        m, g = m0.clone(), g0.clone()
        _non_leader(m, g, received)
    return indices, leader, (m, g)


def _differences(device_pair, cpu_pair):
    """Largest |device - cpu| of m and of g, relative to the largest |cpu| entry of each."""
    return [float((d.cpu() - c).abs().max() / c.abs().max().clamp_min(1e-30)) for d, c in zip(device_pair, cpu_pair)]


def measure(numel, ratio, rounds, device):
    k = ScaleComConfig(ratio=ratio).num_selected(numel)
    g_cpu, m_cpu = kernels.make_inputs(numel)
    g0, m0 = g_cpu.to(device), m_cpu.to(device)
    g, m = g0.clone(), m0.clone()
    scratch = torch.empty(numel, device=device)
    p0 = m0 + g0
    sync = torch.cuda.synchronize if g0.is_cuda else (lambda: None)

    exact = clt_k.select_top_k(p0, k, "exact")
    threshold = clt_k.select_top_k(p0, k, "threshold")
    overlap = torch.isin(threshold, exact).sum().item() / k
    sampled = clt_k._sampled_selection(p0, k)  # (what "threshold" takes from 2^22 entries on, on CUDA)
    sampled_overlap = None if sampled is None else torch.isin(sampled, exact).sum().item() / k
    received = exact.to(torch.int32).sort().values  # the indices as a non-leader receives them

    cpu_indices, cpu_leader, cpu_non_leader = _on_cpu_as_reference(g_cpu, m_cpu, k, received.cpu())
    m, g = m0.clone(), g0.clone()
    same_indices = torch.equal(_leader(m, g, k, "threshold", scratch).to(torch.int64).sort().values.cpu(),
                               cpu_indices)
    leader_diff = _differences((m, g), cpu_leader)
    m, g = m0.clone(), g0.clone()
    _non_leader(m, g, received)
    non_leader_diff = _differences((m, g), cpu_non_leader)

    def restore():
        m.copy_(m0)
        g.copy_(g0)
        sync()

    def timed(fn):
        def call():
            fn()
            sync()
        return call

    variants = {
        "floor": timed(lambda: m.add_(g, alpha=BETA)),
        "synchronisation alone": timed(lambda: None),
        "gradient write alone": timed(lambda: g.zero_()),
        "leader": timed(lambda: _leader(m, g, k, "threshold", scratch)),
        "leader, exact top-k": timed(lambda: _leader(m, g, k, "exact", scratch)),
        "non-leader": timed(lambda: _non_leader(m, g, received)),
        "selection (threshold)": timed(lambda: clt_k.select_top_k(p0, k, "threshold")),
        "selection (exact)": timed(lambda: clt_k.select_top_k(p0, k, "exact")),
        "selection (sampled threshold)": timed(lambda: clt_k._sampled_selection(p0, k)),
    }
    results = interleaved(variants, rounds, ("floor",), prepare=restore)
    floor_seconds = results["floor"][0]
    return {"numel": numel, "ratio": ratio, "k": k, "overlap": overlap, "sampled_overlap": sampled_overlap,
            "same_indices_as_cpu": same_indices,
            "leader_diff": leader_diff, "non_leader_diff": non_leader_diff,
            "floor_ms": 1e3 * floor_seconds, "floor_gbps": 12 * numel / floor_seconds / 1e9,
            "ms": {name: 1e3 * s for name, (s, _, _) in results.items()},
            "x": {name: r["floor"] for name, (_, r, _) in results.items()}}


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _schemes():
    """Every scheme of the simulator, in settings where each compresses the model's weights."""
    return {
        "Dense": lambda: sim.Dense(),
        "FP16": lambda: sim.FP16(),
        "ScaleCom": lambda: sim.ScaleCom(ratio=0.01, beta=0.1, min_numel=1000),
        "ScaleCom, pipelined": lambda: sim.ScaleCom(ratio=0.01, beta=0.1, min_numel=1000, pipelined=True),
        "LocalTopK": lambda: sim.LocalTopK(ratio=0.01, min_numel=1000),
        "GlobalTopK": lambda: sim.GlobalTopK(ratio=0.01, min_numel=1000),
        "GTopK": lambda: sim.GTopK(ratio=0.01, min_numel=1000),
        "RandomK": lambda: sim.RandomK(ratio=0.01, min_numel=1000),
        "SketchedSGD": lambda: sim.SketchedSGD(ratio=0.01, rows=5, min_numel=1000),
        "QsparseLocalSGD": lambda: sim.QsparseLocalSGD(0.05, local_steps=2, ratio=0.01, min_numel=1000),
        "PowerSGD": lambda: sim.PowerSGD(rank=2, min_numel=1000),
    }


def train(make_scheme, device, workers, steps):
    """``steps`` simulated steps of ``workers`` workers on random data: the final weights (on the CPU)
    and the bytes each worker sent."""
    model = _model(0).to(device)
    simulator = sim.Simulator(make_scheme(), workers, model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(steps):
        x = torch.randn(workers, 16, 64, generator=gen).to(device)
        y = torch.randint(0, 10, (workers, 16), generator=gen).to(device)
        grads = sim.per_worker_gradients(model, loss_fn, simulator.worker_params(), x, y)
        simulator.step_stacked(grads).apply_to(model.parameters(), optimizer)
    return [p.detach().cpu() for p in model.parameters()], simulator.totals()["sent_bytes"]


def simulate(device, workers, steps):
    """Per scheme: the largest |device - cpu| weight relative to the largest weight, and whether the
    bytes sent are the same."""
    rows = []
    for name, make in _schemes().items():
        on_device, device_bytes = train(make, device, workers, steps)
        with torch_operations():  # the CPU as the device runs it: torch operations
            on_cpu, cpu_bytes = train(make, "cpu", workers, steps)
        diff = max(float((d - c).abs().max()) for d, c in zip(on_device, on_cpu))
        scale = max(float(c.abs().max()) for c in on_cpu)
        rows.append({"scheme": name, "weight_diff": diff / scale, "same_bytes": device_bytes == cpu_bytes,
                     "sent_bytes": device_bytes})
    return rows


def failures(result):
    """The checks that did not hold (empty if all did)."""
    failed = []
    for r in result["kernels"]:
        where = f"{r['numel']:,} entries, ratio {r['ratio']:g}"
        for key in ("overlap", "sampled_overlap"):
            if r[key] != 1.0:
                failed.append(f"{where}: the {key.replace('_', ' ')} with the exact top-k is {r[key]}")
        if not r["same_indices_as_cpu"]:
            failed.append(f"{where}: the leader selected other indices than on the CPU")
        for role in ("leader", "non_leader"):
            if max(r[role + "_diff"]) > 1e-6:
                failed.append(f"{where}: the {role} differs from the CPU by {max(r[role + '_diff']):.2e}")
    for r in result["simulator"]:
        tied = r["scheme"] in TIE_PRONE  # (its weights are reported, not checked)
        if not r["same_bytes"] or not r["weight_diff"] <= (float("inf") if tied else 1e-4):
            failed.append(f"simulator, {r['scheme']}: weights {r['weight_diff']:.2e} from the CPU's, "
                          f"same bytes: {r['same_bytes']}")
    return failed


def markdown(result, command):
    def cell(r, name):
        return f"{r['ms'][name]:.3f} ms ({r['x'][name]:.1f}x)"

    lines = [
        "## GPU: compress + decompress of one tensor on a CUDA device",
        "",
        f"Made by `{command}` on {result['device_name']} (torch {result['torch']}, CUDA {result['cuda']}).",
        "fp32 gradient and memory, beta 0.1, the inputs of `benchmarks.kernels`. On CUDA tensors `clt_k`",
        "runs torch operations (the C kernels are for CPU tensors). Each call is timed from the host until",
        "the device has finished (`torch.cuda.synchronize()` after it), as a gradient hook sees it; the",
        "compressor's steps each read a few scalars back to the host (the sampled threshold, whether g is",
        "finite, how many entries reached the threshold), and each such read waits for the device. Medians",
        f"over {result['rounds']} rounds; in brackets the median ratio to the floor `m.add_(g)` of the same round.",
        "*Leader*: `select_and_take` (`\"threshold\"` selection: on CUDA `torch.topk` below 2^22 entries,",
        "the sampled threshold from there) and `filter_and_scatter_`; *exact top-k*: the same with",
        "`torch.topk` at every size; *non-leader*: `take_checking` and `filter_and_scatter_`. *Sampled",
        "threshold*: that path alone at every size (a threshold from a sample, one read to the host, a",
        "mask of `|p| >= t`, its `nonzero`, `torch.topk` among the candidates). *Gradient write",
        "alone*: `g.zero_()`; *synchronisation alone*: `torch.cuda.synchronize()` with nothing queued. "
        "Same indices as the CPU: the leader's selection on the device against torch",
        "operations on the CPU; the largest difference of m and g from the CPU's, relative to their",
        "largest entry, follows (the device may fuse `m + beta g` into one multiply-add).",
        "",
        "| entries | ratio | floor | floor GB/s | synchronisation alone | gradient write alone | "
        "leader | leader, exact top-k | "
        "non-leader | selection, threshold | selection, exact | selection, sampled threshold | "
        "overlap (sampled threshold) | same indices as the CPU | "
        "largest difference from the CPU, leader / non-leader |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in result["kernels"]:
        diff = max(r["leader_diff"]), max(r["non_leader_diff"])
        lines.append(
            f"| {r['numel']:,} | {r['ratio']:g} | {r['floor_ms']:.3f} ms | {r['floor_gbps']:.0f} | "
            + " | ".join(cell(r, name) for name in ("synchronisation alone", "gradient write alone", "leader",
                                                     "leader, exact top-k",
                                                     "non-leader", "selection (threshold)", "selection (exact)",
                                                     "selection (sampled threshold)"))
            + f" | {r['overlap']:.4f} "
            f"({'fell back' if r['sampled_overlap'] is None else format(r['sampled_overlap'], '.4f')}) | "
            f"{'yes' if r['same_indices_as_cpu'] else 'no'} | "
            f"{diff[0]:.1e} / {diff[1]:.1e} |")
    lines += [
        "",
        f"The simulator on the device: every scheme trains a 19k-parameter MLP ({result['workers']} workers,",
        f"{result['steps']} steps of SGD on random data, ratio 0.01 where a scheme takes one) on the device and,",
        "with torch operations, on the CPU; the largest difference of a weight, relative to the largest",
        "weight, and whether each worker sent the same bytes (Sketched SGD's estimates are medians of",
        "count-sketch cells that coordinates share, so they can tie, and the device's `torch.topk` may",
        "pick among entries tied at the k-th value otherwise than the CPU: its weights are reported,",
        "not checked):",
        "",
        "| scheme | weights, device against CPU | same bytes | bytes per worker |",
        "|---|---:|---|---:|",
    ]
    for r in result["simulator"]:
        lines.append(f"| {r['scheme']} | {r['weight_diff']:.1e} | {'yes' if r['same_bytes'] else 'no'} | "
                     f"{r['sent_bytes']:,.0f} |")
    return "\n".join(lines) + "\n"


def device_name(text):
    """An argparse ``type``: a device torch knows (``cuda``, ``cuda:1``, ``cpu``, ...)."""
    try:
        torch.device(text)
    except (RuntimeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({e})") from None
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", type=device_name, default="cuda",
                    help="torch device (default cuda; cpu for the smoke test)")
    ap.add_argument("--smoke", action="store_true", help="one tensor of 65,536 entries, 3 rounds, into a temp dir")
    ap.add_argument("--sizes", type=number(int, minimum=1024), nargs="+", default=None,
                    help="entries per tensor (default 2^20 and 25M)")
    ap.add_argument("--ratios", type=RATIO, nargs="+", default=None, help="default 0.01 and 0.001")
    ap.add_argument("--rounds", type=COUNT, default=None, help="rounds per variant (default 50; 3 with --smoke)")
    ap.add_argument("--out", type=output_file, default=None, help="markdown file (default docs/performance.md)")
    ap.add_argument("--json", type=output_file, default=None, help="also write the results there")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here (torch.cuda.is_available() is False); nothing measured "
              "(--device cpu runs the same steps on the CPU)", flush=True)
        return 0
    torch.set_num_threads(1)
    sizes = args.sizes or ([1 << 16] if args.smoke else SIZES)
    ratios = args.ratios or ([0.01] if args.smoke else RATIOS)
    rounds = args.rounds or (3 if args.smoke else 50)
    workers, steps = (4, 2) if args.smoke else (8, 6)
    result = {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU",
              "torch": torch.__version__, "cuda": torch.version.cuda, "rounds": rounds, "workers": workers,
              "steps": steps,
              "kernels": [measure(n, r, rounds, device) for n in sizes for r in ratios],
              "simulator": simulate(device, workers, steps)}
    text = markdown(result, command_line("gpu_kernels", argv))
    out = output_path(args.out, args.smoke, "performance.md")
    replace_section(out, "gpu_kernels", text)
    if args.json:
        write_text(args.json, json.dumps(result, indent=1))
    print(text, flush=True)
    print(f"gpu_kernels: wrote {out}", flush=True)
    failed = failures(result)
    for line in failed:
        print(f"gpu_kernels: check failed: {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
