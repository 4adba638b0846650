"""Iteration time of unmodified models under bagualu (at half of keep-all's peak) against what
users do today: torch.utils.checkpoint around every block, and
torch.autograd.graph.save_on_cpu; plus plain PyTorch. Alternating runs, median and spread.

    python bench_unmodified.py --models mixtral,qwen3_moe,deepseek_v3,fused --repeats 5

``--overhead``: the hook overhead with nothing to mitigate instead: plain PyTorch and bagualu
with room for everything (its plans keep every activation), alternating, on a model ``--width``
times wider with ``--seq``-token micro-batches; per model the median over repeats of each
run's median CPU time per iteration, and the overhead as the median (range) of the per-pair
ratios.

``--same-capacity``: at half of keep-all's peak (``--width``, ``--seq``, every expert local): plain
PyTorch, torch.utils.checkpoint around every block, save_on_cpu, the static policies (full
recompute: bagualu's static-over; offload-all: every operator forced to offload; "selective (matmul
outputs kept)": torchtitan's op-level selective checkpointing as forced strategies, the operators of
matmul kinds kept and the rest recomputed; "bagualu, worst-load plan": the planner's full search at
the highest load bagualu's first run saw, from a fresh point (bagualu.static_plan), forced on every
micro-batch; static-under: recompute only, sized for load 1.0, out of memory at a spike) and
bagualu, alternating (a policy that runs out of memory is a row saying so); the steady iteration
time (median and range of each run's median over iterations ``--warmup``.., default 3 of
``--iterations`` 10), the warm-up (each run's mean over its first ``--warmup`` iterations: bagualu's
first plans are coarse while it refines them in the background, and its pools grow), the peak of the
activations on the simulated device and the pressure evictions per iteration (both over every
iteration, the warm-up included); and the paired ratios of the steady times, per round, of bagualu
over plain, of checkpointing over bagualu and of bagualu over offload-all (each run right after
the other, so a drift of the machine's speed over minutes cancels), median and range over rounds.
``--policies bagualu,...``: only those (and plain). ``--spike N``: the same with expert
parallelism simulated (4 ranks, this one's experts computed) and every N-th micro-batch a batch
of the two tokens whose routing lands most on one rank, which this process stands for
(unmodified.spike_rank: a load of 2.67x balance on Qwen3-MoE and 2.0x on Mixtral at width 4), so
routing spikes there. Only bagualu skips the other
ranks' experts (its ``expert_parallel``): plain, checkpointing and save_on_cpu compute all of them,
so the policies under bagualu are compared with keep-all at twice keep-all's peak (bagualu
installed, nothing moved, this rank's experts: ``keep-all, room to spare``), not with plain;
keep-all at the same capacity runs too (it runs out of memory).

``--micro-batches N`` (default 8): micro-batches per same-capacity iteration. With
``BGL_CALIBRATION`` naming an emulated link (``python -m bagualu.planning.emulation``; docs/
planner.md, "An emulated device link") every policy under bagualu copies over that link and
plans with it; the table's header names the regime.

``--train POLICY`` (one of the same-capacity policies): one run of it on the first of
``--models`` at that setup, its iteration times printed, and per iteration its reruns' time,
copy wait, strategies and each point's budget, bytes in use and prediction: the process to
profile.

``--pool A.json,B.json,...``: no run; the rounds of several ``--same-capacity --json-out``
files of the same device, width and seq pooled per model: the median (range) of every policy's
runs, the ratios of those medians, and the paired ratios over all rounds.

``--issue-order``: bagualu at half of keep-all's peak with the plans' dual-batch issue order
carried out against the same plans issued in program order (serial), alternating; per model
the median iteration time of each and the median (range) of the per-pair ratios.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

import unmodified as u


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(u.MODELS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iterations", type=int, default=None,
                    help="iterations per run (default 10 with --same-capacity, else 3)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="--same-capacity: iterations before the steady time is measured")
    ap.add_argument("--overhead", action="store_true",
                    help="measure the hook overhead with nothing to mitigate")
    ap.add_argument("--issue-order", action="store_true",
                    help="compare the dual-batch issue order with the serial one")
    ap.add_argument("--same-capacity", action="store_true",
                    help="every policy at half of keep-all's peak (issue 22's table)")
    ap.add_argument("--capacity-fraction", type=float, default=0.5,
                    help="--same-capacity, --train: the capacity as a fraction of keep-all's "
                         "peak, in (0, 1] (default 0.5)")
    ap.add_argument("--spike", type=int, default=0,
                    help="--same-capacity: simulated EP, a skewed batch every N micro-batches")
    ap.add_argument("--device", default="cpu", help="--same-capacity: cpu or cuda")
    ap.add_argument("--json-out", default="", help="--same-capacity: the table as JSON too")
    ap.add_argument("--train", default="",
                    help="one run of this policy on the first model at the same-capacity setup "
                         "(the process to profile)")
    ap.add_argument("--pool", default="",
                    help="pool the rounds of these --same-capacity --json-out files (comma-"
                         "separated); nothing runs")
    ap.add_argument("--policies", default="",
                    help="--same-capacity: only these (comma-separated; plain always runs)")
    ap.add_argument("--sim-graphs", default="",
                    help="--same-capacity: a folder; each model's bagualu run of the first "
                         "round writes the model document it registered (MODEL.json), the "
                         "capacity it planned with (MODEL.capacity) and the plans its "
                         "iterations were served (MODEL.plans.json): bgl-sim --model and "
                         "--plans read them")
    ap.add_argument("--micro-batches", type=int, default=8,
                    help="--same-capacity: micro-batches per iteration (1F1B over 4 stages)")
    ap.add_argument("--width", type=int, default=4, help="--overhead: model width factor")
    ap.add_argument("--seq", type=int, default=128, help="--overhead: tokens per sequence")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.iterations is None:
        args.iterations = 10 if args.same_capacity or args.train else 3
    if args.pool:
        return pool(args.pool.split(","))
    if not 0 < args.capacity_fraction <= 1:
        print(f"bench_unmodified: --capacity-fraction {args.capacity_fraction} is not in (0, 1]",
              file=sys.stderr)
        return 2
    if args.train:
        return train_one(args)
    if args.same_capacity:
        if not 0 < args.warmup < args.iterations:
            print(f"bench_unmodified: --warmup {args.warmup} must be at least 1 and below "
                  f"--iterations {args.iterations}", file=sys.stderr)
            return 2
        return same_capacity(args)
    if args.overhead:
        return overhead(args)
    if args.issue_order:
        return issue_order(args)
    print("| model | capacity | plain | bagualu | checkpoint every block | save_on_cpu | "
          "bagualu strategies (last iteration) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        peak = u.keep_all_peak(name, ep=False)
        cap = peak // 2
        runs: Dict[str, List[float]] = {k: [] for k in ("plain", "bagualu", "ckpt", "cpu")}
        strat = {}
        for _ in range(args.repeats):
            for k in runs:
                gc.collect()
                r = u.train(name, "bagualu" if k == "bagualu" else None, capacity=cap,
                            iterations=args.iterations, checkpoint_layers=k == "ckpt",
                            save_on_cpu=k == "cpu", ep=False)
                assert r["oom"] is None, r["oom"]
                runs[k].append(statistics.median(r["times_ms"][1:]))  # first: warm-up
                if k == "bagualu":
                    strat = {s: n for s, n in r["lines"][-1]["strategies"].items() if n}

        def cell(k: str) -> str:
            v = runs[k]
            return (f"{statistics.median(v):.1f} ms ({min(v):.1f}-{max(v):.1f}), "
                    f"{statistics.median(v) / statistics.median(runs['plain']):.2f}x")
        print(f"| {name} | {cap / 2**20:.2f} MiB | {cell('plain')} | {cell('bagualu')} | "
              f"{cell('ckpt')} | {cell('cpu')} | {strat} |", flush=True)
    return 0


def issue_order(args: argparse.Namespace) -> int:
    print("| model | capacity | dual-batch order ms/iteration | serial order | dual-batch / "
          "serial, median (range) over pairs | pieces issued by the scheduler per iteration |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        cap = u.keep_all_peak(name, ep=False) // 2
        times: Dict[str, List[float]] = {"dual-batch": [], "serial": []}
        ratios: List[float] = []
        issued = 0
        for _ in range(args.repeats):
            one: Dict[str, float] = {}
            for order in ("dual-batch", "serial"):
                gc.collect()
                r = u.train(name, "bagualu", capacity=cap, iterations=args.iterations, ep=False,
                            issue_order=order)
                assert r["oom"] is None, r["oom"]
                one[order] = statistics.median(r["times_ms"][1:])  # first: warm-up
                times[order].append(one[order])
                if order == "dual-batch":
                    issued = r["stats"]["enforcer"]["scheduled_issued"] // args.iterations
            ratios.append(one["dual-batch"] / one["serial"])

        def cell(k: str) -> str:
            v = times[k]
            return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"
        print(f"| {name} | {cap / 2**20:.2f} MiB | {cell('dual-batch')} | {cell('serial')} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
              f"{issued} |", flush=True)
    return 0


def overhead(args: argparse.Namespace) -> int:
    print("| model | width x seq | plain CPU ms/iteration | bagualu keep-everything | overhead, "
          "median (range) over pairs | bagualu strategies |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        plain: List[float] = []
        hooked: List[float] = []
        ratios: List[float] = []
        strat: Dict[str, int] = {}
        for _ in range(args.repeats):
            one: Dict[str, float] = {}
            for k in ("plain", "bagualu"):
                gc.collect()
                r = u.train(name, "bagualu" if k == "bagualu" else None, capacity="8GiB",
                            iterations=args.iterations, ep=False, width=args.width,
                            seq=args.seq)
                assert r["oom"] is None, r["oom"]
                one[k] = statistics.median(r["cpu_ms"][1:])  # first: warm-up and capture
                if k == "bagualu":
                    strat = {s: n for s, n in r["lines"][-1]["strategies"].items() if n}
            plain.append(one["plain"])
            hooked.append(one["bagualu"])
            ratios.append(100 * (one["bagualu"] / one["plain"] - 1))
        print(f"| {name} | {args.width} x {args.seq} | {statistics.median(plain):.1f} | "
              f"{statistics.median(hooked):.1f} | {statistics.median(ratios):+.2f}% "
              f"({min(ratios):+.2f}% to {max(ratios):+.2f}%) | {strat} |", flush=True)
    return 0


# bagualu runs right after plain and checkpointing right after bagualu in every round, so that
# the paired ratios compare runs seconds apart (the machine's speed drifts over minutes).
# The static policies after bagualu: SELECTIVE (torchtitan's op-level selective checkpointing:
# the outputs of matmuls kept, the rest recomputed), WORST_LOAD (bagualu's plan for the highest
# load its run of the round saw, forced on every micro-batch: it needs that run before it) and
# static-under (recompute only, sized for load 1.0: under a spike it runs out of memory).
SELECTIVE = "selective (matmul outputs kept)"
WORST_LOAD = "bagualu, worst-load plan"
# bagualu with every point planned for that highest load (install's min_load_factor): its plans
# and issue order at the worst load, per point, no downgrade after a router.
WORST_POINTS = "bagualu, every point at the worst load"
SAME_CAPACITY = ("plain", "bagualu", "checkpoint every block", "save_on_cpu", "full recompute",
                 "offload-all", SELECTIVE, WORST_LOAD, WORST_POINTS, "static-under")
# The operator kinds (vocabulary.KINDS) whose outputs are a matmul's, or attention's (torchtitan's
# op-level policy saves scaled_dot_product_attention's too), or a collective's: SELECTIVE keeps
# them and recomputes every other operator.
MATMUL_KINDS = ("linear", "attention", "router", "expert_linear", "shared_linear", "comm")
# The policies that run without bagualu: under --spike they compute every expert, since only
# bagualu's expert_parallel skips the other ranks' (examples/unmodified.py instrument_kwargs).
ALL_EXPERTS = ("plain", "checkpoint every block", "save_on_cpu")
# Under --spike, the baseline that computes this rank's experts as bagualu's policies do:
# bagualu installed, everything kept, at twice keep-all's peak (it never runs short).
EP_BASELINE = "keep-all, room to spare"


def _base_key(k: str, spike: int) -> str:
    """The row policy ``k``'s time is compared with: plain, or under a spike, for the policies
    that compute this rank's experts only, EP_BASELINE."""
    return EP_BASELINE if spike and k not in ALL_EXPERTS else "plain"


