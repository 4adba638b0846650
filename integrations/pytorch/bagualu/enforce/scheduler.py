"""The enforcer's stream scheduler (bgl_enf_schedule_*): a scheduling point's issue order loaded
(the binding's schedule_begin, the one reader of the plan's items), the pieces it could not carry
out skipped (counted, said once), and the offloads it completed handed back
(bgl_enf_take_offloaded). Where compute is, the scheduler learns from enforce/order.py's
PointIssuer (the binding's IssueCursor: bgl_enf_schedule_at); the Mover (enforce/mover.py) lets
go of the device copies of what it offloaded.

Not thread-safe: driven by the training thread (and the autograd thread running unpack hooks
while the training thread waits in backward()).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Dict, List, Sequence

from ..native import ext
from .handle import EnforcerHandle

log = logging.getLogger("bagualu")
_C = ext.load()


class StreamScheduler:
    """The issue order of one enforcer (``enf``): each O/R piece is issued once compute
    reached its round, a bounded number in flight. Not thread-safe: the training thread (and
    autograd's while the training thread waits in backward())."""

    def __init__(self, enf: EnforcerHandle) -> None:
        self.enf = enf
        self.skipped_pieces = 0  # scheduled pieces that could not be carried out

    def begin(self, order: Sequence[Dict[str, Any]], offload_micro_batch: int,
              recover_micro_batch: int) -> None:
        """Loads a point's issue order (the plan's items: chain, stage, round, resource, first,
        last); O pieces move tensors of ``offload_micro_batch``, R pieces bring back those of
        ``recover_micro_batch`` (-1: none)."""
        enf = self.enf
        enf.check(_C.schedule_begin(enf.fast, order, offload_micro_batch, recover_micro_batch),
                  "schedule_begin")

    def finish(self) -> None:
        """Issues what is left of the order and waits for it."""
        self.piece(self.enf.lib.bgl_enf_schedule_finish(self.enf.handle), "schedule_finish")

    def take_offloaded(self) -> List[int]:
        """Handles whose offload, issued by the scheduler, completed since the last call
        (retires finished pieces and issues more first)."""
        enf = self.enf
        self.piece(enf.lib.bgl_enf_schedule_poll(enf.handle, None), "schedule_poll")
        out: List[int] = []
        buf = (ctypes.c_uint64 * 256)()
        n = ctypes.c_size_t(0)
        while True:
            enf.check(enf.lib.bgl_enf_take_offloaded(enf.handle, buf, 256, ctypes.byref(n)),
                      "take_offloaded")
            out.extend(buf[i] for i in range(n.value))
            if n.value < 256:
                return out

    def piece(self, rc: int, what: str) -> None:
        """A piece the scheduler could not carry out (no room for a reload, the pinned pool
        full, a tensor that moved meanwhile, a recompute that must wait for its parameters) is
        skipped: its tensors stay where they are and the backward's acquire brings them back.
        Counted, said once; anything else raises."""
        enf = self.enf
        if enf.declined(rc) or rc in enf.vocab.skipped_piece:
            self.skipped_pieces += 1
            if self.skipped_pieces == 1:
                log.info("bagualu: a scheduled piece was skipped (%s); its tensors stay where "
                         "they are", enf.last_error())
            return
        enf.check(rc, what)
