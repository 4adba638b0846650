"""Which strategy each operator has in each micro-batch's forward: the policy's rule, the
plans the governor gave per micro-batch, or strategies forced by the user (tests, debugging).

Not thread-safe: the training thread."""
from __future__ import annotations

import logging
from typing import Dict, Iterable, List, Optional, Set

from ..errors import PlannerError, PolicyError
from ..vocabulary import KEEP, RECOMPUTE, STRATEGIES, Op

log = logging.getLogger("bagualu")


class Strategies:
    """The strategies of one process under ``policy``."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        # static-under: qualname -> strategy; None until the capture registered the model
        self.static: Optional[Dict[str, str]] = None
        self.per_unit: Dict[int, Dict[str, str]] = {}   # unit id -> qualname -> strategy
        self.forced: Optional[Dict[str, str]] = None
        # Every operator name and qualname the instrumented model has had (compiled blocks
        # add theirs): what a plan or a forced strategy may name. Empty before instrument.
        self.known: Set[str] = set()

    def of(self, op: Op, unit: int) -> str:
        """The strategy of ``op`` in the forward of ``unit`` (a micro-batch of a chunk). The
        binding's pack reads the last branch (bagualu's plans, nothing forced) from ``policy``,
        ``forced`` and ``per_unit`` with no Python frame (csrc/hooks.cc StrategyOf): keep those
        attributes' meaning in step with it."""
        if op.layer >= 0 and self.forced is not None:
            return self.forced.get(op.name, self.forced.get(op.qualname, KEEP))
        if op.layer < 0 or self.policy == "keep-all":
            return KEEP
        if self.policy == "static-over":
            return RECOMPUTE
        if self.policy == "static-under":
            # Before its plan exists (the capture's forwards) it recomputes everything, as
            # static-over does: a static policy moves nothing on pressure, so a micro-batch
            # that kept everything beside the planned ones would not fit where they do.
            return RECOMPUTE if self.static is None else self.static.get(op.qualname, KEEP)
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
            return self.static is not None and all(s == KEEP for s in self.static.values())
        return all(s == KEEP for s in self.per_unit.get(unit, {"": RECOMPUTE}).values())

    def learn(self, ops: Iterable[Op]) -> None:
        """The model's operators (instrument, and compiled blocks when they are found). Forced
        strategies given before that name none of them are a warning (instrument goes on:
        an error there would leave a model half instrumented)."""
        self.known.update(n for op in ops for n in (op.name, op.qualname))
        if self.forced:
            try:
                self._check(self.forced, "force_strategies", PolicyError)
            except PolicyError as e:
                log.warning("bagualu: %s", e)

    def _check(self, names: Iterable[str], what: str, error: type) -> None:
        unknown = sorted(n for n in names if n not in self.known)
        if unknown and self.known:
            shown = sorted(n for n in self.known if "." not in n)
            raise error(f"{what} names {len(unknown)} operator(s) this model does not have: "
                        f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} (its "
                        f"operators: {', '.join(shown[:20])}{' ...' if len(shown) > 20 else ''}"
                        "; qualified as 'L<layer>.<name>')")

    def force(self, strategies: Optional[Dict[str, str]]) -> None:
        """Overrides every plan: operator name ('expert_fc1', every layer) or qualname
        ('L0.expert_fc1') -> strategy; None returns to the policy. PolicyError on an unknown
        strategy or, once the model is instrumented, an operator it does not have."""
        for s in (strategies or {}).values():
            if s not in STRATEGIES:
                raise PolicyError(f"unknown strategy '{s}' ({', '.join(STRATEGIES)})")
        self._check(strategies or {}, "force_strategies", PolicyError)
        self.forced = dict(strategies) if strategies is not None else None

    def set_plan(self, unit: int, strategies: Dict[str, str]) -> bool:
        """The plan of ``unit``'s forward; whether it changed anything. PlannerError, with
        nothing changed, when the plan names an operator the model does not have (a planner
        or daemon that planned another model)."""
        self._check(strategies, f"the plan of micro-batch {unit}", PlannerError)
        for s in strategies.values():
            if s not in STRATEGIES:
                raise PlannerError(f"the plan of micro-batch {unit} gives an unknown strategy "
                                   f"'{s}' ({', '.join(STRATEGIES)})")
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

    def in_effect(self, units: Iterable[int]) -> Dict[str, int]:
        """(operator, micro-batch) pairs per strategy over the planned operators of ``units``
        as their forwards run them (the plans as served, revised after a gate, or forced)."""
        counts: Dict[str, int] = {}
        for unit in units:
            for qualname, s in self.per_unit.get(unit, {}).items():
                if self.forced is not None:
                    name = qualname.split(".", 1)[-1]
                    s = self.forced.get(name, self.forced.get(qualname, KEEP))
                counts[s] = counts.get(s, 0) + 1
        return counts

    def clear(self) -> None:
        """A new iteration: the plans of the last one no longer apply."""
        self.per_unit.clear()