def _paired(times: Dict[str, List[float]], spike: int = 0) -> Dict[str, List[float]]:
    """Per round, bagualu over plain and checkpointing over bagualu (runs seconds apart), of
    the policies that ran every round; under a spike bagualu over EP_BASELINE instead (plain
    and checkpointing compute every expert there); bagualu over offload-all where both ran
    (issue 43's bar)."""
    b, c = times.get("bagualu", []), times.get("checkpoint every block", [])
    p = times.get(_base_key("bagualu", spike), [])
    o = times.get("offload-all", [])
    out: Dict[str, List[float]] = {}
    if b and len(b) == len(p):
        out["bagualu/" + _base_key("bagualu", spike)] = [b[i] / p[i] for i in range(len(b))]
    if b and len(b) == len(c) and not spike:
        out["checkpoint/bagualu"] = [c[i] / b[i] for i in range(len(b))]
    if b and len(b) == len(o):
        out["bagualu/offload-all"] = [b[i] / o[i] for i in range(len(b))]
    return out


def _setup(args: argparse.Namespace) -> Dict:
    """train()'s arguments of the same-capacity setup (``--width``, ``--seq``, ``--spike``)."""
    return dict(width=args.width, seq=args.seq, ep=args.spike > 0, spike_every=args.spike,
                device=args.device, spike_on_rank=args.spike > 0,
                micro_batches=args.micro_batches)


