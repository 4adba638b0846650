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
        self.scale = 1

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

        The planner caches plans by budget in 64 MiB buckets (docs/planner.md), which is coarse
        for small models; bytes are therefore given to it scaled by a power of two so that a
        bucket is at most 1/64 of the capacity, and scaled back in every answer (copy
        bandwidths in the calibration are scaled alike, so times are unchanged)."""
        self.scale = _byte_scale(capacity_bytes)
        model = _scaled_model(model, self.scale)
        capacity_bytes = int(capacity_bytes * self.scale)
        self._model = model
        self._options = {"capacity_bytes": int(capacity_bytes), "pipeline_rank": pipeline_rank,
                         "allow_offload": allow_offload, "allow_fp8": allow_fp8,
                         "dual_batch": False}
        if calibration:
            self._options["calibration"] = _scaled_calibration(calibration, self.scale)
        self.embedded = plannermod.EmbeddedPlanner(model, self._options)
        self.description = _unscale_description(self.embedded.description, self.scale)
        self.kind = "embedded"
        if self.address and self.address.lower() not in ("none", "embedded", "off"):
            try:
                from .remote import RemoteGovernor
                self.remote = RemoteGovernor(self.address, self.deadline_s)
                self.remote_address = self.address
                self.remote.register(model, capacity_bytes, pipeline_rank, self.job_id,
                                     self.gpu_index)
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
        point = dict(point)
        if "bytes_in_use" in point:
            point["bytes_in_use"] = int(point["bytes_in_use"] * self.scale)
        try:
            return _unscale_plan(self._call("plan", point), self.scale)
        except PlannerError as e:
            log.warning("bagualu: planning failed (%s); keeping the previous strategies", e)
            return None

    def plan_after_gate(self, mb: int, chunk: int, layer: int, load: float) -> Optional[Dict]:
        try:
            return _unscale_plan(self._call("plan_after_gate", mb, chunk, layer, load),
                                 self.scale)
        except PlannerError as e:
            log.warning("bagualu: deferred planning failed (%s)", e)
            return None

    def report(self, mb: int, chunk: int, actual: int) -> None:
        try:
            self._call("report", mb, chunk, int(actual * self.scale))
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
            p.report(s["micro_batch"], 0, int(plan["predicted_bytes"]))  # scaled already
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


_BUCKET = 64 << 20  # the planner's budget bucket (PlannerOptions::budget_step_bytes)
_BYTE_FIELDS = ("budget_bytes", "free_bytes", "m0_bytes", "keep_all_bytes", "predicted_bytes",
                "host_bytes")


def _byte_scale(capacity: int) -> int:
    scale = 1
    while _BUCKET / scale > max(capacity, 1) / 64 and scale < (1 << 20):
        scale *= 2
    return scale


def _scaled_model(model: Dict[str, Any], scale: int) -> Dict[str, Any]:
    if scale == 1 or "layer_graph" not in model:
        return model
    out = dict(model)
    lg = dict(model["layer_graph"])
    lg["tensors"] = [dict(t, bytes=int(t["bytes"]) * scale) for t in lg["tensors"]]
    out["layer_graph"] = lg
    return out


def _scaled_calibration(cal: Dict[str, Any], scale: int) -> Dict[str, Any]:
    out = dict(cal)
    roof = {k: dict(v) for k, v in cal.get("rooflines", {}).items()}
    for v in roof.values():
        if "peak_GBps" in v:
            v["peak_GBps"] = v["peak_GBps"] * scale
    if roof:
        out["rooflines"] = roof
    return out


def _unscale_description(d: Dict[str, Any], scale: int) -> Dict[str, Any]:
    if scale == 1:
        return d
    d = dict(d)
    for k in ("activation_capacity_bytes", "m0_bytes", "keep_all_bytes"):
        if k in d:
            d[k] = d[k] / scale
    d["tensors"] = [dict(t, bytes=t["bytes"] / scale) for t in d.get("tensors", [])]
    return d


def _unscale_plan(plan: Optional[Dict[str, Any]], scale: int) -> Optional[Dict[str, Any]]:
    if plan is None or scale == 1:
        return plan
    plan = dict(plan)
    for k in _BYTE_FIELDS:
        if k in plan:
            plan[k] = plan[k] / scale
    return plan
