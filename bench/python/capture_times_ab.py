"""A/B of the capture's times (issue 42 item 3): 'mean' (each operator's mean over the layers
and the layer's mean, as before 2026-12-06) against 'min' (the fastest layer's, as now),
alternating, bagualu on Qwen3-MoE at the same-capacity setup (bench_unmodified.py's width 4,
128 tokens, 4 micro-batches, half of keep-all's peak), 4 iterations per run; prints per run the
median ms/iteration after the first, the offloaded and recomputed operators of each iteration
after the first, and the layer graph's forward_ms and backward_ms.

    BGL_CALIBRATION=/tmp/h200.json python bench/python/capture_times_ab.py ROUNDS"""
from __future__ import annotations

import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))
import unmodified as u  # noqa: E402

calls = importlib.import_module("bagualu.capture.calls")
NOW = (calls.OperatorCalls.robust_op_ms, calls.OperatorCalls.layer_ms,
       calls.OperatorCalls.backward_ms)


def use_means(on: bool) -> None:
    """The estimator before: the mean over the layers (on), or the fastest layer's (off)."""
    c = calls.OperatorCalls
    if on:
        c.robust_op_ms = lambda self, op_ms, kinds: dict(op_ms)
        c.layer_ms = property(lambda self: sum(self.layer_forward.values()) / self.layers)
        c.backward_ms = property(lambda self: sum(self.layer_backward.values()) / self.layers)
    else:
        c.robust_op_ms, c.layer_ms, c.backward_ms = NOW


def main(rounds: int) -> None:
    torch.set_num_threads(1)
    kw = dict(width=4, seq=128, ep=False, spike_every=0, device="cpu", spike_on_rank=False,
              micro_batches=4)
    cap = u.keep_all_peak("qwen3_moe", **kw) // 2
    for _ in range(rounds):
        for mode in ("mean", "min"):
            use_means(mode == "mean")
            r = u.train("qwen3_moe", "bagualu", capacity=cap, iterations=4, **kw)
            if r["oom"] is not None:
                print(mode, "out of memory", flush=True)
                continue
            lg = r["model_doc"]["layer_graph"]
            lines = r["lines"][1:]
            print(mode, json.dumps({
                "ms": statistics.median(r["times_ms"][1:]),
                "offload": [x["strategies"].get("offload", 0) for x in lines],
                "recompute": [x["strategies"].get("recompute", 0) for x in lines],
                "forward_ms": lg["forward_ms"], "backward_ms": lg.get("backward_ms")}),
                flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
