"""What one forward's operator scopes know while it runs: the operator stack (its innermost
operator is the one saving what the pack hook receives; capture/calls.py pushes and pops it), the
producer of each storage (noted as operators return, by the binding's note_output), the tensors
that enter a layer from outside it, and the recompute calls open now. Forgotten when the forward
ends: their storage pointers may be reused.

Not thread-safe: the training thread."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..vocabulary import OUTSIDE, Op


class ForwardScope:
    """The operator scopes and producers of the forward running now. The tracker hands its
    containers to the compiled binding by name (csrc/hooks.cc reads ``scope`` and
    ``producers``): they are cleared, never replaced. Not thread-safe: the training thread."""

    def __init__(self) -> None:
        self.ops: List[Op] = []  # the operator stack, innermost last
        self.producers: Dict[int, Tuple[Any, Op, Any]] = {}  # storage ptr -> (weakref, op, call)
        # storage ptr -> weakref: tensors that enter a layer from outside it (rotary tables,
        # masks); light capture counts them outside the layers, as records do.
        self.external: Dict[int, Any] = {}
        self.calls: List[Any] = []  # recompute.Call objects open now, innermost last

    def current_op(self) -> Op:
        """The innermost operator running now (OUTSIDE: none)."""
        return self.ops[-1] if self.ops else OUTSIDE

    def note_external(self, t: torch.Tensor) -> None:
        """``t`` enters a layer from outside (light capture counts it outside the layers)."""
        if t.numel() > 0:
            st = t.untyped_storage()
            self.external[st.data_ptr()] = weakref.ref(st)

    def producer_call(self, st: torch.UntypedStorage, op: Op) -> Tuple[Op, Optional[Any]]:
        """The producer of ``st`` and its recompute call: a noted producer, else ``op``, the
        innermost operator running now (the storage was made inside it), with its call if it
        opened one."""
        hit = self.producers.get(st.data_ptr())
        if hit is not None and hit[0]() is st:
            return hit[1], hit[2]
        calls = self.calls
        return op, (calls[-1] if calls and calls[-1].op is op else None)

    def inside_layers(self, key: int, st: torch.UntypedStorage) -> bool:
        """Whether storage ``st`` (at ``key``) saved now counts inside the layers: the
        innermost operator is in a layer and the storage did not enter it from outside."""
        ops = self.ops
        inside = bool(ops) and ops[-1].layer >= 0
        if inside and key in self.external:
            inside = self.external[key]() is not st
        return inside

    def clear(self) -> None:
        """The forward ended (or everything is released): forgets its scopes, producers,
        external inputs and open calls."""
        self.ops.clear()
        self.producers.clear()
        self.external.clear()
        self.calls.clear()
