"""One line per iteration (load, budget, peak, strategies, moves, overhead) and the memory
model's accuracy samples; what ``bagualu.end_iteration`` logs and returns and part of
``bagualu.stats``. Not thread-safe: the training thread."""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Dict, List, Optional, Tuple

log = logging.getLogger("bagualu")


class IterationLog:
    """The iterations of one process under ``policy``."""

    def __init__(self, policy: str, capacity: int, log_lines: bool) -> None:
        self.policy = policy
        self.capacity = capacity
        self.log_lines = log_lines
        self.iteration = 0
        self.history: List[Dict[str, Any]] = []
        # (load, the planner's keep-all bytes at that load, the bytes PyTorch saved) of every
        # forward nothing was mitigated in
        self.accuracy: List[Tuple[float, float, float]] = []
        self.loads: List[float] = []
        self.recompute_ms = 0.0
        self.recompute_ops = 0
        # The iteration's scheduling points: what each forward was planned to hold and what
        # it held, so that a gap between plan and reality shows; and what planning cost.
        self.points: List[Dict[str, Any]] = []
        self._point_of: Dict[int, Dict[str, Any]] = {}
        # The iteration's downgrades after a router (note_downgrade).
        self.downgrades: List[Dict[str, Any]] = []
        self.plan_ms = 0.0
        self.cache_hits = 0
        self.cache_misses = 0
        # The routers over their plan's load that asked the planner after the gate, and the
        # time those calls took (revised or not).
        self.gate_calls = 0
        self.gate_ms = 0.0
        self._t0 = time.perf_counter()
        self._counters0: Dict[str, int] = {}
        self._ooms0 = 0

    def begin(self, counters: Dict[str, int], ooms: int, copy_wait_ns: int = 0) -> None:
        self.loads = []
        self.recompute_ms = 0.0
        self.recompute_ops = 0
        self.points = []
        self._point_of = {}
        self.downgrades = []
        self.plan_ms = 0.0
        self.cache_hits = self.cache_misses = 0
        self.gate_calls, self.gate_ms = 0, 0.0
        self._t0 = time.perf_counter()
        self._counters0 = dict(counters)
        self._ooms0 = ooms
        self._copy_wait_ns0 = copy_wait_ns

    def note_plan(self, unit: int, plan: Dict[str, Any], ms: float, in_use: int,
                  evictions: int) -> None:
        """The forward of ``unit`` was planned in ``ms`` against ``in_use`` bytes (what
        Algorithm 1 counted as used); ``evictions``: the tracker's count before its forward."""
        self.plan_ms += ms
        if plan.get("cache_hit"):
            self.cache_hits += 1
        else:
            self.cache_misses += 1
        point = {"unit": unit, "in_use_bytes": in_use,
                 "budget_bytes": int(plan["budget_bytes"]),
                 "load_factor": float(plan.get("load_factor", 1.0)),
                 "m0_bytes": int(plan.get("m0_bytes", 0)),
                 "predicted_bytes": int(plan["predicted_bytes"]), "actual_bytes": None,
                 "keep_all_bytes": int(plan.get("keep_all_bytes", 0)),
                 "evictions": 0, "cache_hit": bool(plan.get("cache_hit")),
                 "first_answer": bool(plan.get("first_answer")),
                 "refined": bool(plan.get("refined")),
                 "warm": bool(plan.get("warm")),
                 "nearest": bool(plan.get("nearest")),
                 "served": served(plan),
                 "plan_ms": ms, "_evictions0": evictions}
        self.points.append(point)
        self._point_of[unit] = point

    def note_forward(self, unit: int, actual: int, evictions: int) -> None:
        """The planned forward of ``unit`` ended holding ``actual`` in-layer bytes once its
        plan is carried out; ``evictions``: the tracker's count now."""
        point = self._point_of.pop(unit, None)
        if point is not None:
            point["actual_bytes"] = int(actual)
            point["evictions"] = evictions - point.pop("_evictions0")

    def note_downgrade(self, unit: int, layer: int, load: float, before: Dict[str, int],
                       after: Dict[str, int]) -> None:
        """The router of ``layer`` in ``unit``'s forward saw ``load``, above its plan's: the
        planner revised the rest of the forward (the deferred replan), from the strategy mix
        ``before`` (operator count per strategy over the forward's planned operators) to
        ``after``."""
        self.downgrades.append({"unit": unit, "layer": layer, "load_factor": load,
                                "before": dict(before), "after": dict(after)})

    def _with_next(self, downgrade: Dict[str, Any]) -> Dict[str, Any]:
        """``downgrade`` with ``next``: the forward planned after the downgraded one in this
        iteration (its unit, load, budget and how its plan was served), or None."""
        units = [p["unit"] for p in self.points]
        at = units.index(downgrade["unit"]) if downgrade["unit"] in units else len(units)
        nxt = self.points[at + 1] if at + 1 < len(self.points) else None
        return dict(downgrade, next=None if nxt is None else {
            "unit": nxt["unit"], "load_factor": nxt["load_factor"],
            "budget_bytes": nxt["budget_bytes"], "served": nxt["served"]})

    def note_gate(self, ms: float) -> None:
        """A router over its plan's load asked the planner after the gate; it took ``ms``."""
        self.gate_calls += 1
        self.gate_ms += ms

    def note_recompute(self, ms: float, ops: int) -> None:
        """A recompute call reran ``ops`` operators' forward in ``ms``."""
        self.recompute_ms += ms
        self.recompute_ops += ops

    def end(self, counters: Dict[str, int], ooms: int, budget: float, peak: int,
            strategies: Dict[str, int], deferred: int,
            planner: Optional[Dict[str, Any]] = None, copy_wait_ns: int = 0) -> Dict[str, Any]:
        """Closes the iteration and logs its line; returns the line's fields. ``planner``:
        the planner's counters now (bgl_planner_stats), for the warm-up's figures;
        ``copy_wait_ns``: the enforcer's blocked waits for copies so far (its stats)."""
        c0, c = self._counters0, counters
        loads = self.loads or [1.0]
        elapsed = (time.perf_counter() - self._t0) * 1e3
        line = {
            "iteration": self.iteration, "policy": self.policy,
            "load_factor": sum(loads) / len(loads), "max_load_factor": max(loads),
            "budget_bytes": None if budget == math.inf else int(budget),
            "peak_bytes": peak, "capacity_bytes": self.capacity, "strategies": strategies,
            "offloads": c["offloads"] - c0.get("offloads", 0),
            "fp8_casts": c["fp8_casts"] - c0.get("fp8_casts", 0),
            "recomputed_ops": self.recompute_ops,
            "evictions": c["evictions"] - c0.get("evictions", 0),
            "early_offloads": c.get("early_offloads", 0) - c0.get("early_offloads", 0),
            "plan_ms": self.plan_ms, "plan_cache_hits": self.cache_hits,
            "plan_cache_misses": self.cache_misses,
            "gate_calls": self.gate_calls, "gate_ms": self.gate_ms,
            # the warm-up (issue 43): this iteration's points a warm-up plan served, and the
            # warm-up's plans in the planner's cache now
            "warm_hits": sum(1 for p in self.points if p["warm"]),
            "warm_keys": int((planner or {}).get("warm_keys", 0)),
            # and its cold keys served a neighbouring key's full-search plan (Plan::nearest)
            "warm_nearest": sum(1 for p in self.points if p["nearest"]),
            "points": [{k: v for k, v in p.items() if not k.startswith("_")}
                       for p in self.points],
            "deferred": deferred, "downgrades": [self._with_next(d) for d in self.downgrades],
            "overhead_ms": self.recompute_ms, "iteration_ms": elapsed,
            # the time the training thread waited for copies and casts compute did not hide
            # (host waits: on CUDA, where waits are stream-ordered, about 0)
            "copy_wait_ms": max(copy_wait_ns - self._copy_wait_ns0, 0) / 1e6,
            "ooms": ooms - self._ooms0,
        }
        self.history.append(line)
        if self.log_lines:
            budget_text = "-" if line["budget_bytes"] is None else _mib(line["budget_bytes"])
            strat = " ".join(f"{k}={v}" for k, v in strategies.items() if v)
            log.info("bagualu: iter %d policy %s load %.2f (max %.2f) budget %s peak %s/%s "
                     "strategies %s offloads %d (early %d) fp8 %d recomputed %d evictions %d "
                     "deferred %d overhead %.1fms (%.1f%%) copy wait %.1fms "
                     "plans %d hit %d miss %.1fms gates %d %.1fms "
                     "warm %d hit %d keys nearest %d",
                     line["iteration"], self.policy,
                     line["load_factor"], line["max_load_factor"], budget_text, _mib(peak),
                     _mib(self.capacity), strat or "keep", line["offloads"],
                     line["early_offloads"], line["fp8_casts"],
                     line["recomputed_ops"], line["evictions"], line["deferred"],
                     line["overhead_ms"], 100 * line["overhead_ms"] / max(elapsed, 1e-9),
                     line["copy_wait_ms"], self.cache_hits, self.cache_misses, self.plan_ms,
                     self.gate_calls, self.gate_ms,
                     line["warm_hits"], line["warm_keys"], line["warm_nearest"])
            for d in line["downgrades"]:
                nxt = d["next"]
                log.info("bagualu: downgrade in iteration %d: micro-batch %d after the router "
                         "of layer %d (load %.2f): %s; %s", line["iteration"], d["unit"],
                         d["layer"], d["load_factor"], _mix_change(d["before"], d["after"]),
                         "no forward after it in the iteration" if nxt is None else
                         f"the next forward (micro-batch {nxt['unit']}, load "
                         f"{nxt['load_factor']:.2f}) served {nxt['served']}")
        self.iteration += 1
        return line

    def memory_model(self) -> Optional[Dict[str, Any]]:
        """The memory model's error over the accuracy samples, or None without samples."""
        if not self.accuracy:
            return None
        errs = [abs(p - c) / c for _, p, c in self.accuracy if c > 0]
        return {"samples": len(errs), "mean_error": sum(errs) / len(errs),
                "worst_error": max(errs), "points": list(self.accuracy)}


