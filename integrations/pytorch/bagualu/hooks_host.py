"""The runtime as the capture hooks and recompute calls see it (capture/host.py's Host): whether
a forward runs and whether it is the capture, the strategy of an operator, the capture's
operator times, the routers' load factors (which may replan the rest of a forward), and whether a
recompute may rerun now (FSDP2). runtime.py's Runtime is this Host and composes the rooms behind
it.

Not thread-safe: the training thread."""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .capture.foreign import Hidden
from .capture.tracker import Tracker
from .discovery.sharding import Sharding
from .errors import BagualuError, NotReady
from .iteration import IterationLog
from .planning.plans import Planning
from .planning.strategies import Strategies
from .vocabulary import Op


class HooksHost:
    """capture/host.py's Host over a runtime's rooms (its tracker, strategies, plans and
    iteration log). Not thread-safe: the training thread (a recompute call may rerun on
    autograd's while the training thread waits in backward())."""

    def __init__(self, device: torch.device, tracker: Tracker, strategies: Strategies,
                 planning: Planning, log: IterationLog) -> None:
        self.device = device
        self.tracker = tracker
        self.strategies = strategies
        self.planning = planning
        self.log = log
        # What the model's own checkpointing hides from the capture (capture/foreign.py).
        self.hidden = Hidden(tracker.pack, lambda: tracker.param_keys)
        self.forwarding = False                        # a micro-batch's forward runs
        self.op_ms: Dict[str, float] = {}              # operator -> forward ms (capture)
        self.sharding: Optional[Sharding] = None      # the model's FSDP2 modules

    @property
    def capturing(self) -> bool:
        return self.tracker.capture

    @property
    def may_defer(self) -> bool:
        return self.strategies.may_defer

    def strategy_of(self, op: Op, unit: int) -> str:
        return self.strategies.of(op, unit)

    def op_time(self, name: str, ms: float) -> None:
        self.op_ms[name] = self.op_ms.get(name, 0.0) + ms

    def observe_router(self, layer: int, load: float) -> bool:
        return self.planning.observe_router(self.tracker.micro_batch, layer, load)

    def note_load(self, layer: int, load: float) -> None:
        self.planning.note_load(self.tracker.micro_batch, load)

    def note_recompute(self, ms: float, ops: int) -> None:
        self.log.note_recompute(ms, ops)

    def before_rerun(self, op: Op, fn: object) -> None:
        sharding = self.sharding
        if sharding is None or not sharding.active or not isinstance(fn, nn.Module):
            return
        issuer = self.tracker.issuer
        scheduled = issuer is not None and issuer.issuing
        if sharding.ready(fn, scheduled):
            return
        if scheduled:  # counted: tracker counter rerun_waits
            c = self.tracker.counters
            c["rerun_waits"] = c.get("rerun_waits", 0) + 1
            raise NotReady(f"recompute of {op.qualname} waits for FSDP2 to gather its "
                           "parameters (its layer's backward)")
        raise BagualuError(
            f"recompute of {op.qualname} ({type(fn).__name__}): FSDP2 holds its parameters "
            "sharded now (its layer's backward has not started, or has ended), so it cannot "
            "be rerun; keep this operator with ops= or force_strategies")
