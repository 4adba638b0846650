"""Every block compiled (torch.compile, inductor, fullgraph=True, in place) with and without
bagualu, against eager: Qwen3-MoE from transformers 5 (a small config, ``--width`` times
wider, ``--seq``-token micro-batches), stage 0 of a 4-stage 1F1B pipeline in one process.

Each run is a fresh process (its own dynamo state; inductor's caches as they are, or with
``--cold`` a new empty cache directory per run, so every compile starts from nothing). Runs
alternate over ``--repeats``; per configuration the median (range) of the first iteration
(the compile) and of the median of the later iterations.

    python bench_compiled.py --repeats 3 --iterations 4

Configurations: plain compiled, bagualu compiled and bagualu eager with nothing to mitigate
(``--capacity``, its plans keep everything); bagualu compiled and bagualu eager at half of
their own keep-all peaks (measured first in the same process, whose run compiles the blocks:
the first iteration of these is no compile time).

``--same-capacity F`` (issue 41): every configuration at one activation capacity, F times
eager keep-all's peak (measured first, in a process of its own): plain compiled (no limit: the
reference time), bagualu compiled per operator, bagualu compiled per block, bagualu eager,
bagualu compiled per operator with the experts' recompute variant (issue 41 item 2,
``compiled_recompute="auto"``), torch's selective checkpointing under compile (matmul outputs
saved, the rest recomputed) and the partitioner's activation memory budget (``--budget``;
``--calibration``: bagualu's, an emulated link making copies cost what they would there);
per configuration the iteration time and the activation peak (bagualu's accounting; plain PyTorch's saved storages counted by
a saved-tensors hook over the 1F1B schedule), and whether it fits the capacity.

    python bench_compiled.py --same-capacity 0.5 --repeats 2 --iterations 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("plain compiled", "bagualu compiled", "bagualu eager", "bagualu compiled half peak",
           "bagualu eager half peak")
SAME = ("plain compiled", "bagualu compiled per operator",
        "bagualu compiled per operator with recompute", "bagualu compiled per block",
        "bagualu eager", "selective checkpointing compiled", "memory budget compiled")


def one_same(args: argparse.Namespace) -> Dict[str, Any]:
    """One run of the same-capacity series (``--one`` with ``--same-capacity``)."""
    import torch

    import unmodified as u
    torch.set_num_threads(args.threads)
    kw: Dict[str, Any] = dict(ep=False, width=args.width, seq=args.seq,
                              iterations=args.iterations, spike_every=0)
    c = args.one
    if c == "probe":
        full = u.train("qwen3_moe", "keep-all", capacity="4GiB", forced={},
                       **{**kw, "iterations": 1})
        return {"peak": max(int(line["peak_bytes"]) for line in full["lines"])}
    if "compiled" in c:
        kw.update(compiled="in-place", compile_options={"fullgraph": True})
    if c == "memory budget compiled":
        import torch._functorch.config as functorch_config
        functorch_config.activation_memory_budget = args.budget
    if c.startswith("bagualu"):
        kw["compiled_operators"] = "block" if "per block" in c else "operators"
        if "with recompute" in c:  # issue 41 item 2: the experts' recompute variant
            kw["compiled_recompute"] = "auto"
        r = u.train("qwen3_moe", "bagualu", capacity=int(args.capacity), allow_fp8=False,
                    calibration=args.calibration, **kw)
    else:
        r = u.train("qwen3_moe", None, measure_saved=True,
                    checkpoint_layers=c.startswith("selective"), selective=True, **kw)
    if r["oom"]:
        return {"oom": r["oom"][:200]}
    out: Dict[str, Any] = {"first_s": r["times_ms"][0] / 1e3,
                           "steady_ms": statistics.median(r["times_ms"][1:]),
                           "steady_cpu_ms": statistics.median(r["cpu_ms"][1:])}
    if "lines" in r and r["lines"]:
        out["peak"] = max(int(line["peak_bytes"]) for line in r["lines"])
        t = r["stats"]["tracker"]
        out["moved"] = f"{t['offloads']} offloads, {t['recomputes']} recomputes"
        rc = r["stats"].get("compiled", {}).get("recompute", {})
        if rc.get("operators_recomputed"):
            out["moved"] += f", {rc['operators_recomputed']} operators recomputed in graphs"
    else:
        out["peak"] = r.get("saved_peak", 0)
    return out


def one(args: argparse.Namespace) -> Dict[str, Any]:
    """One run in this process (``--one``)."""
    import torch

    import unmodified as u
    torch.set_num_threads(args.threads)
    kw: Dict[str, Any] = dict(ep=False, width=args.width, seq=args.seq,
                              iterations=args.iterations, spike_every=0)
    compiled = "compiled" in args.one and "eager" not in args.one
    if compiled:
        kw.update(compiled="in-place", compile_options={"fullgraph": True})
    policy = None if args.one.startswith("plain") else "bagualu"
    capacity: Any = args.capacity
    if "half peak" in args.one:
        full = u.train("qwen3_moe", "keep-all", capacity=args.capacity, forced={},
                       **{**kw, "iterations": 1})
        capacity = max(int(line["peak_bytes"]) for line in full["lines"]) // 2
    r = u.train("qwen3_moe", policy, capacity=capacity, **kw)
    if r["oom"]:
        raise SystemExit(f"{args.one}: out of memory: {r['oom']}")
    out: Dict[str, Any] = {"first_s": r["times_ms"][0] / 1e3,
                           "steady_ms": statistics.median(r["times_ms"][1:]),
                           "first_cpu_s": r["cpu_ms"][0] / 1e3,
                           "steady_cpu_ms": statistics.median(r["cpu_ms"][1:]),
                           "capacity": capacity}
    if policy is not None:
        t = r["stats"]["tracker"]
        out["moved"] = {"offloads": t["offloads"], "fp8": t["fp8_casts"],
                        "recomputes": t["recomputes"]}
    try:
        from torch._dynamo.utils import counters
        out["graphs"] = counters["stats"]["unique_graphs"]
        out["breaks"] = sum(counters["graph_break"].values())
    except ImportError:
        pass
    return out


def run(config: str, args: argparse.Namespace) -> Dict[str, Any]:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        if args.cold:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache
        cmd = [sys.executable, os.path.abspath(__file__), "--one", config,
               "--width", str(args.width), "--seq", str(args.seq), "--iterations",
               str(args.iterations), "--capacity", args.capacity, "--threads",
               str(args.threads), "--same-capacity", str(args.same_capacity), "--budget",
               str(args.budget)] + (["--calibration", args.calibration] if args.calibration
                                    else [])
        p = subprocess.run(cmd, env=env, cwd=HERE, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{config}: exit {p.returncode}\n{p.stdout[-2000:]}{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def spread(xs: List[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--capacity", default="1GiB", help="room for everything")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cold", action="store_true", help="an empty inductor cache per run")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--same-capacity", type=float, default=0.0,
                    help="every configuration at this fraction of eager keep-all's peak")
    ap.add_argument("--budget", type=float, default=0.5,
                    help="activation_memory_budget of the memory-budget configuration")
    ap.add_argument("--calibration", help="bagualu's calibration in the same-capacity series "
                    "(an emulated link: python -m bagualu.planning.emulation)")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_same(args) if args.same_capacity else one(args)))
        return 0
    if args.same_capacity:
        return same_capacity(args)
    configs = args.configs.split(",")
    results: Dict[str, List[Dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            results[c].append(run(c, args))
    print(f"Qwen3-MoE width {args.width}, seq {args.seq}, 8 micro-batches, "
          f"{args.iterations} iterations, {args.repeats} repeats"
          f"{', cold inductor cache' if args.cold else ''}")
    print("| configuration | first iteration, wall (s) | CPU (s) | later iterations, wall (ms) | "
          "CPU (ms) | graphs / breaks | capacity | moved (last run) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        rs = results[c]
        g = f"{rs[-1].get('graphs', '-')} / {rs[-1].get('breaks', '-')}"
        print(f"| {c} | {spread([r['first_s'] for r in rs], '{:.1f}')} | "
              f"{spread([r['first_cpu_s'] for r in rs], '{:.1f}')} | "
              f"{spread([r['steady_ms'] for r in rs], '{:.0f}')} | "
              f"{spread([r['steady_cpu_ms'] for r in rs], '{:.0f}')} | {g} | "
              f"{rs[-1]['capacity']} | {rs[-1].get('moved', '-')} |")
    if len(configs) >= 2 and len(results[configs[0]]) > 0:
        a, b = results[configs[0]], results[configs[1]]
        for key in ("first_cpu_s", "steady_cpu_ms"):
            ratios = [y[key] / x[key] for x, y in zip(a, b)]
            print(f"{configs[1]} / {configs[0]}, {key}, per repeat: "
                  f"{spread(ratios, '{:.3f}')}")
    return 0


def same_capacity(args: argparse.Namespace) -> int:
    """The same-capacity series (module docstring)."""
    peak = run("probe", args)["peak"]
    args.capacity = str(int(peak * args.same_capacity))
    configs = args.configs.split(",") if args.configs != ",".join(CONFIGS) else list(SAME)
    results: Dict[str, List[Dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(args.repeats):
        for c in configs:
            results[c].append(run(c, args))
    cap = int(args.capacity)
    print(f"Qwen3-MoE width {args.width}, seq {args.seq}, 8 micro-batches (stage 0 of a 4-stage "
          f"1F1B), {args.iterations} iterations, {args.repeats} repeats; capacity {cap} bytes "
          f"= {args.same_capacity} x eager keep-all's peak ({peak}); inductor")
    print("| configuration | later iterations, wall (ms) | CPU (ms) | x plain compiled (CPU) | "
          "activation peak (bytes) | fits | moved (last run) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = [r.get("steady_cpu_ms") for r in results.get("plain compiled", [])]
    for c in configs:
        rs = [r for r in results[c] if "oom" not in r]
        if not rs:
            print(f"| {c} | out of memory | | | | no | |")
            continue
        ratio = "-"
        if base and all(base) and len(base) == len(results[c]):
            ratio = spread([r["steady_cpu_ms"] / b for r, b in zip(rs, base)], "{:.2f}")
        peak_c = max(r["peak"] for r in rs)
        print(f"| {c} | {spread([r['steady_ms'] for r in rs], '{:.0f}')} | "
              f"{spread([r['steady_cpu_ms'] for r in rs], '{:.0f}')} | {ratio} | {peak_c} | "
              f"{'yes' if peak_c <= cap else 'no'} | {rs[-1].get('moved', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
