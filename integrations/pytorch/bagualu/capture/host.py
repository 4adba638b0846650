"""What the capture hooks (capture/modules.py, capture/blocks.py) and recompute calls need from
the runtime that installs them: a typed protocol, so that capture does not import the runtime.
Not thread-safe: the training thread."""
from __future__ import annotations

from typing import Protocol

import torch

from ..vocabulary import Op
from .foreign import Hidden
from .tracker import Tracker


class Host(Protocol):
    """The runtime as the hooks see it (hooks_host.HooksHost implements it, and so
    runtime.Runtime)."""

    forwarding: bool          # a micro-batch's forward runs (a recompute rerun is not one)
    tracker: Tracker
    hidden: Hidden            # what the model's own checkpointing hides (the capture)
    device: torch.device

    @property
    def capturing(self) -> bool:
        """Whether the running forward is the capture (the first micro-batch)."""
        ...

    @property
    def may_defer(self) -> bool:
        """Whether a router may switch later operators of the forward to recompute."""
        ...

    def strategy_of(self, op: Op, unit: int) -> str: ...

    def op_time(self, name: str, ms: float) -> None:
        """Adds ``ms`` to the measured forward time of operator ``name`` (capture)."""
        ...

    def observe_router(self, layer: int, load: float) -> bool:
        """A router ran with load factor ``load``; True when the plan of the rest of the
        forward changed (deferred planning)."""
        ...

    def note_load(self, layer: int, load: float) -> None:
        """A router ran with ``load`` where no replan may follow (inside a recompute)."""
        ...

    def before_rerun(self, op: Op, fn: object) -> None:
        """A recompute call of ``op`` is about to rerun ``fn``: raises NotReady when it must
        wait (FSDP2 holds the module's parameters sharded now)."""
        ...

    def note_recompute(self, ms: float, ops: int) -> None:
        """A recompute call reran ``ops`` operators' forward in ``ms``."""
        ...