def selective_forced(kinds: Dict[str, str]) -> Dict[str, str]:
    """SELECTIVE as strategies forced per operator (operator name -> strategy, every layer):
    the operators of ``kinds`` (name -> kind, as bagualu.operators gives them) of a
    MATMUL_KINDS kind keep their outputs, the others are recomputed."""
    return {op: "keep" if kind in MATMUL_KINDS else "recompute" for op, kind in kinds.items()}


def worst_load_plan(r: Dict) -> Tuple[Dict[str, str], float]:
    """WORST_LOAD's strategies (qualname -> strategy) and the load they were planned for, of a
    bagualu run made with ``worst_load_plan=True``: the planner's full search at the highest
    load factor the run saw, from a fresh point (``bagualu.static_plan``), not one of the plans
    the run was served (a router's revision of a plan made for a lower load). ValueError naming
    what is missing when the run has none."""
    w = r.get("worst_load_plan")
    if not w or not w.get("strategies"):
        raise ValueError("the bagualu run has no worst-load plan (run it with "
                         "worst_load_plan=True; a run that ended in its capture has none)")
    return dict(w["strategies"]), float(w["load_factor"])


def _run(name: str, k: str, cap: int, forced: Dict[str, Dict[str, str]], iterations: int,
         kw: Dict, worst_load: Optional[float] = None, worst_plan: bool = False) -> Dict:
    """One run of policy ``k`` (a SAME_CAPACITY name, keep-all or EP_BASELINE) at capacity
    ``cap``; ``forced``: the strategies forced per operator of the policies made of them
    (offload-all, SELECTIVE, WORST_LOAD), by policy; ``worst_load``: WORST_POINTS's load;
    ``worst_plan``: a bagualu run also computes WORST_LOAD's plan (worst_load_plan)."""
    policy = {"full recompute": "static-over", "offload-all": "keep-all", SELECTIVE: "keep-all",
              WORST_LOAD: "keep-all", "static-under": "static-under", WORST_POINTS: "bagualu",
              "bagualu": "bagualu", "keep-all": "keep-all", EP_BASELINE: "keep-all"}.get(k)
    if k == WORST_POINTS and worst_load is None:
        raise ValueError(f"{WORST_POINTS!r} needs the worst load (bagualu's run before it)")
    return u.train(name, policy, capacity=cap, iterations=iterations,
                   checkpoint_layers=k == "checkpoint every block",
                   save_on_cpu=k == "save_on_cpu", forced=forced.get(k),
                   worst_load_plan=worst_plan and k == "bagualu",
                   min_load_factor=worst_load if k == WORST_POINTS else None, **kw)


