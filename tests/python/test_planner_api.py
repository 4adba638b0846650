"""The embedded planner over ctypes and the allocator pool."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, require_libs
from bagualu.errors import OutOfMemoryError, PlannerError
from bagualu.planning.embedded import EmbeddedPlanner


def test_plans_the_demo_model() -> None:
    """At a capacity below keep-all's the plan mitigates (not an all-keep plan) and fits its
    budget; the report of what it predicted is taken."""
    require_libs()
    model = json.loads((ROOT / "models" / "tiny-moe.json").read_text())
    point = {"phase": "warmup", "forward_micro_batch": 0, "load_factor": 1.0}
    roomy = EmbeddedPlanner(model, {"capacity_bytes": 64 << 30})
    assert roomy.description["micro_batches"] == 8
    keep_all = roomy.plan(dict(point))
    roomy.close()
    assert {o["strategy"] for o in keep_all["operators"]} == {"keep"}
    plan, cap = None, 4 << 30
    while cap > 1 << 26:  # the largest capacity whose plan mitigates something
        try:
            p = EmbeddedPlanner(model, {"capacity_bytes": cap})
        except PlannerError:  # too small for the weights: no capacity left to try
            break
        plan = p.plan(dict(point))
        if any(o["strategy"] != "keep" for o in plan["operators"]):
            break
        p.close()
        cap = cap * 3 // 4
    strategies = {o["strategy"] for o in plan["operators"]}
    assert strategies <= {"keep", "offload", "fp8", "recompute"}
    assert strategies != {"keep"}, f"every capacity down to {cap} planned keep-all"
    assert 0 < plan["predicted_bytes"] <= plan["budget_bytes"] < plan["keep_all_bytes"]
    p.report(0, 0, int(plan["predicted_bytes"]))
    p.close()


def test_bad_model_gives_the_planners_message() -> None:
    require_libs()
    with pytest.raises(PlannerError, match="layers|field"):
        EmbeddedPlanner({"name": "broken"})


def test_pool_capacity_is_real() -> None:
    require_libs()
    from bagualu.enforce.pool import DevicePool
    pool = DevicePool(1 << 20)
    a = pool.alloc(600 << 10)
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        pool.alloc(600 << 10)
    pool.free(a, 600 << 10)
    b = pool.alloc(600 << 10)
    pool.free(b, 600 << 10)
    assert pool.stats()["num_ooms"] >= 1
    pool.close()


def test_embedded_plans_stay_within_the_nodes_grant() -> None:
    """The point's host_limit_bytes (the node's grant, issue 14) bounds the plan's host bytes;
    bandwidth_share is checked and reported."""
    require_libs()
    model = json.loads((ROOT / "models" / "tiny-moe.json").read_text())
    point = {"phase": "warmup", "forward_micro_batch": 0, "load_factor": 2.0}
    cap, plan, p = 4 << 30, None, None
    while cap > 1 << 26:  # the largest capacity whose plan offloads
        p = EmbeddedPlanner(model, {"capacity_bytes": cap})
        plan = p.plan(dict(point))
        if plan["host_bytes"] > 0:
            break
        p.close()
        cap = cap * 3 // 4
    assert plan is not None and plan["host_bytes"] > 0, "no capacity made the plan offload"
    p.reset_iteration()
    half = plan["host_bytes"] // 2
    limited = p.plan(dict(point, host_limit_bytes=half, bandwidth_share=0.5))
    assert limited["host_bytes"] <= half
    p.reset_iteration()
    none = p.plan(dict(point, host_limit_bytes=0))
    assert none["host_bytes"] == 0
    with pytest.raises(PlannerError, match="bandwidth_share"):
        p.plan(dict(point, bandwidth_share=0.0))
    p.close()
