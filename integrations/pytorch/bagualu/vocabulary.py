"""The vocabulary shared by every part of the package: strategies, operator kinds, Op.

No imports from the rest of the package (it sits at the bottom of the dependency order).
Immutable values; safe from any thread."""
from __future__ import annotations

from dataclasses import dataclass

KEEP, RECOMPUTE, OFFLOAD, FP8 = "keep", "recompute", "offload", "fp8"
STRATEGIES = (KEEP, RECOMPUTE, OFFLOAD, FP8)

KINDS = ("norm", "linear", "attention", "router", "dispatch", "combine", "expert_linear",
         "expert_activation", "shared_linear", "shared_activation", "comm", "other")
SCALING_KINDS = frozenset({"dispatch", "combine", "expert_linear", "expert_activation"})


@dataclass(frozen=True)
class Op:
    """A planner operator: name within its layer, kind (docs/planner.md), layer (-1: outside)."""

    name: str
    kind: str
    layer: int = -1

    @property
    def qualname(self) -> str:
        return f"L{self.layer}.{self.name}" if self.layer >= 0 else self.name


OUTSIDE = Op("outside", "other", -1)
