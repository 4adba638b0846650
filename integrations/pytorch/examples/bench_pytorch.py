"""Measures the PyTorch integration on CPU and prints the tables of docs/benchmarks/package.md,
section "PyTorch integration on CPU: the example model":
policy comparison under a 2.6x spike, hook overhead with nothing to mitigate, and the
memory model's accuracy (predicted vs captured activation bytes per micro-batch).

  python integrations/pytorch/examples/bench_pytorch.py --capacity 292MiB > /tmp/bench.md
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
from typing import Any, Dict, List

import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_model import MoEConfig  # noqa: E402
from moe_train import POLICIES, summarize, train  # noqa: E402


def median_iter(r: Dict[str, Any]) -> float:
    times = r["iteration_cpu_s"][1:] or r["iteration_cpu_s"]
    return statistics.median(times) if times else float("nan")


def policies(cfg: MoEConfig, args: argparse.Namespace) -> List[str]:
    results = [train(cfg, p, args.iterations, args.micro_batches, args.stages, args.capacity,
                     2.6, args.spike_every, log_iterations=False) for p in POLICIES]
    by = {r["policy"]: r for r in results}
    out = ["## Policies under a 2.6x spike", "",
           f"{cfg.layers} layers, {cfg.experts} experts (top-{cfg.top_k}, {cfg.experts // cfg.ep} "
           f"local), hidden {cfg.hidden}, {cfg.seq_len} tokens x {cfg.micro_batch_size}, "
           f"{args.micro_batches} micro-batches, 1F1B stage 0 of {args.stages}, activation "
           f"capacity {args.capacity}, spike 2.6x every {args.spike_every} micro-batches, "
           f"{args.iterations} iterations; CPU time of the process per iteration, median over "
           "iterations 1.. (the machine is shared, so wall time is noisier).", "",
           summarize(results, args.iterations), ""]
    if by["static-over"]["finished"] > 1 and by["bagualu"]["finished"] > 1:
        ratio = median_iter(by["static-over"]) / median_iter(by["bagualu"])
        out.append(f"Iteration time static-over / bagualu: **{ratio:.2f}x** (bagualu faster by "
                   f"that factor; target >= 1.1x).")
    if by["static-under"]["oom"]:
        out.append(f"static-under: out of memory at {by['static-under']['oom'].split(':')[0]}.")
    return out + [""]


def overhead(cfg: MoEConfig, args: argparse.Namespace) -> List[str]:
    """Plain and hooked iterations alternate in one process on one model, so both see the
    same machine load; CPU time of the process per iteration, medians."""
    import bagualu
    one_f_one_b = bagualu.schedule.one_f_one_b
    from moe_model import DriftingCorpus, MoEStage
    torch.manual_seed(0)
    model = MoEStage(cfg)
    corpus = DriftingCorpus(cfg, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bagualu.install(capacity="1GiB", policy="keep-all", governor="none",
                    pipeline_stages=args.stages, micro_batches=args.micro_batches,
                    log_iterations=False)
    bagualu.instrument(model, cfg.info())
    times: Dict[bool, List[float]] = {False: [], True: []}
    wall: Dict[bool, List[float]] = {False: [], True: []}

    def iteration(it: int, hooked: bool) -> None:
        data = [corpus.batch(it) for _ in range(args.micro_batches)]
        losses: Dict[int, torch.Tensor] = {}
        opt.zero_grad(set_to_none=True)
        c0, w0 = time.process_time(), time.perf_counter()
        if hooked:
            bagualu.begin_iteration()
        for phase, f, b in one_f_one_b(args.micro_batches, args.stages, 0):
            if hooked:
                bagualu.step_point(phase, f, b)
            if f is not None:
                x, y = data[f]
                if hooked:
                    with bagualu.forward(f):
                        losses[f] = F.cross_entropy(model(x).view(-1, cfg.vocab), y.view(-1))
                else:
                    losses[f] = F.cross_entropy(model(x).view(-1, cfg.vocab), y.view(-1))
            if b is not None:
                if hooked:
                    with bagualu.backward(b):
                        losses.pop(b).backward()
                else:
                    losses.pop(b).backward()
        if hooked:
            bagualu.end_iteration()
        opt.step()
        times[hooked].append(time.process_time() - c0)
        wall[hooked].append(time.perf_counter() - w0)

    iteration(0, True)  # the capture iteration
    times = {False: [], True: []}
    wall = {False: [], True: []}
    for it in range(1, 2 * args.overhead_iterations + 1):
        iteration(it, it % 2 == 0)
    bagualu.uninstall()
    p, h = statistics.median(times[False]), statistics.median(times[True])
    pw, hw = statistics.median(wall[False]), statistics.median(wall[True])
    n = len(times[True])
    return ["## Hook overhead with nothing to mitigate", "",
            f"One process, one model: {n} plain PyTorch iterations alternating with {n} "
            "bagualu keep-all iterations (saved-tensor hooks with light capture: every saved "
            "storage counted once and its bytes accounted in blocks of libbgl_alloc's host "
            "pool), capacity 1 GiB so nothing is mitigated. Medians per iteration.", "",
            "| run | CPU time (s) | wall time (s) |", "|---|---|---|",
            f"| plain PyTorch | {p:.4f} | {pw:.4f} |",
            f"| bagualu keep-all | {h:.4f} | {hw:.4f} |", "",
            f"Overhead: **{100 * (h / p - 1):+.2f}%** CPU time, {100 * (hw / pw - 1):+.2f}% "
            "wall time (target < 3%).", ""]


def overhead_sizes(args: argparse.Namespace) -> List[str]:
    out: List[str] = []
    for cfg in (MoEConfig(layers=4, hidden=128, seq_len=64), MoEConfig(layers=4)):
        rows = overhead(cfg, args)
        label = (f"hidden {cfg.hidden}, moe_hidden {cfg.moe_hidden}, {cfg.layers} layers, "
                 f"{cfg.seq_len} tokens x {cfg.micro_batch_size}")
        out += [rows[0] + f" ({label})"] + rows[1:]
    return out


def accuracy(args: argparse.Namespace) -> List[str]:
    rows = ["## Memory model accuracy", "",
            "Planner keep-all bytes at each micro-batch's observed load factor (layer graph "
            "captured from the first micro-batch) vs the bytes PyTorch saved, per micro-batch; "
            "spikes of 2.6x every 3rd micro-batch.", "",
            "| config | micro-batches | load range | mean error | worst error |",
            "|---|---|---|---|---|"]
    errs_all: List[float] = []
    for seq, mbs, k in ((32, 2, 4), (64, 4, 4), (128, 2, 2), (64, 2, 8)):
        cfg = MoEConfig(layers=4, seq_len=seq, micro_batch_size=mbs, top_k=k)
        r = train(cfg, "keep-all", 2, 6, 2, "1GiB", 2.6, 3, log_iterations=False)
        mm = r["stats"]["memory_model"]
        loads = [ln["load_factor"] for ln in r["lines"]] + [ln["max_load_factor"]
                                                            for ln in r["lines"]]
        rows.append(f"| seq {seq}, batch {mbs}, top-{k} | {mm['samples']} | "
                    f"{min(loads):.2f}..{max(loads):.2f} | {100 * mm['mean_error']:.4f}% | "
                    f"{100 * mm['worst_error']:.4f}% |")
        errs_all.append(mm["worst_error"])
    rows += ["", f"Worst over all configurations: **{100 * max(errs_all):.4f}%** "
             "(target < 1.5%).", ""]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--capacity", default="292MiB")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--spike-every", type=int, default=16)
    p.add_argument("--overhead-iterations", type=int, default=10)
    p.add_argument("--skip", default="", help="comma list of parts to skip: policies,overhead,"
                   "accuracy")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = MoEConfig()
    skip = set(filter(None, args.skip.split(",")))
    lines = [f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"torch {torch.__version__}, 1 thread.", ""]
    if "policies" not in skip:
        lines += policies(cfg, args)
    if "overhead" not in skip:
        lines += overhead_sizes(args)
    if "accuracy" not in skip:
        lines += accuracy(args)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