def forced_policies(name: str, width: int) -> Dict[str, Dict[str, str]]:
    """The strategies forced per operator of offload-all and SELECTIVE on model ``name``,
    from the kinds of its operators as bagualu finds them."""
    import bagualu
    kinds = bagualu.operators(u.build(name, width=width))
    return {"offload-all": {op: "offload" for op in kinds}, SELECTIVE: selective_forced(kinds)}


def chosen_policies(text: str, spike: int) -> Tuple[str, ...]:
    """The same-capacity policies to run, in their running order: every one, or those named in
    ``text`` (comma-separated) with plain, the spike's baseline under a spike, and bagualu
    where WORST_LOAD or WORST_POINTS is named (their load comes from bagualu's run).
    ValueError naming the unknown ones and the known ones."""
    policies = SAME_CAPACITY + (("keep-all", EP_BASELINE) if spike else ())
    if not text:
        return policies
    # A name may hold a comma (WORST_LOAD's): the longest run of pieces that makes a known
    # name is one.
    pieces, named = [p.strip() for p in text.split(",")], set()
    i = 0
    while i < len(pieces):
        j = next((j for j in range(len(pieces), i + 1, -1)
                  if ", ".join(pieces[i:j]) in policies), i + 1)
        if ", ".join(pieces[i:j]):
            named.add(", ".join(pieces[i:j]))
        i = j
    unknown = named - set(policies)
    if unknown:
        raise ValueError(f"unknown policies {sorted(unknown)}; known: {', '.join(policies)}")
    chosen = named | {"plain"} | ({EP_BASELINE} if spike else set()) | (
        {"bagualu"} if named & {WORST_LOAD, WORST_POINTS} else set())
    return tuple(k for k in policies if k in chosen)


