"""The vocabulary shared by every part of the package: strategies, placements, operator kinds,
Op.

No imports from the rest of the package (it sits at the bottom of the dependency order).
Immutable values; safe from any thread."""
from __future__ import annotations

from dataclasses import dataclass

KEEP, RECOMPUTE, OFFLOAD, FP8 = "keep", "recompute", "offload", "fp8"
STRATEGIES = (KEEP, RECOMPUTE, OFFLOAD, FP8)
# Where a record's data is (the enforcer's placement names): on the device, on the host, as an
# FP8 copy, dropped for recompute.
DEVICE, HOST, FP8_PLACE, DROPPED = "device", "host", "fp8", "dropped"

KINDS = ("norm", "linear", "attention", "router", "dispatch", "combine", "expert_linear",
         "expert_activation", "shared_linear", "shared_activation", "comm", "other")
SCALING_KINDS = frozenset({"dispatch", "combine", "expert_linear", "expert_activation"})


@dataclass(frozen=True)
class Op:
    """A planner operator: name within its layer, kind (docs/planner.md), layer (-1: outside).
    Its hash and qualified name are computed once (the saved-tensor hooks look operators up in
    dicts at every pack)."""

    name: str
    kind: str
    layer: int = -1

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.name, self.kind, self.layer)))
        object.__setattr__(self, "_qualname",
                           f"L{self.layer}.{self.name}" if self.layer >= 0 else self.name)

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined]

    @property
    def qualname(self) -> str:
        return self._qualname  # type: ignore[attr-defined]


OUTSIDE = Op("outside", "other", -1)
