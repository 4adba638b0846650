"""The public API's functions, a thin layer over the installed runtime (runtime.py): install,
instrument, the micro-batch contexts, scheduling points, iteration lines, stats. The package's
__init__ re-exports them with the loops; the loops import this module, never the package, so
the package has no import cycle (its use is in bagualu/__init__.py's docstring)."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch as _torch

from . import runtime as _runtime
from .discovery.opblock import OpBlock, Step
from .errors import (BagualuError, InstallError, InstrumentError, LibraryNotFound,
                     OutOfMemoryError, PlannerError, PolicyError)
from .installer import install, uninstall
from .settings import POLICIES, parse_size
from .timeline import record_iteration
from .vocabulary import FP8, KEEP, OFFLOAD, RECOMPUTE

__all__ = ["install", "uninstall", "instrument", "describe", "operators", "layers", "step_point", "forward",
           "backward", "begin_iteration", "end_iteration", "history", "stats", "dump_snapshot",
           "force_strategies", "model_document", "served_plans", "static_plan", "stage_graph",
           "sessions",
           "parse_size",
           "OpBlock", "Step", "POLICIES", "KEEP", "OFFLOAD", "FP8", "RECOMPUTE",
           "BagualuError", "InstallError", "InstrumentError", "LibraryNotFound",
           "OutOfMemoryError", "PlannerError", "PolicyError", "current",
           "record_iteration", "plot_iteration"]


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
               local_experts: Optional[Sequence[int]] = None,
               dispatch: Optional[Union[str, Sequence[str]]] = None) -> Any:
    """Maps the model's layers and operators to the planner's and returns the model.

    Any ``nn.Module`` works as it is (docs/pytorch.md, "Unmodified models"): ``layers`` names
    the block list where the guess fails ('model.layers'; a list of paths concatenates them;
    under ``install(chunks=n)`` a list of the rank's n stage modules has each stage's blocks
    found), ``ops`` overrides the classifier
    ({'path.pattern': 'kind'}, kind 'none' for not an operator); ``expert_parallel=N`` (with
    ``ep_rank``) makes this process compute only one EP rank's experts, ``local_experts`` names
    the experts the model itself computes here. Under real expert parallelism (the experts
    sharded over ranks, tokens sent by an all-to-all) ``dispatch`` names what hands this rank's
    experts their tokens, relative to a block ('mlp.dispatch': a module; or a method of an
    attribute, 'moe.experts.token_dispatcher.dispatch'): the load factor is the rows it returns
    over the tokens x top-k the layer's router routed here. Models built from
    ``bagualu.OpBlock`` layers use their steps. Raises InstrumentError naming what is wrong; nothing stays installed then."""
    current().instrument(model, info, layers=layers, ops=ops,
                         expert_parallel=expert_parallel, ep_rank=ep_rank,
                         local_experts=list(local_experts) if local_experts is not None
                         else None, dispatch=dispatch)
    return model


def describe(model: Any, layers: Optional[Union[str, Sequence[str]]] = None,
             ops: Optional[Dict[str, str]] = None) -> str:
    """The layers and operators bagualu finds in ``model`` (what ``instrument`` would plan),
    as text; needs no install(). Raises InstrumentError as ``instrument`` would."""
    from .discovery import find as discover
    return discover.find(model, layers, ops).describe()


def operators(model: Any, layers: Optional[Union[str, Sequence[str]]] = None,
              ops: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The operators of one planned layer of ``model`` (name -> kind, in module order), as
    ``instrument`` would plan them; needs no install()."""
    from .discovery import find as discover
    return dict(discover.find(model, layers, ops).kinds)


def layers(model: Any, layers: Optional[Union[str, Sequence[str]]] = None) -> List[Any]:
    """The repeated blocks (transformer layers) bagualu finds in ``model``, in order; needs no
    install(). Raises InstrumentError when there are none."""
    from .discovery import find as discover
    return list(discover.find_blocks(model, layers)[1])


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


def history() -> List[Dict[str, Any]]:
    """The lines of every iteration ended so far (see end_iteration)."""
    return list(current().history)


def force_strategies(strategies: Optional[Dict[str, str]]) -> None:
    """Overrides every plan (tests, debugging, comparisons): operator name ('expert_fc1', in
    every layer) or qualified name ('L0.expert_fc1') -> 'keep', 'offload', 'fp8' or
    'recompute'; other operators keep. None returns to the policy. PolicyError on an unknown
    strategy."""
    current().strategies.force(strategies)


def model_document() -> Optional[Dict[str, Any]]:
    """The model document registered with the governor after the capture micro-batch
    (docs/planner.md), or None before it."""
    return current().planning.model_doc


def served_plans() -> Dict[str, Any]:
    """The plans the forwards of the last 64 iterations ran under, one entry per iteration
    (an iteration with no plan has none): what ``bgl-sim --plans`` replays (planning/plans.py's
    ``served_plans``)."""
    return current().planning.served_plans()


def static_plan(load_factor: float = 1.0, moves: bool = True) -> Dict[str, str]:
    """The strategies (qualified operator name -> strategy) a static policy sized for
    ``load_factor`` would run on every micro-batch: the planner's full search at that load for
    the tightest forward of the schedule, from a fresh point (no plan cache, no router's
    revision), with offload and FP8 where the install allows them (``moves`` False: recompute
    only, static-under's plan at 1.0). ``force_strategies`` takes it. PlannerError before the
    capture registered the model, for a load outside [1, 64], and on a rank with several local
    stages (``chunks``: a plan names the operators of one)."""
    p = current().planning
    if p.governor is None:
        raise PlannerError("static_plan: this install has no planner (policy "
                           f"{current().settings.policy!r})")
    if current().settings.chunks > 1:
        raise PlannerError(f"static_plan: this rank has {current().settings.chunks} local "
                           "stages (chunks); a static plan is made for a rank with one")
    return p.governor.static_plan((p.description or {}).get("steps", []), load_factor,
                                 moves=moves)


def stage_graph() -> Optional[Dict[str, Any]]:
    """The planner's stage graph of this rank (its description of the registered model:
    operators, tensors, steps), or None before the capture."""
    return current().planning.description


def plot_iteration(path: Any, recording: Any = None, **options: Any) -> Any:
    """Draws a recorded iteration (default: the last ``record_iteration()`` stopped) to
    ``path``, planned against actual; plot.py's ``plot_iteration`` (imported here when called,
    so that ``python -m bagualu.plot`` runs a module the package has not imported)."""
    from . import plot
    return plot.plot_iteration(path, recording, **options)


def sessions() -> List[Dict[str, Any]]:
    """The daemon's sessions (job, pipeline rank, GPU, grants) as dicts; [] while planning
    in-process."""
    return current().governor.sessions()
