"""When a saved storage's bytes move, decided in one place: a new record's strategy applied at
pack (at once on synchronous copies, behind the copy threads, left to the plan's issue order, or
dropped for its recompute call to regenerate), the planned offloads placed in the stage graph
when their forward ends and let go of once the stream scheduler completed them, the early flush
of those still waiting, the reloads ahead of a backward, pressure eviction over every live
record, and the enforcer's reload order key (the need order, defined here once). The records
carry each move out through the enforcer (record.py); the enforcer is the binding
(enforce/enforcer.py).

Records are record.py's Record objects, used by their fields and moves only (this room sits
below record.py). Not thread-safe: the training thread (and the autograd thread that runs unpack
hooks while the training thread waits in backward()).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Set, Tuple

import torch

from ..vocabulary import FP8, KEEP, OFFLOAD, RECOMPUTE, Op
from . import eviction
from .enforcer import Enforcer

log = logging.getLogger("bagualu")


def need_order(unit: int, seq: int) -> int:
    """The enforcer's reload order key of the ``seq``-th record made for ``unit`` (smaller:
    needed sooner, evicted later): earlier units first, and within a unit the backward needs the
    last saved storage first. (The binding's pack, csrc/hooks.cc MoveAtOnce, computes the same
    key.)"""
    return (unit << 32) + (1 << 31) - 1 - (seq % (1 << 31))


class Mover:
    """Every move decision over the records of one tracker, through ``enforcer`` (None: nothing
    ever moves). ``counters`` are the tracker's (records add to them too); ``records`` gives every
    live record (pressure eviction's candidates); ``evict_fp8``: pressure eviction stores in FP8
    what it cannot offload. Not thread-safe: the training thread (and autograd's while the
    training thread waits in backward())."""

    def __init__(self, enforcer: Optional[Enforcer], counters: Dict[str, int],
                 records: Callable[[], Iterable[Any]], evict_fp8: bool = False) -> None:
        self.enforcer = enforcer
        self.counters = counters
        self.records = records
        # Pressure eviction stores in FP8 what it cannot offload (the pinned pool is full at
        # the node's grant): the policy allows FP8 and it beats running out of memory.
        self.evict_fp8 = evict_fp8
        # Copies complete before the call returns (the host backend's, on this thread): an
        # offload is done at once, and reloading ahead of the backward would only move the
        # same copy earlier (nothing overlaps it), so each acquire reloads what it needs.
        self.sync_offloads = bool(enforcer is not None and enforcer.sync_copies)
        self.reload_ahead = enforcer is not None and not self.sync_offloads
        # Copies on the host backend's copy threads (they overlap compute here): an offload at
        # pack time does not wait for its copy, which reads PyTorch's memory; the record keeps
        # the device data until poll_copies sees the copy done (``copying``, in issue order:
        # one D2H stream completes them in order). On CUDA the allocator orders the free after
        # the copy stream instead (borrowed_free_is_safe), and offload() does not wait there.
        self.offload_behind = (enforcer is not None and not self.sync_offloads
                               and not enforcer.cuda and not enforcer.borrowed_free_is_safe)
        self.copying: Deque[Any] = deque()
        # Offloads left to the plan's issue order (enforce/order.py): the units whose records
        # wait for it, and those records by enforcer handle until the enforcer moved them.
        self.scheduled: Set[int] = set()
        self.planned: Dict[int, Any] = {}
        self.op_ids: Dict[Op, int] = {}  # the enforcer's operator numbers
        # storage ptr -> (record, call): storages a recompute call made and handed to an
        # operator inside it before anything packed them (held by that operator's own call),
        # dropped once a pack inside the call tells where its rerun makes them again.
        self.unkeyed: Dict[int, Tuple[Any, Any]] = {}
        self._warned = False
        # True while the enforcer reloads ahead of the backward (prefetch): those reloads
        # take only the room there is and never evict (evict() frees nothing meanwhile).
        self._reloading_ahead = False

    # -- the enforcer's view of a record ----------------------------------------------------
    def op_id(self, op: Op) -> int:
        """The enforcer's number of ``op`` (stable for the life of the tracker; the binding's
        pack numbers operators in ``op_ids`` too)."""
        i = self.op_ids.get(op)
        if i is None:
            i = self.op_ids[op] = len(self.op_ids)
        return i

    def register(self, rec: Any, st: torch.UntypedStorage, consumer: Optional[Op],
                 now: bool) -> None:
        """A new record of a storage the enforcer may move: registered now in one call (its
        need order and ``consumer``, the operator saving it now, if any), or, not ``now``,
        once its first move needs it (track): lazy, with its producing CUDA stream."""
        enforcer = self.enforcer
        if now:
            rec.enf = enforcer.register(
                st, rec.dtype, self.op_id(rec.producer), rec.micro_batch,
                need_order(rec.micro_batch, rec.seq),
                self.op_id(consumer) if consumer is not None else -1, ptr=rec.ptr,
                nbytes=rec.nbytes)
        else:
            rec.lazy = True
            if enforcer.cuda:  # its first move is ordered after the producer's work
                rec.stream = enforcer.current_stream()

    def track(self, rec: Any, move: str = KEEP) -> Any:
        """Registers a record kept so far with the enforcer (its first move is coming): its
        reload order and every operator that saved it; returns the handle (0: another record
        tracks the storage). ``move`` OFFLOAD or FP8: carries that move out in the same call
        and returns the handle, None or why the move failed, and the FP8 copy's bytes (0 for
        an offload). The record's storage is still the one it was made with (only a record the
        enforcer tracks is ever dropped and regenerated), so its pointer and size are the
        record's."""
        ops = rec.consumers
        args = (rec.storage, rec.dtype, self.op_id(rec.producer), rec.micro_batch,
                need_order(rec.micro_batch, rec.seq), self.op_id(ops[0]) if ops else -1)
        if move == OFFLOAD:
            (h, error), fp8_bytes = self.enforcer.offload_saved(*args, rec.ptr, rec.nbytes), 0
        elif move == FP8:
            h, error, fp8_bytes = self.enforcer.store_fp8_saved(*args, rec.ptr, rec.nbytes)
        else:
            h = self.enforcer.register(*args, stream=rec.stream, ptr=rec.ptr, nbytes=rec.nbytes)
        if h:
            for op in ops[1:]:
                self.enforcer.add_consumer(h, self.op_id(op))
        return h if move == KEEP else (h, error, fp8_bytes)

    def add_consumer(self, rec: Any, op: Op) -> None:
        """``op`` saved the record's storage (the binding's pack calls this too)."""
        rec.consumers.append(op)
        if rec.enf:
            self.enforcer.add_consumer(rec.enf, self.op_id(op))

    def enforcer_failed(self, what: str, error: Exception) -> None:
        """A move failed (e.g. the pinned pool is full): the activation stays on the device;
        said once, counted always."""
        if not self._warned:
            log.warning("bagualu: %s failed, the activation stays on the device: %s", what,
                        error)
            self._warned = True
        key = what.replace(" ", "_") + "_failures"
        self.counters[key] = self.counters.get(key, 0) + 1

    # -- at pack ----------------------------------------------------------------------------
    def on_saved(self, rec: Any, strategy: str, at_once: bool, call: Any = None,
                 pack_index: Optional[int] = None) -> None:
        """A new record whose producer's strategy is ``strategy`` (not keep): moved in the
        enforcer's register-and-move call (``at_once``: synchronous copies and casts, the
        record made lazy and unaccounted for it), dropped for recompute when its producer's
        ``call`` can find it again (by ``pack_index``, the pack being made now, while the call
        runs; by its outputs after), else as _apply says."""
        if at_once:
            self._move_at_once(rec, strategy)
        elif strategy != RECOMPUTE:
            self._apply(rec, strategy)
        elif call is not None:
            k = call.key_for(rec.ptr, pack_index)
            if k is not None:
                rec.drop(call, k)
            elif call.open:  # held by an inner call: a later pack inside this one finds it
                self.unkeyed[rec.ptr] = (rec, call)

    def drop_found(self, rec: Any, pack_index: int) -> None:
        """``rec``'s storage is packed now (pack ``pack_index``): if its producer's recompute
        call made it and could not drop it when an inner operator's call held it first (e.g.
        an expert's gate-up output, which the activation's own call holds), that call's rerun
        makes it again at this pack: it is dropped as its plan says."""
        hit = self.unkeyed.get(rec.ptr)
        if hit is None or hit[0] is not rec:
            return
        del self.unkeyed[rec.ptr]
        call = hit[1]
        if call.open and rec.storage is not None:  # on the device
            k = call.key_for(rec.ptr, pack_index)
            if k is not None:
                rec.drop(call, k)

    def _apply(self, rec: Any, strategy: str) -> None:
        if strategy == OFFLOAD:
            if rec.micro_batch in self.scheduled and rec.movable():
                rec.plan_offload()
                self.planned[rec.enf] = rec
            elif self.offload_behind:
                if self.copying:
                    self.poll_copies()
                if not rec.offload_behind():
                    rec.offload()
            else:
                rec.offload()
        elif strategy == FP8:
            if rec.enf:
                self.enforcer.set_strategy(rec.enf, FP8)
            rec.store_fp8()

    def _move_at_once(self, rec: Any, strategy: str) -> None:
        """Registers a new record and offloads it or casts it to FP8 (``strategy``) in one
        call of the enforcer (synchronous copies and casts: done when it returns); a record
        the enforcer cannot take (another tracks its storage) or whose move failed stays on
        the device, accounted there."""
        if rec.lazy:
            rec.lazy = False
            rec.enf, error, fp8_bytes = self.track(rec, strategy)
            if self._moved_at_once(rec, strategy, error, fp8_bytes):
                return
        rec._account(rec.nbytes)

    def _moved_at_once(self, rec: Any, strategy: str, error: Optional[Exception],
                       fp8_bytes: int) -> bool:
        """The outcome of the enforcer's register-and-move call for a new record: the device
        copy goes (True), or the failure is said and counted (False: the record stays on the
        device)."""
        if rec.enf and error is None:
            if strategy == OFFLOAD:
                rec.left_for_host()
            else:
                rec.stored_fp8(fp8_bytes)
            return True
        if error is not None:
            self.enforcer_failed("offload" if strategy == OFFLOAD else "fp8 cast", error)
        return False

    def move_outcome(self, rec: Any, strategy: str, status: int, handle: int) -> None:
        """The binding's pack moved a new record at once (``strategy`` offload or fp8) and the
        enforcer answered ``status`` (not ok) with ``handle``: as _move_at_once's failures."""
        rec.enf, error = self.enforcer.saved_outcome(
            status, handle, "offload" if strategy == OFFLOAD else "store_fp8")
        if not self._moved_at_once(rec, strategy, error, 0):
            rec._account(rec.nbytes)

    # -- offloads in the plan's issue order -------------------------------------------------
    def place_planned(self, micro_batch: int, locate: Callable[[Any], Tuple[int, int]],
                      later: bool) -> None:
        """The forward of ``micro_batch`` ended: its planned offloads are left to a later
        point's O chain (``later``) for the records ``locate`` maps to the stage graph
        (producer operator, graph tensor); the rest are offloaded now."""
        self.scheduled.discard(micro_batch)
        for h, rec in list(self.planned.items()):
            if rec.micro_batch != micro_batch:
                continue
            op, tensor = locate(rec) if later else (-1, -1)
            if tensor >= 0 and rec.movable():
                self.enforcer.set_graph_index(rec.enf, op, tensor)
                continue
            del self.planned[h]
            rec.offload()

    def poll_copies(self) -> None:
        """Lets go of the device data of offloads issued without waiting (offload_behind)
        whose copy is done, oldest first; stops at the first still copying."""
        copying = self.copying
        while copying:
            rec = copying[0]
            if rec.issued and rec.storage is not None:  # else it left or was released
                if not self.enforcer.copy_done(rec.enf):
                    return
                rec.left_for_host()
            copying.popleft()

    def collect_offloaded(self) -> None:
        """Lets go of the device copies whose scheduled (or issued, poll_copies) offload
        completed."""
        if self.copying:
            self.poll_copies()
        if not self.planned:
            return
        for h in self.enforcer.scheduler.take_offloaded():
            rec = self.planned.pop(h, None)
            if rec is not None and rec.planned and rec.storage is not None:
                rec.left_for_host()
                self.counters["scheduled_offloads"] += 1

    def pending_bytes(self) -> int:
        """Device bytes of planned offloads still waiting for their point's O chain."""
        return sum(r.pool_bytes for r in self.planned.values() if r.planned)

    def flush_pending(self) -> None:
        """Issues now the planned offloads still waiting for their O chain (counted as early
        offloads), later micro-batches first. On the host backend's copy threads
        (offload_behind) each is issued without waiting, as a GPU's copy stream takes it: the
        forward starts beside the copies, and an allocation short of room waits for as many
        as it needs (pressure eviction completes issued offloads first); one its O chain issued
        already is left to collect_offloaded. Elsewhere each completes before the next. Issue
        42: over an emulated link, waiting for every copy here cost 256 ms of 1.4 s per
        iteration of the unmodified Qwen3-MoE."""
        for rec in sorted(self.planned.values(), key=lambda r: (-r.micro_batch, r.seq)):
            if not rec.planned or not rec.movable():
                continue
            issued = rec.issued  # its copy runs already (behind, or its O chain issued it):
            # completing it is no early offload
            if not self.offload_behind:
                if rec.offload() and not issued:
                    self.counters["early_offloads"] += 1
                continue
            if issued or not rec.tracked():  # issued: by offload_behind or by its O chain
                continue
            if rec.offload_behind() or rec.offload():
                self.counters["early_offloads"] += 1

    def forward_ended(self) -> None:
        """A forward ended: lets go of what finished copying; forgets the storages no pack
        dropped (their pointers may be reused)."""
        if self.copying:
            self.poll_copies()
        self.unkeyed.clear()

    def release_all(self) -> None:
        """Forgets the copies in flight (each record waits for its copy when released) and the
        storages no pack dropped."""
        self.unkeyed.clear()
        self.copying.clear()

    # -- reloads through the enforcer -------------------------------------------------------
    def begin_backward(self, micro_batch: int) -> None:
        """The enforcer starts reloading the micro-batch's offloaded records in the order the
        backward needs them (their need order); each acquire lets it issue the next."""
        if self.enforcer is None:
            return
        self.collect_offloaded()
        if self.reload_ahead:
            self._prefetch(micro_batch)

    def reload_early(self, micro_batch: int) -> None:
        """Starts reloading ``micro_batch``'s offloaded records before its backward begins
        (the first ones in need order, as many as the enforcer's bound lets ahead), where the
        caller made room for them: the copies then run under the compute before it."""
        if self.enforcer is not None and self.reload_ahead:
            self._prefetch(micro_batch)

    def acquired(self, micro_batch: int) -> None:
        """A reload of ``micro_batch`` was consumed: the enforcer may issue the next one (the
        binding's unpack calls this too)."""
        if self.reload_ahead:
            self._prefetch(micro_batch)

    def _prefetch(self, micro_batch: int) -> None:
        """Reloads ahead of the backward in the room there is: evicting another micro-batch's
        activations to bring one back early would only move the pressure (the acquire that
        needs a tensor reloads it, and may evict, when its consumer runs)."""
        self._reloading_ahead = True
        try:
            self.enforcer.prefetch(micro_batch)
        finally:
            self._reloading_ahead = False

    # -- pressure ---------------------------------------------------------------------------
    def evict(self, needed: int) -> int:
        """Pressure eviction (enforce/eviction.py) over the live records of every unit; nothing
        while reloading ahead (_prefetch)."""
        if self._reloading_ahead:
            return 0
        records: List[Any] = list(self.records())
        return eviction.evict(records, needed, self.enforcer, self.counters, self.evict_fp8)