def _copies_alone_ms(r: Dict, iterations: int):
    """The time of the copies a bagualu run made, measured alone right after it in the same
    process: its offloads and reloads per iteration (the tracker's counters over the run), each
    as torch's copy of a fresh tensor of the run's mean size into a fresh destination (as a move
    copies a storage it has not touched since its kernel wrote it); None for a run without
    bagualu or without copies."""
    c = r.get("stats", {}).get("tracker")
    if not c or not (c["offloads"] or c["reloads"]):
        return None
    total = 0.0
    for n, nbytes in ((c["offloads"], c["bytes_d2h"]), (c["reloads"], c["bytes_h2d"])):
        per = -(-n // iterations)  # copies per iteration, rounded up
        if per == 0:
            continue
        size = max(1, nbytes // n)
        src = [torch.empty(size, dtype=torch.uint8).fill_(1) for _ in range(per)]
        dst = [torch.empty(size, dtype=torch.uint8) for _ in range(per)]
        t0 = time.perf_counter()
        for a, b in zip(src, dst):
            b.copy_(a)
        total += time.perf_counter() - t0
        del src, dst
    return 1e3 * total


def _spent_cell(spent: Optional[Dict[str, List[float]]]) -> str:
    """Reruns / copy wait (ms per iteration, the median over runs of each run's median), or
    empty for a run without bagualu's lines."""
    if not spent:
        return ""
    return (f"{statistics.median(spent['overhead_ms']):.1f} / "
            f"{statistics.median(spent['copy_wait_ms']):.1f}")


def _range_cell(v) -> str:
    """median (min-max) of ``v``, or empty."""
    return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" if v else ""


def train_one(args: argparse.Namespace) -> int:
    """One run of ``--train POLICY`` on the first of ``--models`` at the same-capacity setup:
    the process to profile (py-spy attached after its warm-up; bench/python/spy_shares.py)."""
    known = SAME_CAPACITY + ("keep-all",)
    if args.train not in known:
        print(f"bench_unmodified: unknown --train policy {args.train!r}; known: "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    name, kw = args.models.split(",")[0], _setup(args)
    cap = int(u.keep_all_peak(name, **kw) * args.capacity_fraction)
    forced = forced_policies(name, args.width)
    load = None
    if args.train in (WORST_LOAD, WORST_POINTS):
        r = _run(name, "bagualu", cap, forced, args.iterations, kw, worst_plan=True)
        forced[WORST_LOAD], load = worst_load_plan(r)
        print(f"{name}: the worst load {load:.2f}")
    r = _run(name, args.train, cap, forced, args.iterations, kw, load)
    if r["oom"] is not None:
        print(f"{name} {args.train}: out of memory: {r['oom'].splitlines()[0]}")
        return 1
    print(f"{name} {args.train}: ms/iteration {[round(t) for t in r['times_ms']]}", flush=True)
    mb = 1e6
    for line in r["lines"]:  # where each iteration's time and memory went (bagualu's lines)
        points = line["points"]
        print(f"  iteration {line['iteration']}: reruns {line['overhead_ms']:.1f} ms, copy wait "
              f"{line['copy_wait_ms']:.1f} ms, planning {line['plan_ms']:.1f} ms at "
              f"{len(points)} points and {line['gate_ms']:.1f} ms at {line['gate_calls']} "
              f"gates ({line['deferred']} revised), strategies {line['strategies']}, evictions "
              f"{line['evictions']}; points' budget / in use / predicted (MB): "
              + ", ".join(f"{p['budget_bytes'] / mb:.2f} / {p['in_use_bytes'] / mb:.2f} / "
                          f"{p['predicted_bytes'] / mb:.2f}" for p in points), flush=True)
    return 0


def same_capacity(args: argparse.Namespace) -> int:
    """Issue 22's table: every policy at half of keep-all's peak, alternating runs."""
    import os
    try:
        policies = chosen_policies(args.policies, args.spike)
    except ValueError as e:
        print(f"bench_unmodified: --policies: {e}", file=sys.stderr)
        return 2
    kw = _setup(args)
    table: Dict[str, Dict] = {}
    w = args.warmup
    regime = "host copies"
    cal = os.environ.get("BGL_CALIBRATION")
    if cal and cal != "profile":
        link = json.loads(open(cal).read()).get("emulated_link")
        regime = f"emulated link: {link['stands_for']}" if link else f"calibration {cal}"
    print(f"Regime: {regime}; {args.micro_batches} micro-batches per iteration"
          f"{f', spike every {args.spike}' if args.spike else ''}.\n")
    print(f"| model | policy | ms/iteration from iteration {w}, median (range) | vs plain | "
          f"vs checkpoint | warm-up: ms/iteration of iterations 0-{w - 1}, median (range) | "
          "activation peak | fits | evictions/iteration | strategies (last iteration) | "
          "max load factor | its copies alone: ms/iteration, median (range) | "
          "reruns / copy wait: ms/iteration, medians |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models.split(","):
        peak = u.keep_all_peak(name, **kw)
        cap = int(peak * args.capacity_fraction)
        # Under a spike, keep-all at the same capacity too (it runs out of memory), and the
        # baseline of the policies that compute this rank's experts only (chosen_policies).
        forced = forced_policies(name, args.width)
        times: Dict[str, List[float]] = {k: [] for k in policies}
        warm: Dict[str, List[float]] = {k: [] for k in policies}
        info: Dict[str, Dict] = {}
        copies_ms: Dict[str, List[float]] = {}  # _copies_alone_ms per run
        spent: Dict[str, Dict[str, List[float]]] = {}  # reruns and copy waits, per run
        for _ in range(args.repeats):
            for k in policies:
                if "oom" in info.get(k, {}):
                    continue  # ran out of memory once: it will again
                if k in (WORST_LOAD, WORST_POINTS) and "planned_load" not in info.get(k, {}):
                    if "bagualu" not in times or not times["bagualu"]:
                        continue  # bagualu ran out of memory: no plan to take
                    info[k] = {"planned_load": forced_load}
                    forced[WORST_LOAD] = worst_plan
                gc.collect()
                r = _run(name, k, 2 * peak if k == EP_BASELINE else cap, forced,
                         args.iterations, kw, info.get(k, {}).get("planned_load"),
                         worst_plan=not times.get("bagualu"))
                if r["oom"] is not None:
                    info[k] = {"oom": r["oom"]}
                    continue
                if args.sim_graphs and k == "bagualu" and not times[k]:
                    os.makedirs(args.sim_graphs, exist_ok=True)
                    base = os.path.join(args.sim_graphs, name)
                    with open(base + ".json", "w") as f:
                        json.dump(r["model_doc"], f, indent=1)
                    with open(base + ".capacity", "w") as f:
                        f.write(f"{r['plan_capacity']}\n")
                    with open(base + ".plans.json", "w") as f:
                        json.dump(r["served_plans"], f)
                if k == "bagualu" and not times[k]:
                    # WORST_LOAD's plan: computed once, from the first round's bagualu run
                    worst_plan, forced_load = worst_load_plan(r)
                times[k].append(statistics.median(r["times_ms"][w:]))
                warm[k].append(statistics.fmean(r["times_ms"][:w]))
                lines = r["lines"]  # peak and evictions: every iteration, the warm-up too
                copies = _copies_alone_ms(r, args.iterations)
                if copies is not None:
                    copies_ms.setdefault(k, []).append(copies)
                if lines:
                    # where the time went after the warm-up: reruns, and waits for copies
                    for key in ("overhead_ms", "copy_wait_ms"):
                        spent.setdefault(k, {}).setdefault(key, []).append(
                            statistics.median(x.get(key, 0.0) for x in lines[w:]))
                    info[k] = {**info.get(k, {}), "peak": max(x["peak_bytes"] for x in lines),
                               "evictions": max(x["evictions"] for x in lines),
                               "max_load": max(x["max_load_factor"] for x in lines),
                               "strategies": {s: n for s, n in lines[-1]["strategies"].items()
                                              if n}}
        meds = {k: statistics.median(v) for k, v in times.items() if v}
        ckpt = meds.get("checkpoint every block", float("nan"))
        table[name] = {"capacity_bytes": cap, "keep_all_peak_bytes": peak,
                       "warmup_iterations": w,
                       "runs": {k: {"ms": times[k], "warmup_ms": warm[k],
                                    "copies_alone_ms": copies_ms.get(k, []),
                                    "rerun_ms": spent.get(k, {}).get("overhead_ms", []),
                                    "copy_wait_ms": spent.get(k, {}).get("copy_wait_ms", []),
                                    **info.get(k, {})}
                                for k in policies}}
        for k in policies:
            v, i = times[k], info.get(k, {})
            if "oom" in i:
                print(f"| {name} | {k} | out of memory | | | | | no | | | | | |", flush=True)
                continue
            if not v:  # WORST_LOAD without a plan: bagualu ran out of memory every round
                print(f"| {name} | {k} | not run (no bagualu run to take the plan from) | | | "
                      f"| | | | | | | |", flush=True)
                continue
            med = statistics.median(v)
            label = f"{k} (planned at load {i['planned_load']:.2f})" if "planned_load" in i else k
            if k == "plain":
                peak_cell, fits = f"{peak / 2**20:.2f} MiB (keep-all)", "no"
            elif k == "save_on_cpu":
                peak_cell, fits = "0 (all saved on the host)", "yes"
            elif k == "checkpoint every block":
                peak_cell, fits = "not counted (its saves bypass the pool)", "-"
            elif k == EP_BASELINE:
                peak_cell, fits = f"{i['peak'] / 2**20:.2f} MiB", "- (twice keep-all's peak)"
            else:
                peak_cell = f"{i['peak'] / 2**20:.2f} MiB"
                fits = "yes" if i["peak"] <= cap else "no"
            # nan: it did not run; under a spike it computes other experts than bagualu's rows
            comparable = ckpt == ckpt and _base_key(k, args.spike) == "plain"
            vs_ckpt = f"{ckpt / med:.2f}x" if comparable else ""
            base = meds.get(_base_key(k, args.spike), float("nan"))
            wv = warm[k]
            print(f"| {name} | {label} | {med:.1f} ({min(v):.1f}-{max(v):.1f}) | {med / base:.2f}x "
                  f"| {vs_ckpt} | {statistics.median(wv):.1f} ({min(wv):.1f}-{max(wv):.1f}) | "
                  f"{peak_cell} | {fits} | {i.get('evictions', '')} | "
                  f"{i.get('strategies', '')} | "
                  f"{format(i['max_load'], '.2f') if 'max_load' in i else ''} | "
                  f"{_range_cell(copies_ms.get(k))} | {_spent_cell(spent.get(k))} |", flush=True)
        print(f"| {name} | capacity | {cap / 2**20:.2f} MiB ({args.capacity_fraction:g} of "
              f"keep-all's {peak / 2**20:.2f} MiB) | | | | | | | | | | |", flush=True)
        if args.spike:
            print(f"| {name} | note | {', '.join(ALL_EXPERTS)} compute all experts (no "
                  f"bagualu to skip the other ranks'): the other rows, this rank's only, are "
                  f"compared with {EP_BASELINE} | | | | | | | | | | |", flush=True)
        paired = _paired(times, args.spike)
        if paired:
            table[name]["paired"] = paired
            print(f"| {name} | paired, same round | " + "; ".join(
                f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                for k, v in paired.items()) + " | | | | | | | | | | |", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"device": args.device, "width": args.width, "seq": args.seq,
                       "spike": args.spike, "models": table}, f, indent=1)
    return 0


def pool(paths: List[str]) -> int:
    """Pools the rounds of several same-capacity JSON files (``--json-out``) per model; exit 2
    with the file and what is wrong where one cannot be read or does not match the first."""
    runs: Dict[str, Dict[str, List[float]]] = {}
    paired: Dict[str, Dict[str, List[float]]] = {}
    setup = None
    for path in paths:
        try:
            with open(path) as f:
                doc = json.load(f)
            this = {k: doc[k] for k in ("device", "width", "seq", "spike")}
            models = doc["models"]
            for name, m in models.items():
                for k, r in m["runs"].items():
                    runs.setdefault(name, {}).setdefault(k, []).extend(float(x) for x in r["ms"])
                for k, v in m.get("paired", {}).items():
                    paired.setdefault(name, {}).setdefault(k, []).extend(float(x) for x in v)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"bench_unmodified: --pool {path}: not a --same-capacity --json-out file "
                  f"({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        if setup is None:
            setup = this
        elif this != setup:
            print(f"bench_unmodified: --pool {path}: measured at {this}, the first file at "
                  f"{setup}; pool files of one setup", file=sys.stderr)
            return 2
    print("| model | policy | runs | ms/iteration, median (range) | vs plain | vs checkpoint |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, by in runs.items():
        med = {k: statistics.median(v) for k, v in by.items() if v}
        ckpt = med.get("checkpoint every block")
        for k, v in by.items():
            if not v:
                continue
            base_k = _base_key(k, setup["spike"])
            base = med.get(base_k)
            vs_plain = f"{med[k] / base:.2f}x" + ("" if base_k == "plain" else f" of {base_k}") \
                if base else ""
            vs_ckpt = f"{ckpt / med[k]:.2f}x" if ckpt and base_k == "plain" else ""
            print(f"| {name} | {k} | {len(v)} | {med[k]:.1f} ({min(v):.1f}-{max(v):.1f}) | "
                  f"{vs_plain} | {vs_ckpt} |")
        pairs = paired.get(name, {})
        if pairs:
            print(f"| {name} | paired, same round | " + "; ".join(
                f"{k} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f}) over {len(v)}"
                for k, v in pairs.items() if v) + " | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
