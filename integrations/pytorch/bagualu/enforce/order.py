"""Carrying out a plan's dual-batch issue order (docs/algorithms.md sec. 5) in training.

At a scheduling point F_x B_y the plan orders four chains: F (forward of x), B (backward of y),
O (offloads of the forward before x) and R (reloads and recomputes of the backward after y). The
package hands the order to the enforcer's stream scheduler (enforce/scheduler.py,
bgl_enf_schedule_begin) and tells it where compute is: the forward entering an operator, the
backward unpacking an activation (bgl_enf_schedule_at). The scheduler issues each O/R piece
once compute reached its round, at most a bounded number in flight; the package then lets go of
the device copies of the activations whose offload completed (the Mover's collect_offloaded,
enforce/mover.py).

Operator and tensor indices are those of the planner's stage graph (the description): the
package maps its operators by name ("L<layer within the chunk>.<operator>") and its records by
the graph tensor they were grouped into at capture (graph.py).

Not thread-safe: driven by the training thread (and the autograd thread running unpack hooks
while the training thread waits in backward()).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..native import ext
from ..vocabulary import Op

_C = ext.load()

Unit = Tuple[int, int]  # (micro-batch, chunk)
UNIT_STRIDE = 1 << 20  # unit id = micro-batch + chunk * UNIT_STRIDE


def unit_id(mb: int, chunk: int) -> int:
    """The id of micro-batch ``mb`` of local stage ``chunk`` (interleaved schedules run each
    micro-batch once per chunk): what the tracker and the plans are keyed by."""
    return mb + chunk * UNIT_STRIDE


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


class RankSchedule:
    """This rank's forwards and backwards in schedule order (the description's steps), for
    the units a point's O and R chains carry out, as the planner chooses them."""

    def __init__(self, steps: Sequence[Dict[str, Any]]) -> None:
        self.forwards: List[Unit] = [(s["micro_batch"], s.get("chunk", 0))
                                     for s in steps if s["forward"]]
        self.backwards: List[Unit] = [(s["micro_batch"], s.get("chunk", 0))
                                      for s in steps if not s["forward"]]
        self._f = {u: i for i, u in enumerate(self.forwards)}
        self._b = {u: i for i, u in enumerate(self.backwards)}
        # per forward, the first backward after it in this rank's steps
        self._next_backward: Dict[Unit, Unit] = {}
        pending: List[Unit] = []
        for s in steps:
            unit = (s["micro_batch"], s.get("chunk", 0))
            if s["forward"]:
                pending.append(unit)
            else:
                self._next_backward.update((f, unit) for f in pending)
                pending = []
        # the backwards whose step follows another backward's (no forward between them)
        self._after_backward = {(s["micro_batch"], s.get("chunk", 0))
                                for prev, s in zip(steps, steps[1:])
                                if not prev["forward"] and not s["forward"]}

    def forward_before(self, unit: Unit) -> Optional[Unit]:
        i = self._f.get(unit, 0)
        return self.forwards[i - 1] if i > 0 else None

    def backward_after(self, unit: Optional[Unit]) -> Optional[Unit]:
        i = self._b.get(unit, len(self.backwards)) if unit is not None else len(self.backwards)
        return self.backwards[i + 1] if i + 1 < len(self.backwards) else None

    def next_backward(self, unit: Unit) -> Optional[Unit]:
        """The first backward after ``unit``'s forward in this rank's steps (None: none)."""
        return self._next_backward.get(unit)

    def backs_to_back(self, unit: Unit) -> bool:
        """Whether ``unit``'s backward directly follows another backward in this rank's steps
        (the cool-down: no forward runs between them)."""
        return unit in self._after_backward

    def has_later_forward(self, unit: Unit) -> bool:
        """Whether a forward follows ``unit``'s (so a later point's O chain offloads it)."""
        i = self._f.get(unit)
        return i is not None and i + 1 < len(self.forwards)


class PointIssuer(_C.IssueCursor):
    """The issue order of the current scheduling point, carried out through the enforcer's
    stream scheduler (``scheduler``: enforce/scheduler.py). Where compute is (``forward_op`` at
    every operator call, ``backward_op`` at every unpack: packed.cc calls it natively) is the
    binding's IssueCursor (csrc/cursor.h) over the core's bgl_enf_schedule_at, the one definition
    of when compute passes a stage; this class gives it the operators' stage-graph indices and
    what follows a passed stage. Not thread-safe: the training thread (and autograd's while the
    training thread waits in backward())."""

    def __init__(self, scheduler: Any, index: Optional[StageGraphIndex], collect: Any) -> None:
        super().__init__(scheduler.enf.fast)
        self.scheduler = scheduler
        self.index = index
        self.collect = collect  # lets go of the device copies whose offload completed
        # IssueCursor's members: active, issuing (set while the enforcer carries out pieces: a
        # piece's recompute callback reruns module calls and unpacks their inputs, which must not
        # tell the scheduler anything from inside it), forward_key, backward_key.

    def begin(self, order: Sequence[Dict[str, Any]], forward_key: int, backward_key: int,
              offload_key: int, recover_key: int) -> None:
        """Loads a point's order (the previous point's pieces are issued first; those still
        in flight complete beside it); compute starts before its first stages."""
        self.scheduler.begin(order, offload_key, recover_key)
        self.forward_key, self.backward_key = forward_key, backward_key
        self.active = True

    def _op_index(self, op: Op) -> int:
        """The stage-graph index of ``op`` (-1: not planned); asked once per operator."""
        return self.index.op(op) if self.index is not None else -1

    def _passed(self, status: int, stages: int) -> None:
        """Compute passed ``stages`` stages (the scheduler issued what they allow; ``status``
        its first failure, a skipped piece counted): lets go of the device copies whose offload
        completed (looked for at stage boundaries)."""
        if status:
            self.scheduler.piece(status, "schedule_at")
        if stages:
            self.collect()

    def finish(self) -> None:
        """Issues what is left of the point's order and waits for it."""
        if self.active:
            self.active = False
            self.issuing = True
            try:
                self.scheduler.finish()
                self.collect()
            finally:
                self.issuing = False
