"""Carrying out a plan's dual-batch issue order (docs/algorithms.md sec. 5) in training.

At a scheduling point F_x B_y the plan orders four chains: F (forward of x), B (backward of y),
O (offloads of the forward before x) and R (reloads and recomputes of the backward after y). The
package hands the order to the enforcer's stream scheduler (bgl_enf_schedule_begin) and tells it
where compute is: the forward entering an operator, the backward unpacking an activation
(bgl_enf_schedule_reached). The scheduler issues each O/R piece once compute reached its round,
at most a bounded number in flight; the package then lets go of the device copies of the
activations whose offload completed (bgl_enf_take_offloaded).

Operator and tensor indices are those of the planner's stage graph (the description): the
package maps its operators by name ("L<layer within the chunk>.<operator>") and its records by
the graph tensor they were grouped into at capture (graph.py).

Not thread-safe: driven by the training thread (and the autograd thread running unpack hooks
while the training thread waits in backward()).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .strategy import Op

log = logging.getLogger("bagualu")

class StageGraphIndex:
    """Operator and tensor indices of the planner's stage graph (one chunk), by name."""

    def __init__(self, description: Dict[str, Any], layers_per_chunk: int) -> None:
        self.layers_per_chunk = max(layers_per_chunk, 1)
        self.ops = {o["name"]: i for i, o in enumerate(description.get("operators", ()))}
        self.tensors = {t["name"]: i for i, t in enumerate(description.get("tensors", ()))}
        self._op_cache: Dict[Op, int] = {}

    def op(self, op: Op) -> int:
        """The stage-graph index of ``op`` (-1: not a planned operator)."""
        i = self._op_cache.get(op)
        if i is None:
            i = -1
            if op.layer >= 0:
                i = self.ops.get(f"L{op.layer % self.layers_per_chunk}.{op.name}", -1)
            self._op_cache[op] = i
        return i

    def tensor(self, layer: int, name: Optional[str]) -> int:
        """The stage-graph index of the graph tensor ``name`` of ``layer`` (-1: none)."""
        if name is None or layer < 0:
            return -1
        return self.tensors.get(f"L{layer % self.layers_per_chunk}.{name}", -1)


def neighbours(steps: Sequence[Dict[str, Any]], forward: Optional[Tuple[int, int]],
               backward: Optional[Tuple[int, int]]) -> Tuple[Optional[Tuple[int, int]],
                                                             Optional[Tuple[int, int]]]:
    """(the forward before ``forward``, the backward after ``backward``) in this rank's
    schedule: the units whose offloads (O) and reloads/recomputes (R) the point carries out,
    as the planner chooses them. Units are (micro-batch, chunk)."""
    fwd = [(s["micro_batch"], s.get("chunk", 0)) for s in steps if s["forward"]]
    bwd = [(s["micro_batch"], s.get("chunk", 0)) for s in steps if not s["forward"]]
    before = after = None
    if forward is not None and forward in fwd:
        i = fwd.index(forward)
        before = fwd[i - 1] if i > 0 else None
    if backward is not None and backward in bwd:
        i = bwd.index(backward)
        after = bwd[i + 1] if i + 1 < len(bwd) else None
    return before, after


def has_later_forward(steps: Sequence[Dict[str, Any]], unit: Tuple[int, int]) -> bool:
    """Whether a forward follows ``unit``'s in this rank's schedule (so a later point's O
    chain offloads ``unit``'s activations)."""
    fwd = [(s["micro_batch"], s.get("chunk", 0)) for s in steps if s["forward"]]
    return unit in fwd and fwd.index(unit) + 1 < len(fwd)


class PointIssuer:
    """The issue order of the current scheduling point, carried out through the enforcer."""

    def __init__(self, enforcer: Any, index: StageGraphIndex, collect: Any) -> None:
        self.enforcer = enforcer
        self.index = index
        self.collect = collect  # lets go of the device copies whose offload completed
        self.active = False
        self.forward_key = -1
        self.backward_key = -1
        self.f_stages: List[Tuple[int, int]] = []  # (first operator, stage), forward order
        self.b_stages: List[Tuple[int, int]] = []  # (first operator, stage), backward order
        self.f_next = 0
        self.b_next = 0
        self.points = 0
        self.reached = 0

    def begin(self, order: Sequence[Dict[str, Any]], forward_key: int, backward_key: int,
              offload_key: int, recover_key: int) -> None:
        """Loads a point's order (the previous point's pieces are finished first)."""
        self.enforcer.schedule_begin(order, offload_key, recover_key)
        self.active = True
        self.points += 1
        self.forward_key, self.backward_key = forward_key, backward_key
        self.f_stages = sorted((it["first"], it["stage"]) for it in order if it["chain"] == "F")
        self.b_stages = sorted(((it["first"], it["stage"]) for it in order
                                if it["chain"] == "B"), key=lambda s: -s[0])
        self.f_next = self.b_next = 0

    def forward_op(self, micro_batch: int, op: Op) -> None:
        """The forward of ``micro_batch`` enters ``op``."""
        if micro_batch != self.forward_key or self.f_next >= len(self.f_stages):
            return
        i = self.index.op(op)
        if i < 0:
            return
        stages = self.f_stages
        while self.f_next < len(stages) and stages[self.f_next][0] <= i:
            self.enforcer.schedule_reached("F", stages[self.f_next][1])
            self.f_next += 1
            self.reached += 1
        self.collect()

    def backward_op(self, micro_batch: int, op: Op) -> None:
        """The backward of ``micro_batch`` needs an activation ``op`` produced."""
        if micro_batch != self.backward_key or self.b_next >= len(self.b_stages):
            return
        i = self.index.op(op)
        if i < 0:
            return
        stages = self.b_stages
        while self.b_next < len(stages) and i <= stages[self.b_next][0]:
            self.enforcer.schedule_reached("B", stages[self.b_next][1])
            self.b_next += 1
            self.reached += 1
        self.collect()

    def finish(self) -> None:
        """Issues what is left of the point's order and waits for it."""
        if self.active:
            self.active = False
            self.enforcer.schedule_finish()
            self.collect()
