"""The host backend's per-tensor costs on this machine (issue 42 item 2): what the training thread
pays per offloaded tensor (its offload and its reload, each way: the saved-tensor hooks, the
Python side of issuing and acquiring) and per rerun operator (the recompute call's own work:
holding its inputs, restoring the RNG, the collecting hook), beyond what the rooflines and the
capture's operator times price. Written into a calibration as ``copy_host_us`` and
``rerun_host_us`` (docs/planner.md, "The host backend's per-tensor costs"), which the planner
and bgl-sim then charge.

Three runs of an unmodified model, alternating, ``--rounds`` rounds, each the median of its
iterations after the first (the capture): everything kept, every operator offloaded, every
operator recomputed (full recompute), on host copies (no emulated link: BGL_CALIBRATION is
ignored here, so a copy is a memcpy). A small model and short micro-batches (``--width 1``,
``--seq 8``) so that compute is small beside the fixed costs:

    copy_host_us  = (offload-all - keep-all - its copies alone) / copies per iteration
    rerun_host_us = (full recompute - keep-all) / reruns per iteration
                    - the capture's forward time of the operators rerun, per rerun

(the capture prices each rerun at its operator's forward time, children included, as the
closure reruns them; what a rerun costs beyond that is the fixed part). Run it under ``nice``
on a machine as loaded as the runs it is for:

    python bench/python/host_costs.py --calibration h200.json -o h200-host.json

Exit 2 naming what is wrong (a missing calibration, a run out of memory)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", required=True,
                    help="the calibration to add the fields to (e.g. an emulated link's)")
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--model", default="qwen3_moe")
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--seq", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    from bagualu.planning import calibration
    try:
        doc = calibration.load_file(args.calibration)
    except calibration.CalibrationError as e:
        print(f"host_costs: {e}", file=sys.stderr)
        return 2
    os.environ.pop("BGL_CALIBRATION", None)  # host copies: a copy is a memcpy
    import torch
    torch.set_num_threads(1)
    import bagualu
    import bench_unmodified
    import unmodified as u
    kw = dict(width=args.width, seq=args.seq, ep=False, micro_batches=args.micro_batches)
    offload_all = {op: "offload" for op in bagualu.operators(u.build(args.model,
                                                                      width=args.width))}
    runs = {"keep-all": ("keep-all", {}), "offload-all": ("keep-all", offload_all),
            "full recompute": ("static-over", None)}
    # Which operators the full recompute reruns (their names within the layer): the capture's
    # price of those reruns is the sum of their forward times.
    from bagualu import hooks_host
    reran: Dict[str, int] = {}
    before_rerun = hooks_host.HooksHost.before_rerun

    def counting(self, op, fn):  # type: ignore[no-untyped-def]
        reran[op.name] = reran.get(op.name, 0) + 1
        return before_rerun(self, op, fn)
    hooks_host.HooksHost.before_rerun = counting
    times: Dict[str, List[float]] = {k: [] for k in runs}
    per_copy: List[float] = []
    per_rerun: List[float] = []
    op_ms: List[float] = []
    t_start = time.perf_counter()
    for _ in range(args.rounds):
        one: Dict[str, Dict] = {}
        for k, (policy, forced) in runs.items():
            reran.clear()
            r = u.train(args.model, policy, capacity="4GiB", iterations=args.iterations,
                        forced=forced, **kw)
            if r["oom"] is not None:
                print(f"host_costs: {k} ran out of memory: {r['oom'].splitlines()[0]}",
                      file=sys.stderr)
                return 2
            steady = r["lines"][1:]
            one[k] = {"ms": statistics.median(r["times_ms"][1:]),
                      "copies": statistics.median(x["offloads"] for x in steady),
                      "reruns": statistics.median(x["recomputed_ops"] for x in steady),
                      "alone": bench_unmodified._copies_alone_ms(r, args.iterations) or 0.0}
            times[k].append(one[k]["ms"])
            if k == "full recompute" and r.get("model_doc"):
                ops = {o["name"]: o["forward_ms"]
                       for o in r["model_doc"]["layer_graph"]["operators"]}
                calls = sum(reran.values())
                # the captured forward of a rerun, weighted as the run reran them
                op_ms.append(sum(ops.get(n, 0.0) * c for n, c in reran.items()) / calls)
        off, rec, keep = one["offload-all"], one["full recompute"], one["keep-all"]
        if off["copies"]:
            # each offloaded tensor is copied out and back: two copies
            per_copy.append(1e3 * (off["ms"] - keep["ms"] - off["alone"]) / (2 * off["copies"]))
        if rec["reruns"]:
            per_rerun.append(1e3 * (rec["ms"] - keep["ms"]) / rec["reruns"])
    if not per_copy or not per_rerun:
        print("host_costs: the runs copied or reran nothing", file=sys.stderr)
        return 2
    # The capture already prices each rerun at its operator's forward time (inclusive of its
    # children, as the closure reruns them): the fixed cost is what a rerun takes beyond that.
    op_us = 1e3 * statistics.median(op_ms) if op_ms else 0.0
    copy_us, rerun_us = statistics.median(per_copy), statistics.median(per_rerun) - op_us
    out = dict(doc, copy_host_us=round(max(copy_us, 0.0), 1),
               rerun_host_us=round(max(rerun_us, 0.0), 1))
    out["source"] = (doc.get("source", "") + f"; copy_host_us and rerun_host_us: "
                     f"bench/python/host_costs.py ({args.model}, width {args.width}, seq "
                     f"{args.seq}, {args.rounds} rounds, {time.strftime('%Y-%m-%d %H:%M')})")
    Path(args.output).write_text(json.dumps(out, indent=1) + "\n")
    try:
        calibration.load_file(args.output)  # the planner's own check
    except calibration.CalibrationError as e:
        print(f"host_costs: {e}", file=sys.stderr)
        return 2

    def cell(v: List[float]) -> str:
        return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
    print(f"ms/iteration, median (range) of {args.rounds} rounds: "
          + "; ".join(f"{k} {cell(v)}" for k, v in times.items()))
    print(f"copies per iteration {one['offload-all']['copies']:.0f} offloads (and as many "
          f"reloads), reruns {one['full recompute']['reruns']:.0f}")
    print(f"copy_host_us {cell(per_copy)}; a rerun {cell(per_rerun)} us, less the captured "
          f"forward of the operators rerun {op_us:.0f} us per rerun: rerun_host_us {rerun_us:.1f}; "
          f"{time.perf_counter() - t_start:.0f} s; written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
