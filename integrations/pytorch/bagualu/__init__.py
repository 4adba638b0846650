"""BaGuaLu for PyTorch: per-micro-batch activation memory planning for MoE training.

    import bagualu
    bagualu.install(capacity="256MiB", policy="bagualu")   # before the first CUDA allocation
    bagualu.instrument(model)          # any nn.Module: a Hugging Face model as it is
    print(bagualu.describe(model))     # the layers and operators found
    for it in range(steps):
        bagualu.begin_iteration()
        for phase, f, b in schedule:                          # e.g. bagualu.schedule.one_f_one_b
            bagualu.step_point(phase, f, b)
            with bagualu.forward(f): ...
            with bagualu.backward(b): ...
        bagualu.end_iteration()                               # logs the iteration's line
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Sequence, Union

import torch as _torch

from .errors import (BagualuError, InstallError, InstrumentError, LibraryNotFound,
                     OutOfMemoryError, PlannerError, PolicyError)
from .ops import OpBlock, Step
from .runtime import POLICIES
from .strategy import FP8, KEEP, OFFLOAD, RECOMPUTE
from .installer import install, uninstall
from . import runtime as _runtime
from . import pipelining, schedule
from .accumulate import accumulate_gradients, micro_batches

__all__ = ["install", "uninstall", "instrument", "describe", "step_point", "forward", "backward",
           "begin_iteration", "end_iteration", "stats", "dump_snapshot", "OpBlock", "Step",
           "POLICIES", "KEEP", "OFFLOAD", "FP8", "RECOMPUTE", "BagualuError", "InstallError",
           "InstrumentError", "LibraryNotFound", "OutOfMemoryError", "PlannerError",
           "PolicyError", "current", "pipelining", "schedule", "micro_batches",
           "accumulate_gradients"]


MIN_TORCH = (2, 6)  # the oldest torch the tests run on (docs/pytorch.md, "Supported torch")
if tuple(int(x) for x in _torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
    logging.getLogger("bagualu").warning(
        "bagualu: torch %s is older than the oldest supported, %d.%d", _torch.__version__,
        *MIN_TORCH)


def current() -> "_runtime.Runtime":
    """The installed runtime; raises BagualuError when install() was not called."""
    rt = _runtime.active()
    if rt is None:
        raise BagualuError("bagualu is not installed: call bagualu.install() first")
    return rt


def instrument(model: Any, info: Optional[Dict[str, Any]] = None, *,
               layers: Optional[Union[str, Sequence[str]]] = None,
               ops: Optional[Dict[str, str]] = None,
               expert_parallel: Optional[int] = None, ep_rank: int = 0,
               local_experts: Optional[Sequence[int]] = None) -> Any:
    """Maps the model's layers and operators to the planner's and returns the model.

    Any ``nn.Module`` works as it is (docs/pytorch.md, "Unmodified models"): ``layers`` names
    the block list where the guess fails ('model.layers'; a list of paths concatenates them;
    under ``install(chunks=n)`` a list of the rank's n stage modules has each stage's blocks
    found), ``ops`` overrides the classifier
    ({'path.pattern': 'kind'}, kind 'none' for not an operator); ``expert_parallel=N`` (with
    ``ep_rank``) makes this process compute only one EP rank's experts, ``local_experts`` names
    the experts the model itself computes here. Models built from ``bagualu.OpBlock`` layers use
    their steps. Raises InstrumentError naming what is wrong; nothing stays installed then."""
    current().instrument(model, info, layers=layers, ops=ops,
                         expert_parallel=expert_parallel, ep_rank=ep_rank,
                         local_experts=list(local_experts) if local_experts is not None
                         else None)
    return model


def describe(model: Any, layers: Optional[Union[str, Sequence[str]]] = None,
             ops: Optional[Dict[str, str]] = None) -> str:
    """The layers and operators bagualu finds in ``model`` (what ``instrument`` would plan),
    as text; needs no install(). Raises InstrumentError as ``instrument`` would."""
    from . import discover
    return discover.find(model, layers, ops).describe()


def step_point(phase: str, forward_mb: Optional[int], backward_mb: Optional[int],
               forward_chunk: int = 0, backward_chunk: int = 0) -> Any:
    """A pipeline scheduling point: plans the forward of ``forward_mb`` (of local stage
    ``forward_chunk`` under an interleaved schedule); returns the plan."""
    return current().step_point(phase, forward_mb, backward_mb, forward_chunk, backward_chunk)


@contextmanager
def forward(mb: int, chunk: int = 0) -> Iterator[None]:
    """Context of a micro-batch's forward (saved-tensor capture and enforcement)."""
    with current().forward(mb, chunk):
        yield


@contextmanager
def backward(mb: int, chunk: int = 0) -> Iterator[None]:
    """Context of a micro-batch's backward."""
    with current().backward(mb, chunk):
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
