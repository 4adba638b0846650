"""Which strategy each operator has in each micro-batch's forward: the policy's rule, the
plans the governor gave per micro-batch, or strategies forced by the user (tests, debugging).

Not thread-safe: the training thread."""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

from ..errors import PolicyError
from ..vocabulary import KEEP, RECOMPUTE, STRATEGIES, Op


class Strategies:
    """The strategies of one process under ``policy``."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.static: Dict[str, str] = {}                # static-under: qualname -> strategy
        self.per_unit: Dict[int, Dict[str, str]] = {}   # unit id -> qualname -> strategy
        self.forced: Optional[Dict[str, str]] = None

    def of(self, op: Op, unit: int) -> str:
        """The strategy of ``op`` in the forward of ``unit`` (a micro-batch of a chunk)."""
        if op.layer >= 0 and self.forced is not None:
            return self.forced.get(op.name, self.forced.get(op.qualname, KEEP))
        if op.layer < 0 or self.policy == "keep-all":
            return KEEP
        if self.policy == "static-over":
            return RECOMPUTE
        if self.policy == "static-under":
            return self.static.get(op.qualname, KEEP)
        return self.per_unit.get(unit, {}).get(op.qualname, KEEP)

    @property
    def may_defer(self) -> bool:
        """Whether a router may switch later operators of the forward to recompute."""
        return self.policy == "bagualu" and self.forced is None

    def all_keep(self, unit: int) -> bool:
        """Whether every operator of ``unit``'s forward keeps its activations (as far as the
        policy and the plan say; a router may still change a bagualu plan)."""
        if self.forced is not None:
            return False
        if self.policy == "keep-all":
            return True
        if self.policy == "static-over":
            return False
        if self.policy == "static-under":
            return all(s == KEEP for s in self.static.values())
        return all(s == KEEP for s in self.per_unit.get(unit, {"": RECOMPUTE}).values())

    def force(self, strategies: Optional[Dict[str, str]]) -> None:
        """Overrides every plan: operator name ('expert_fc1', every layer) or qualname
        ('L0.expert_fc1') -> strategy; None returns to the policy."""
        for s in (strategies or {}).values():
            if s not in STRATEGIES:
                raise PolicyError(f"unknown strategy '{s}' ({', '.join(STRATEGIES)})")
        self.forced = dict(strategies) if strategies is not None else None

    def set_plan(self, unit: int, strategies: Dict[str, str]) -> bool:
        """The plan of ``unit``'s forward; whether it changed anything."""
        if strategies == self.per_unit.get(unit):
            return False
        self.per_unit[unit] = strategies
        return True

    def counts(self, layer_ops: Iterable[List[Op]]) -> Dict[str, int]:
        """How many (operator, micro-batch) pairs of the iteration had each strategy."""
        counts = {s: 0 for s in STRATEGIES}
        units = list(self.per_unit) or [-1]
        for ops in layer_ops:
            for unit in units:
                for op in ops:
                    s = self.of(op, unit)
                    counts[s] = counts.get(s, 0) + 1
        return counts

    def clear(self) -> None:
        """A new iteration: the plans of the last one no longer apply."""
        self.per_unit.clear()
