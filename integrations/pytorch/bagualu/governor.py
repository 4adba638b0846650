"""The governor as seen from a training process: the daemon over gRPC (unix socket) with short
deadlines, or the embedded planner (libbgl_planner.so) when no daemon answers in time. Either
way the same calls: register, plan, plan_after_gate, report, reset_iteration, close."""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional

from . import planner as plannermod
from .errors import PlannerError

log = logging.getLogger("bagualu")
DEFAULT_ADDRESS = "unix:///run/bagualu/governor.sock"
_STRATEGY_NAMES = {0: "keep", 1: "recompute", 2: "offload", 3: "fp8"}
_PHASES = {"warmup": 1, "steady": 2, "cooldown": 3}
_PHASE_NAMES = {0: "unspecified", 1: "warmup", 2: "steady", 3: "cooldown"}


class Governor:
    """Plans for one stage: remote when a daemon answers, else embedded."""

    def __init__(self, address: Optional[str] = None, deadline_s: float = 0.5,
                 job_id: str = "", gpu_index: int = 0) -> None:
        self.address = address if address is not None else os.environ.get(
            "BGL_GOVERNOR", DEFAULT_ADDRESS)
        self.deadline_s = deadline_s
        self.job_id = job_id or os.environ.get("BGL_JOB_ID", f"pid-{os.getpid()}")
        self.gpu_index = gpu_index
        self.embedded: Optional[plannermod.EmbeddedPlanner] = None
        self.remote: Any = None
        self.description: Optional[Dict[str, Any]] = None
        self.kind: Optional[str] = None
        self._warned = False
        self._model: Optional[Dict[str, Any]] = None
        self._options: Dict[str, Any] = {}

    @property
    def ready(self) -> bool:
        return self.kind is not None

    def _fallback(self, why: str) -> None:
        if not self._warned:
            log.warning("bagualu: governor at %s unavailable (%s); using the embedded planner",
                        self.address, why)
            self._warned = True
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        self.kind = "embedded"

    def register(self, model: Dict[str, Any], capacity_bytes: int, pipeline_rank: int,
                 allow_offload: bool = True, allow_fp8: bool = True,
                 calibration: Optional[Dict[str, Any]] = None) -> None:
        """Describes the stage. The embedded planner is always created (the fallback).

        Both planners get the same plan-cache budget step (budget_step_bytes), sized from the
        capacity, so that every byte count they see and return is real."""
        step = budget_step_bytes(capacity_bytes)
        self._model = model
        self._options = {"capacity_bytes": int(capacity_bytes), "pipeline_rank": pipeline_rank,
                         "allow_offload": allow_offload, "allow_fp8": allow_fp8,
                         "dual_batch": False, "budget_step_bytes": step}
        if calibration:
            self._options["calibration"] = calibration
        self.embedded = plannermod.EmbeddedPlanner(model, self._options)
        self.description = self.embedded.description
        self.kind = "embedded"
        if self.address and self.address.lower() not in ("none", "embedded", "off"):
            try:
                from .remote import RemoteGovernor
                self.remote = RemoteGovernor(self.address, self.deadline_s)
                self.remote_address = self.address
                self.remote.register(model, capacity_bytes, pipeline_rank, self.job_id,
                                     self.gpu_index, budget_step_bytes=step)
                self.kind = "remote"
                log.info("bagualu: registered with the governor at %s (session %s)",
                         self.address, self.remote.session_id)
            except Exception as e:  # daemon absent, late, or grpc missing
                self._fallback(_short(e))

    def _call(self, what: str, *args: Any) -> Any:
        """Calls the remote governor, falling back to the embedded planner on any failure."""
        if self.remote is not None:
            try:
                out = getattr(self.remote, what)(*args)
                if what in ("plan", "plan_after_gate"):
                    getattr(self.embedded, what)(*args)  # keep the fallback's state in step
                elif what == "report":
                    self.embedded.report(*args)
                return out
            except PlannerError:
                raise
            except Exception as e:
                code = getattr(e, "code", None)
                name = getattr(code(), "name", "") if callable(code) else ""
                if name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"):
                    # The daemon understood and refused: a planning error, not an outage.
                    details = e.details() if hasattr(e, "details") else str(e)
                    raise PlannerError(f"governor: {details}") from e
                self._fallback(_short(e))
        return getattr(self.embedded, what)(*args)

    def plan(self, point: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        try:
            return self._call("plan", point)
        except PlannerError as e:
            log.warning("bagualu: planning failed (%s); keeping the previous strategies", e)
            return None

    def plan_after_gate(self, mb: int, chunk: int, layer: int, load: float) -> Optional[Dict]:
        try:
            return self._call("plan_after_gate", mb, chunk, layer, load)
        except PlannerError as e:
            log.warning("bagualu: deferred planning failed (%s)", e)
            return None

    def report(self, mb: int, chunk: int, actual: int) -> None:
        try:
            self._call("report", mb, chunk, int(actual))
        except PlannerError as e:
            log.debug("bagualu: report ignored: %s", e)

    def reset_iteration(self) -> None:
        if self.embedded is not None:
            self.embedded.reset_iteration()
        if self.remote is not None:
            self.remote.reset_iteration()

    def static_plan(self, steps: List[Dict[str, Any]]) -> Dict[str, str]:
        """Strategies sized for load 1.0 at the iteration's tightest forward, with recompute
        only (the static-under baseline), computed on a private embedded planner."""
        opts = dict(self._options, allow_offload=False, allow_fp8=False)
        p = plannermod.EmbeddedPlanner(self._model, opts)
        best: Optional[Dict[str, Any]] = None
        for i, s in enumerate(steps):
            if not s["forward"]:
                continue
            point = {"phase": s["phase"], "forward_micro_batch": s["micro_batch"],
                     "load_factor": 1.0}
            nxt = steps[i + 1] if i + 1 < len(steps) else None
            if nxt is not None and not nxt["forward"]:
                point["backward_micro_batch"] = nxt["micro_batch"]
            plan = p.plan(point)
            p.report(s["micro_batch"], 0, int(plan["predicted_bytes"]))
            if best is None or plan["predicted_bytes"] < best["predicted_bytes"]:
                best = plan
        p.close()
        return {o["name"]: o["strategy"] for o in (best or {}).get("operators", [])}

    def close(self) -> None:
        if self.remote is not None:
            try:
                self.remote.unregister()
            except Exception:
                pass
            self.remote.close()
            self.remote = None
        if self.embedded is not None:
            self.embedded.close()


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    detail = text[0] if text else ""
    for line in text:
        if "details" in line:
            detail = line.strip()
    return f"{type(e).__name__}: {detail}"[:200]


_MIN_STEP = 64 << 10
_MAX_STEP = 64 << 20  # the planner's default (PlannerOptions::budget_step_bytes)


def budget_step_bytes(capacity: int) -> int:
    """The plan cache's budget bucket for a stage of ``capacity`` bytes.

    capacity/64 rounded down to a power of two: budgets within 1/64 of the capacity share a
    plan, which is planned for the bucket's lowest budget, so at most ~1.6% of the capacity
    is left unused by the rounding. At least 64 KiB, because finer steps only split budgets
    that differ by allocator rounding and measurement noise (and the daemon rejects under
    4 KiB); at most the planner's 64 MiB default, which large GPUs keep."""
    step = _MIN_STEP
    while step * 2 <= min(max(int(capacity), 0) // 64, _MAX_STEP):
        step *= 2
    return step
