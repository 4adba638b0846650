"""The embedded planner: libbgl_planner.so in this process (native/planner.py binds it).

Every document is JSON (docs/planner.md). Errors become PlannerError with the planner's text.
"""
from __future__ import annotations

import ctypes
import json
import threading
from typing import Any, Dict, Optional

from ..native import planner as native
from ..errors import PlannerError

Json = Dict[str, Any]


def schedule_steps(stages: int, rank: int, micro_batches: int, chunks: int = 1) -> list:
    """The planner's step order of pipeline rank ``rank`` (no model needed): a list of
    {"forward", "micro_batch", "chunk", "phase"}; ValueError naming a bad argument."""
    lib = native.load()
    ptr = lib.bgl_planner_schedule(int(stages), int(rank), int(micro_batches), int(chunks))
    if not ptr:
        msg = lib.bgl_planner_last_error()
        raise ValueError(msg.decode() if msg else "invalid schedule")
    try:
        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.bgl_planner_free_string(ctypes.c_void_p(ptr))


class EmbeddedPlanner:
    """One stage's planner in this process. Thread safe (calls are serialised)."""

    def __init__(self, model: Json, options: Optional[Json] = None) -> None:
        self._lib = native.load()
        self._mutex = threading.Lock()
        opts = json.dumps(options).encode() if options else None
        handle = self._lib.bgl_planner_create(json.dumps(model).encode(), opts)
        if not handle:
            raise PlannerError(f"planner rejected the model: {self._error()}")
        self._handle = ctypes.c_void_p(handle)
        self.description: Json = self._take(self._lib.bgl_planner_describe(self._handle))

    def _error(self) -> str:
        msg = self._lib.bgl_planner_last_error()
        return msg.decode() if msg else "unknown error"

    def _take(self, ptr: Optional[int]) -> Json:
        if not ptr:
            raise PlannerError(self._error())
        try:
            return json.loads(ctypes.string_at(ptr).decode())
        finally:
            self._lib.bgl_planner_free_string(ctypes.c_void_p(ptr))

    def plan(self, point: Json) -> Json:
        """Plans a scheduling point (phase, micro-batches, load_factor, bytes_in_use)."""
        with self._mutex:
            return self._take(self._lib.bgl_planner_plan(self._handle, json.dumps(point).encode()))

    def plan_after_gate(self, micro_batch: int, chunk: int, gate_layer: int,
                        load_factor: float) -> Json:
        """Deferred planning after the router of ``gate_layer`` observed ``load_factor``."""
        with self._mutex:
            return self._take(self._lib.bgl_planner_plan_after_gate(
                self._handle, micro_batch, chunk, gate_layer, float(load_factor)))

    def report(self, micro_batch: int, chunk: int, actual_bytes: int) -> None:
        """Reports what the forward of a micro-batch really retained."""
        with self._mutex:
            if self._lib.bgl_planner_report(self._handle, micro_batch, chunk,
                                            int(actual_bytes)) != 0:
                raise PlannerError(self._error())

    def warm_up(self, host_limit_bytes: int = -1, bandwidth_share: float = 1.0) -> None:
        """Starts the warm-up now (else the first plan starts it): a planner created with
        "warm_up" plans the keys the run will meet under that host limit (-1: none) and share of
        the link. PlannerError where the planner has no warm-up or an argument is bad."""
        with self._mutex:
            if self._lib.bgl_planner_warm_up(self._handle, int(host_limit_bytes),
                                             float(bandwidth_share)) != 0:
                raise PlannerError(self._error())

    def stats(self) -> Json:
        """The planner's counters (bgl_planner_stats): the plan cache, the anytime path and
        the warm-up (warm_keys, warm_hits, warm_cpu_s, ...)."""
        with self._mutex:
            return self._take(self._lib.bgl_planner_stats(self._handle))

    def reset_iteration(self) -> None:
        with self._mutex:
            self._lib.bgl_planner_reset_iteration(self._handle)

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.bgl_planner_destroy(handle)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
