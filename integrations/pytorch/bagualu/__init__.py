"""BaGuaLu for PyTorch: per-micro-batch activation memory planning for MoE training.

    import bagualu
    bagualu.install(capacity="256MiB", policy="bagualu")   # before the first CUDA allocation
    bagualu.instrument(model)
    for it in range(steps):
        bagualu.begin_iteration()
        for phase, f, b in schedule:                          # e.g. bagualu.schedule.one_f_one_b
            bagualu.step_point(phase, f, b)
            with bagualu.forward(f): ...
            with bagualu.backward(b): ...
        bagualu.end_iteration()                               # logs the iteration's line
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

from .errors import (BagualuError, InstallError, InstrumentError, LibraryNotFound,
                     OutOfMemoryError, PlannerError, PolicyError)
from .ops import OpBlock, Step
from .runtime import POLICIES
from .tracker import FP8, KEEP, OFFLOAD, RECOMPUTE
from .installer import install, uninstall
from . import runtime as _runtime
from . import pipelining, schedule

__all__ = ["install", "uninstall", "instrument", "step_point", "forward", "backward",
           "begin_iteration", "end_iteration", "stats", "dump_snapshot", "OpBlock", "Step",
           "POLICIES", "KEEP", "OFFLOAD", "FP8", "RECOMPUTE", "BagualuError", "InstallError",
           "InstrumentError", "LibraryNotFound", "OutOfMemoryError", "PlannerError",
           "PolicyError", "current", "pipelining", "schedule"]


def current() -> "_runtime.Runtime":
    """The installed runtime; raises BagualuError when install() was not called."""
    rt = _runtime.active()
    if rt is None:
        raise BagualuError("bagualu is not installed: call bagualu.install() first")
    return rt


def instrument(model: Any, info: Optional[Dict[str, Any]] = None) -> Any:
    """Maps the model's modules to the planner's operators and returns the model."""
    current().instrument(model, info)
    return model


def step_point(phase: str, forward_mb: Optional[int], backward_mb: Optional[int]) -> Any:
    """A pipeline scheduling point: plans the forward of ``forward_mb``; returns the plan."""
    return current().step_point(phase, forward_mb, backward_mb)


@contextmanager
def forward(mb: int) -> Iterator[None]:
    """Context of a micro-batch's forward (saved-tensor capture and enforcement)."""
    with current().forward(mb):
        yield


@contextmanager
def backward(mb: int) -> Iterator[None]:
    """Context of a micro-batch's backward."""
    with current().backward(mb):
        yield


def begin_iteration() -> None:
    current().begin_iteration()


def end_iteration() -> Dict[str, Any]:
    """Closes the iteration, logs its line (iteration, load, budget, peak, strategies,
    overhead) and returns it."""
    return current().end_iteration()


def stats() -> Dict[str, Any]:
    """Counters of the tracker, the allocator and the memory model."""
    return current().stats()


def dump_snapshot(path: str) -> None:
    """Writes the allocator snapshot pickle that pytorch.org/memory_viz opens."""
    current().dump_snapshot(path)