def served(plan: Dict[str, Any]) -> str:
    """How a point's plan was served: "keep-all" (nothing to mitigate), "warm" (the warm-up's
    plan for its key), "nearest" (a cold key served a neighbouring key's full-search plan),
    "first answer" (a cold key's quick answer, refined in the background), "refined" (that
    refinement, planned at an earlier point) or "full search" (searched on the call, or
    a cache hit of one)."""
    if int(plan.get("predicted_bytes", 0)) >= int(plan.get("keep_all_bytes", 0)) > 0:
        return "keep-all"
    for flag, label in (("warm", "warm"), ("nearest", "nearest"),
                        ("first_answer", "first answer"), ("refined", "refined")):
        if plan.get(flag):
            return label
    return "full search"


def _mix_change(before: Dict[str, int], after: Dict[str, int]) -> str:
    """'offload 12->20 recompute 0->4' over the strategies whose count changed."""
    keys = [k for k in ("keep", "offload", "fp8", "recompute") if k in before or k in after]
    keys += sorted(k for k in set(before) | set(after) if k not in keys)
    out = [f"{k} {before.get(k, 0)}->{after.get(k, 0)}" for k in keys
           if before.get(k, 0) != after.get(k, 0)]
    return " ".join(out) or "same mix"


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}MiB"
