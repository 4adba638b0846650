"""Where bagualu's hook overhead goes, when nothing needs mitigation: one process, one model,
three variants alternating per iteration so all see the same machine load; CPU time medians.

  plain            plain PyTorch
  identity-hooks   plain PyTorch under saved_tensors_hooks(lambda t: t, lambda t: t): the cost
                   of PyTorch's hook calls alone
  bagualu          bagualu keep-all (light capture, embedded planner, OpBlock runner)

  BGL_LIB_DIR=build .venv/bin/python integrations/pytorch/examples/overhead_parts.py
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bagualu  # noqa: E402
from moe_model import DriftingCorpus, MoEConfig, MoEStage  # noqa: E402

VARIANTS = ("plain", "identity-hooks", "bagualu")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pairs", type=int, default=16, help="iterations of each variant")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = MoEConfig(layers=args.layers, hidden=args.hidden, seq_len=args.seq_len)
    torch.manual_seed(0)
    model = MoEStage(cfg)
    corpus = DriftingCorpus(cfg, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rt = bagualu.install(capacity="1GiB", policy="keep-all", governor="none",
                         pipeline_stages=4, micro_batches=8, log_iterations=False)
    bagualu.instrument(model, cfg.info())

    def identity(t: torch.Tensor) -> torch.Tensor:
        return t

    def iteration(it: int, variant: str) -> float:
        data = [corpus.batch(it) for _ in range(8)]
        losses: Dict[int, torch.Tensor] = {}
        opt.zero_grad(set_to_none=True)
        hooked = variant == "bagualu"
        c0 = time.process_time()
        if hooked:
            bagualu.begin_iteration()
        for phase, f, b in bagualu.schedule.one_f_one_b(8, 4, 0):
            if hooked:
                bagualu.step_point(phase, f, b)
            if f is not None:
                x, y = data[f]
                run: Callable[[], torch.Tensor] = lambda: F.cross_entropy(  # noqa: E731
                    model(x).view(-1, cfg.vocab), y.view(-1))
                if hooked:
                    with bagualu.forward(f):
                        losses[f] = run()
                elif variant == "identity-hooks":
                    with torch.autograd.graph.saved_tensors_hooks(identity, identity):
                        losses[f] = run()
                else:
                    losses[f] = run()
            if b is not None:
                if hooked:
                    with bagualu.backward(b):
                        losses.pop(b).backward()
                else:
                    losses.pop(b).backward()
        if hooked:
            bagualu.end_iteration()
        opt.step()
        return time.process_time() - c0

    iteration(0, "bagualu")  # the capture iteration
    times: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    for it in range(1, args.pairs + 1):
        for v in VARIANTS:
            times[v].append(iteration(it, v))
    del rt
    bagualu.uninstall()
    base = statistics.median(times["plain"])
    print(f"hidden {cfg.hidden}, {cfg.layers} layers, {cfg.seq_len} tokens x "
          f"{cfg.micro_batch_size}, {args.pairs} iterations of each, CPU time medians")
    print("| variant | CPU time (s) | over plain |\n|---|---|---|")
    for v in VARIANTS:
        m = statistics.median(times[v])
        print(f"| {v} | {m:.4f} | {100 * (m / base - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
