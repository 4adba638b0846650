"""A static policy's plan: the strategies one full search gives for a fixed load, applied to
every micro-batch (static-under's at load 1.0 with recompute only; the worst-load plan the
same-capacity table compares bagualu with).

Not thread-safe: the training thread (it makes and closes a private embedded planner)."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

from . import embedded
from ..errors import PlannerError


def static_plan(model: Dict[str, Any], options: Dict[str, Any], steps: List[Dict[str, Any]],
                load_factor: float = 1.0, *, moves: bool) -> Dict[str, str]:
    """Strategies (qualified name -> strategy) sized for ``load_factor`` at the iteration's
    tightest forward (the one whose plan predicts the fewest bytes), computed by a full search
    on a private embedded planner from a fresh point, for the model document ``model``
    registered with ``options`` over the stage's ``steps``: with recompute only (``moves``
    False), or with every strategy ``options`` allow."""
    if not 1.0 <= load_factor <= 64.0:
        raise PlannerError(f"static_plan: load_factor {load_factor} is not in [1, 64]")
    opts = dict(options)
    if not moves:
        opts.update(allow_offload=False, allow_fp8=False)
    p = embedded.EmbeddedPlanner(model, opts)
    best: Optional[Dict[str, Any]] = None
    try:
        for i, s in enumerate(steps):
            if not s["forward"]:
                continue
            point = {"phase": s["phase"], "forward_micro_batch": s["micro_batch"],
                     "load_factor": float(load_factor)}
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            # a point's backward is another micro-batch's (a one-stage schedule runs a
            # micro-batch's backward right after its forward, at a point of its own)
            if nxt is not None and not nxt["forward"] and nxt["micro_batch"] != s["micro_batch"]:
                point["backward_micro_batch"] = nxt["micro_batch"]
            plan = p.plan(point)
            p.report(s["micro_batch"], 0, int(plan["predicted_bytes"]))
            if best is None or plan["predicted_bytes"] < best["predicted_bytes"]:
                best = plan
    finally:
        p.close()
    return {o["name"]: o["strategy"] for o in (best or {}).get("operators", [])}
