"""The saved-tensor hooks and the records of the micro-batches in flight (record.py: one
storage, with its producer and every operator that saved it, and where its data is): pack,
unpack, operator scopes and producers, the plan's strategy applied at pack time, light capture
(and small storages, which are counted as light capture counts: they never move).

The pack hook of torch.autograd.graph.saved_tensors_hooks receives only a tensor; the operator
that saves it is the innermost operator scope (pushed by the hooks of capture/modules.py and
capture/blocks.py). Tensors are
deduplicated by storage: a view of a larger storage shares its base's record, and the unpack
hook rebuilds the view (offset, sizes, strides) on whatever storage holds the data then.
"""
from __future__ import annotations

import logging
import weakref
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch

from ..discovery.sharding import is_parameter, local_storage_ptrs
from ..enforce import eviction
from ..enforce.device import DeviceMemory
from ..enforce.enforcer import Enforcer, fp8_supported
from ..enforce.order import PointIssuer
from ..native import ext
from ..record import DEVICE, DROPPED, FP8_PLACE, HOST, Packed, Record, _Plain
from ..vocabulary import FP8, KEEP, OFFLOAD, OUTSIDE, RECOMPUTE, Op
from .light import LightSet

log = logging.getLogger("bagualu")


StrategyFn = Callable[[Op, int], str]


class Tracker:
    """Captures saved activations of the micro-batches in flight and applies strategies.
    Collaborators are given at construction; the model's facts (``set_model``) at instrument,
    the issuer (``set_issuer``) once plans carry an issue order."""

    def __init__(self, memory: DeviceMemory, enforcer: Optional[Enforcer],
                 strategy_of: StrategyFn, fp8_block: int = 128, light_grain: int = 0,
                 evict_fp8: bool = False, min_move_bytes: int = 0) -> None:
        self.memory = memory
        self.device_alloc: Callable[[int], int] = memory.alloc
        self.device_free: Callable[[int, int], None] = memory.free
        self.pool_backed = memory.pool_backed  # device_alloc gives pool blocks (CPU)
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
        self.copying: Deque[Record] = deque()
        self.device_type = memory.device.type  # where activations live; only those move
        self._ours: Dict[torch.device, bool] = {}  # device -> of device_type (a device's .type
        # costs more than the rest of a record's registration checks together)
        self.enforcer = enforcer  # every move of a record goes through it
        self.strategy_of = strategy_of
        self.fp8_block = fp8_block
        # Bytes per accounting block of light micro-batches (0: exact).
        self.light_grain = light_grain
        # Storages of at most these bytes are never moved: outside the capture they are only
        # counted, as light capture counts (_produced_record), since moving one would cost
        # the enforcer's calls for next to no memory (0: every storage gets a record).
        self.min_move_bytes = min_move_bytes
        # Pressure eviction stores in FP8 what it cannot offload (the pinned pool is full at
        # the node's grant): the policy allows FP8 and it beats running out of memory.
        self.evict_fp8 = evict_fp8
        self.counters: Dict[str, int] = {
            "offloads": 0, "reloads": 0, "bytes_d2h": 0, "bytes_h2d": 0, "fp8_casts": 0,
            "fp8_uncasts": 0, "evictions": 0, "evicted_bytes": 0, "records": 0, "drops": 0,
            "recomputes": 0, "scheduled_offloads": 0, "fp8_evictions": 0, "early_offloads": 0,
            "small_kept": 0}
        # Set by set_model at instrument: storages of parameters and buffers (never
        # activations). A storage follows the strategy of the operator that produced it.
        self.param_keys: Set[int] = set()
        self.scope: List[Op] = []
        # Light capture: a micro-batch whose strategies are all keep needs no records. Saved
        # storages are only counted (storage ptr -> (weakref, nbytes), nbytes negative once a
        # consumer outside the layers saved it) and accounted in coarse blocks freed when its
        # backward ends. The weakref tells a storage from a dead one whose pointer was reused
        # (a graph piece dropped during the forward).
        self.light: Optional[Dict[int, Tuple[Any, int]]] = None  # the current forward's
        self.light_sets: Dict[int, LightSet] = {}         # unit -> its light set
        # Offloads left to the plan's issue order (enforce/order.py): the units whose records
        # wait for it, and those records by enforcer handle until the enforcer moved them.
        self.scheduled: Set[int] = set()
        self.planned: Dict[int, Record] = {}
        self.issuer: Optional[PointIssuer] = None
        self._enforcer_warned = False
        # True while the enforcer reloads ahead of the backward (prefetch): those reloads
        # take only the room there is and never evict (evict() frees nothing meanwhile).
        self._reloading_ahead = False
        self.op_ids: Dict[Op, int] = {}            # the enforcer's operator numbers
        self.micro_batch = -1                      # the unit whose forward runs (or ran last)
        self.live: Dict[int, Record] = {}          # storage ptr -> record (dedupe)
        self.by_mb: Dict[int, Set[Record]] = {}    # unit -> its live records
        self.producers: Dict[int, Tuple[Any, Op, Any]] = {}  # storage ptr -> (weakref, op, call)
        self.packs_seen = 0                        # pack calls outside light capture
        self.calls: List[Any] = []                 # recompute.Call objects open now
        # storage ptr -> weakref: tensors that enter a layer from outside it (rotary tables,
        # masks); light capture counts them outside the layers, as records do.
        self.external: Dict[int, Any] = {}
        self.captured: List[Record] = []           # filled while capture is on
        # storage ptr -> (record, call): storages a recompute call made and handed to an
        # operator inside it before anything packed them (held by that operator's own call),
        # dropped once a pack inside the call tells where its rerun makes them again.
        self.unkeyed: Dict[int, Tuple[Record, Any]] = {}
        self.capture = False
        self._seq = 0
        # The saved-tensor hooks: the binding's pack makes and finds the records of plain
        # tensors whose producers keep them or move them at once (offload, FP8), its unpack
        # reloads and uncasts, its Packed releases (no Python frame); every other branch is
        # _pack_py's and record.py's.
        pool = memory.pool.blocks if memory.pool is not None else None
        self.hooks = ext.load().Hooks(
            self, Record, {"device": DEVICE, "host": HOST, "fp8_placement": FP8_PLACE,
                           "keep": KEEP, "offload": OFFLOAD, "fp8": FP8, "outside": OUTSIDE},
            pool)
        self.pack: Callable[[torch.Tensor], Any] = self.hooks.pack
        self.unpack: Callable[[Any], torch.Tensor] = self.hooks.unpack
        self._note_output = self.hooks.note_output

    @property
    def pin_memory(self) -> bool:
        """Host copies are page-locked when the activations are on a GPU."""
        return self.device_type == "cuda"

    def set_model(self, param_keys: Set[int]) -> None:
        """The instrumented model's parameter and buffer storages."""
        self.param_keys = set(param_keys)

    def set_issuer(self, issuer: Optional[PointIssuer]) -> None:
        """The stream scheduler's driver once plans carry an issue order."""
        self.issuer = issuer

    def begin_forward(self, unit: int, capture: bool) -> None:
        """The forward of ``unit`` starts (the capture micro-batch when ``capture``)."""
        self.micro_batch = unit
        self.capture = capture
        self.drop_light(unit)  # a set left by an earlier forward whose backward never ran

    # -- scopes -----------------------------------------------------------------------------
    def current_op(self) -> Op:
        return self.scope[-1] if self.scope else OUTSIDE

    def note_output(self, out: Any, op: Op, overwrite: bool = True, call: Any = None) -> None:
        """Records ``op`` (and its recompute call, if any) as the producer of every tensor in
        ``out`` (tensors, tuples, lists, dict values) unless one is known and ``overwrite`` is
        False: ``producers`` maps a storage's pointer to (weakref, op, call). The binding's."""
        self._note_output(out, op, overwrite, call)

    def note_external(self, t: torch.Tensor) -> None:
        """``t`` enters a layer from outside (light capture counts it outside the layers)."""
        if t.numel() > 0:
            st = t.untyped_storage()
            self.external[st.data_ptr()] = weakref.ref(st)

    def _producer_call(self, st: torch.UntypedStorage, op: Op) -> Tuple[Op, Any]:
        """The producer of ``st`` and its recompute call: a noted producer, else the
        innermost operator running now (the storage was made inside it)."""
        hit = self.producers.get(st.data_ptr())
        if hit is not None and hit[0]() is st:
            return hit[1], hit[2]
        calls = self.calls
        return op, (calls[-1] if calls and calls[-1].op is op else None)

    # -- hooks ------------------------------------------------------------------------------
    def _pack_py(self, t: torch.Tensor) -> Any:
        """The pack hook's branches the binding leaves to Python (``pack`` is the binding's):
        light capture, tensor subclasses, and new records other than kept ones."""
        light = self.light
        if light is not None:  # the fast path: count the storage, keep the tensor
            if is_parameter(t):  # a parameter, or FSDP2's all-gathered form of one
                return t
            try:
                st = t.untyped_storage()
                key = st.data_ptr()
            except RuntimeError:  # sparse and other storage-less layouts, wrapper subclasses
                return t
            seen = light.get(key)
            if seen is not None and seen[0]() is not st:  # that storage died; a new one
                self.light_sets[self.micro_batch].forget(abs(seen[1]))
                del light[key]
                seen = None
            if seen is None:
                if key in self.param_keys:
                    light[key] = (weakref.ref(st), 0)  # the next lookup is the only cost
                    return t
                if t.numel() == 0:
                    return t
                self._count(self.light_sets[self.micro_batch], st, key, st.nbytes())
            elif seen[1] > 0:
                scope = self.scope
                if not scope or scope[-1].layer < 0:
                    light[key] = (seen[0], -seen[1])
            return t
        self.packs_seen += 1  # recompute calls find their saved tensors by this count
        if self.micro_batch < 0 or t.numel() == 0 or t.is_sparse or is_parameter(t):
            return t
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except RuntimeError:  # a wrapper subclass without storage (AsyncCollectiveTensor)
            return t
        if key in self.param_keys:
            return t
        ls = self.light_sets.get(self.micro_batch)
        if ls is not None and ls.holds(key, st):
            return t  # counted before the plan changed mid-forward (or small); it stays kept
        op = self.scope[-1] if self.scope else OUTSIDE
        rec = self.live.get(key)
        if rec is None or not rec.same_storage(st) or rec.micro_batch != self.micro_batch:
            rec = self._produced_record(st, t.dtype, op, self.packs_seen - 1, consumer=op,
                                        key=key)
            if rec is None:  # a small storage, counted: it stays as it is
                return t
        elif self.unkeyed:
            self._drop_found(rec, self.packs_seen - 1)
        if op not in rec.consumers:
            self.add_consumer(rec, op)
        return Packed(rec, t)

    def _count(self, ls: LightSet, st: torch.UntypedStorage, key: int, n: int) -> None:
        """Counts storage ``st`` (``n`` bytes at ``key``) in light set ``ls``: inside the
        layers unless the innermost operator is outside them or it entered a layer from
        outside (note_external). A dead storage counted at the same pointer is forgotten."""
        seen = ls.sizes.get(key)
        if seen is not None:
            ls.forget(abs(seen[1]))
        ls.grow(n)
        scope = self.scope
        inside = bool(scope) and scope[-1].layer >= 0
        if inside and key in self.external:
            inside = self.external[key]() is not st
        ls.sizes[key] = (weakref.ref(st), n if inside else -n)

    def _produced_record(self, st: torch.UntypedStorage, dtype: torch.dtype, op: Op,
                         pack_index: Optional[int], consumer: Optional[Op] = None,
                         key: Optional[int] = None) -> Optional[Record]:
        """A new record under producer strategies: its producer's strategy applies once. A
        recompute producer's call drops it if its rerun can find it again: by ``pack_index``
        (the pack being made now) while the call runs, by its outputs after. ``consumer``: the
        operator saving it now (registered with it). A kept record meets the enforcer only if
        something must move it later (pressure eviction); an offload the training thread
        carries out at once on the host backend's synchronous copies is never accounted on
        the device (its copy is complete when the pack returns).

        With ``key`` (a pack at that storage pointer), outside the capture, a storage of at
        most min_move_bytes whose producer does not recompute it gets no record (None): moving
        it would cost the enforcer's calls for next to no bytes, so it stays and is counted as
        light capture counts, in the micro-batch's light set until its backward ends (a
        recompute producer's call drops and regenerates its storages through records)."""
        producer, call = self._producer_call(st, op)
        s = self.strategy_of(producer, self.micro_batch)
        n = st.nbytes()
        if key is not None and s != RECOMPUTE and not self.capture:
            if n <= self.min_move_bytes:
                grain = min(self.light_grain, 4 * self.min_move_bytes)
                self._count(self._light_set(self.micro_batch, grain), st, key, n)
                self.counters["small_kept"] += 1
                return None
        at_once = self.sync_offloads and (
            (s == OFFLOAD and self.micro_batch not in self.scheduled)
            or (s == FP8 and fp8_supported(dtype)))
        rec = self.new_record(st, dtype, producer, consumer,
                              register=s != KEEP and not at_once, account=not at_once,
                              ptr=key, nbytes=n)
        if s == KEEP:
            return rec
        if at_once:
            self._move_at_once(rec, s)
        elif s != RECOMPUTE:
            self._apply(rec, s)
        elif call is not None:
            k = call.key_for(rec.ptr, pack_index)
            if k is not None:
                rec.drop(call, k)
            elif call.open:  # held by an inner call: a later pack inside this one finds it
                self.unkeyed[rec.ptr] = (rec, call)
        return rec

    def _drop_found(self, rec: Record, pack_index: int) -> None:
        """``rec``'s storage is packed now (pack ``pack_index``): if its producer's recompute
        call made it and could not drop it when an inner operator's call held it first (e.g.
        an expert's gate-up output, which the activation's own call holds), that call's rerun
        makes it again at this pack: it is dropped as its plan says."""
        hit = self.unkeyed.get(rec.ptr)
        if hit is None or hit[0] is not rec:
            return
        del self.unkeyed[rec.ptr]
        call = hit[1]
        if call.open and rec.storage is not None and rec.placement == DEVICE:
            k = call.key_for(rec.ptr, pack_index)
            if k is not None:
                rec.drop(call, k)

    def _move_at_once(self, rec: Record, strategy: str) -> None:
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

    def _moved_at_once(self, rec: Record, strategy: str, error: Optional[Exception],
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

    def _move_outcome(self, rec: Record, strategy: str, status: int, handle: int) -> None:
        """The binding's pack moved a new record at once (``strategy`` offload or fp8) and the
        enforcer answered ``status`` (not ok) with ``handle``: as _move_at_once's failures."""
        rec.enf, error = self.enforcer.saved_outcome(
            status, handle, "offload" if strategy == OFFLOAD else "store_fp8")
        if not self._moved_at_once(rec, strategy, error, 0):
            rec._account(rec.nbytes)

    def hold(self, t: torch.Tensor) -> Any:
        """A handle that keeps ``t`` for a recompute call: through its record (which follows
        its producer's strategy) when it is an activation, else the tensor itself. A storage
        made inside a call still running is not being packed, so that call's rerun cannot
        find it: it stays on the device."""
        if t.numel() == 0 or t.is_sparse or self.micro_batch < 0 or is_parameter(t):
            return _Plain(t)
        try:
            st = t.untyped_storage()
            if st.data_ptr() in self.param_keys:
                return _Plain(t)
        except RuntimeError:  # a wrapper subclass without storage
            return _Plain(t)
        ls = self.light_sets.get(self.micro_batch)
        if ls is not None and ls.holds(st.data_ptr(), st):
            return _Plain(t)  # counted in the light set: it stays on the device
        rec = self.live.get(st.data_ptr())
        if rec is None or not rec.same_storage(st) or rec.micro_batch != self.micro_batch:
            rec = self._produced_record(st, t.dtype, self.current_op(), None)
        return Packed(rec, t)

    def new_record(self, st: torch.UntypedStorage, dtype: torch.dtype, producer: Op,
                   consumer: Optional[Op] = None, register: bool = True,
                   account: bool = True, ptr: Optional[int] = None,
                   nbytes: Optional[int] = None) -> Record:
        """A record of ``st``, registered with the enforcer in one call (its reload order and
        ``consumer``, the operator saving it now, if any) or, not ``register``, when a move
        needs it (track); accounted on the device unless not ``account``. ``ptr`` and
        ``nbytes``: the storage's where the caller read them already."""
        self._seq += 1
        device = st.device
        rec = Record(self, st, st.data_ptr() if ptr is None else ptr,
                     st.nbytes() if nbytes is None else nbytes, device, dtype, producer,
                     self.micro_batch, self._seq)
        if consumer is not None:
            rec.consumers.append(consumer)
        ours = self._ours.get(device)
        if ours is None:
            ours = self._ours[device] = device.type == self.device_type
        if self.enforcer is not None and ours:
            if register:
                rec.enf = self.enforcer.register(
                    st, dtype, self.op_id(producer), self.micro_batch, rec.need_order(),
                    self.op_id(consumer) if consumer is not None else -1, ptr=rec.ptr,
                    nbytes=rec.nbytes)
            else:
                rec.lazy = True
                if self.enforcer.cuda:  # its first move is ordered after the producer's work
                    rec.stream = self.enforcer.current_stream()
        if account:
            rec._account(rec.nbytes)
        self.live[rec.ptr] = rec
        recs = self.by_mb.get(rec.micro_batch)
        if recs is None:
            recs = self.by_mb[rec.micro_batch] = set()
        recs.add(rec)
        self.counters["records"] += 1
        if self.capture:
            self.captured.append(rec)
        return rec

    def track(self, rec: Record, move: str = KEEP) -> Any:
        """Registers a record kept so far with the enforcer (its first move is coming): its
        reload order and every operator that saved it; returns the handle (0: another record
        tracks the storage). ``move`` OFFLOAD or FP8: carries that move out in the same call
        and returns the handle, None or why the move failed, and the FP8 copy's bytes (0 for
        an offload). The record's storage is still the one it was made with (only a record the
        enforcer tracks is ever dropped and regenerated), so its pointer and size are the
        record's."""
        ops = rec.consumers
        args = (rec.storage, rec.dtype, self.op_id(rec.producer), rec.micro_batch,
                rec.need_order(), self.op_id(ops[0]) if ops else -1)
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

    def op_id(self, op: Op) -> int:
        """The enforcer's number of ``op`` (stable for the life of the tracker)."""
        i = self.op_ids.get(op)
        if i is None:
            i = self.op_ids[op] = len(self.op_ids)
        return i

    def add_consumer(self, rec: Record, op: Op) -> None:
        """``op`` saved the record's storage."""
        rec.consumers.append(op)
        if rec.enf:
            self.enforcer.add_consumer(rec.enf, self.op_id(op))

    def _apply(self, rec: Record, strategy: str) -> None:
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

    # -- offloads in the plan's issue order -------------------------------------------------
    def place_planned(self, micro_batch: int, locate: Callable[[Record], Tuple[int, int]],
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
        for h in self.enforcer.take_offloaded():
            rec = self.planned.pop(h, None)
            if rec is not None and rec.planned and rec.storage is not None:
                rec.left_for_host()
                self.counters["scheduled_offloads"] += 1

    def retire(self, rec: Record) -> None:
        if self.live.get(rec.ptr) is rec:
            del self.live[rec.ptr]
        recs = self.by_mb.get(rec.micro_batch)
        if recs is not None:
            recs.discard(rec)

    def _light_set(self, unit: int, grain: int) -> LightSet:
        """The light set of ``unit``, made with blocks of ``grain`` bytes if it has none (a few small storages take blocks of four times min_move_bytes: a light
        capture's grain would inflate the peak by up to a grain per micro-batch)."""
        ls = self.light_sets.get(unit)
        if ls is None:
            ls = self.light_sets[unit] = LightSet(self.device_alloc, self.device_free, grain,
                                                  unit)
        return ls

    def begin_light(self, micro_batch: int) -> None:
        """Light capture for the forward of ``micro_batch`` (see __post_init__), after
        begin_forward (which dropped a set an earlier forward of the same id left)."""
        ls = self._light_set(micro_batch, self.light_grain)
        self.light = ls.sizes

    def drop_light(self, micro_batch: int) -> None:
        """Frees the light accounting of ``micro_batch`` (its backward ended, or its forward
        failed and no backward will come)."""
        ls = self.light_sets.pop(micro_batch, None)
        if ls is not None:
            ls.free()

    def end_light(self) -> None:
        """Back to records for the rest of the forward (the plan changed after the router)."""
        self.light = None

    def end_forward(self) -> None:
        """The forward ended: forgets its scopes and producers (their pointers may be
        reused); lets go of what finished copying."""
        if self.copying:
            self.poll_copies()
        self.scope.clear()
        self.capture = False
        self.producers.clear()
        self.external.clear()
        self.calls.clear()
        self.unkeyed.clear()
        self.light = None

    # -- reloads through the enforcer ------------------------------------------------------
    def begin_backward(self, micro_batch: int) -> None:
        """The enforcer starts reloading the micro-batch's offloaded records in the order the
        backward needs them (their need order); each acquire lets it issue the next."""
        if self.enforcer is None:
            return
        self.collect_offloaded()
        if self.reload_ahead:
            self._prefetch(micro_batch)

    def acquired(self, micro_batch: int) -> None:
        """A reload of ``micro_batch`` was consumed: the enforcer may issue the next one."""
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

    def enforcer_failed(self, what: str, error: Exception) -> None:
        """A move failed (e.g. the pinned pool is full): the activation stays on the device;
        said once, counted always."""
        if not self._enforcer_warned:
            log.warning("bagualu: %s failed, the activation stays on the device: %s", what,
                        error)
            self._enforcer_warned = True
        key = what.replace(" ", "_") + "_failures"
        self.counters[key] = self.counters.get(key, 0) + 1

    def end_backward(self, micro_batch: int) -> None:
        """Drops the light set of a micro-batch whose backward finished."""
        self.drop_light(micro_batch)

    def light_bytes(self, micro_batch: int, in_layer_only: bool = False) -> int:
        ls = self.light_sets.get(micro_batch)
        if ls is None:
            return 0
        if in_layer_only:
            return sum(n for ref, n in ls.sizes.values() if n > 0 and ref() is not None)
        return ls.used

    def release_all(self) -> None:
        """Gives every block back to the pool (uninstall, or after a failed iteration whose
        graphs may still be referenced); records keep their data but are no longer counted."""
        self.light = None
        for ls in self.light_sets.values():
            ls.free()
        self.light_sets.clear()
        for recs in list(self.by_mb.values()):
            for r in list(recs):
                r._unaccount()
        self.by_mb.clear()
        self.live.clear()
        self.producers.clear()
        self.external.clear()
        self.calls.clear()
        self.unkeyed.clear()
        self.copying.clear()  # each record waits for its copy when released

    # -- queries and pressure --------------------------------------------------------------
    def device_bytes(self, micro_batch: Optional[int] = None) -> int:
        if micro_batch is None:
            return (sum(r.pool_bytes for recs in self.by_mb.values() for r in recs)
                    + sum(ls.reserved for ls in self.light_sets.values()))
        ls = self.light_sets.get(micro_batch)
        return (sum(r.pool_bytes for r in self.by_mb.get(micro_batch, ()))
                + (ls.reserved if ls is not None else 0))

    def planned_bytes(self, micro_batch: Optional[int] = None) -> int:
        """In-layer device bytes the live micro-batches (or ``micro_batch``) hold once their
        plans are carried out: what Algorithm 1 counts as used. Planned offloads still waiting
        for their point's O chain are not counted (the plan moves them), nor are bytes outside
        the layers (set aside from the planned capacity at register)."""
        units = (self.by_mb if micro_batch is None
                 else {micro_batch: self.by_mb.get(micro_batch, ())})
        total = sum(r.pool_bytes for recs in units.values() for r in recs
                    if r.producer.layer >= 0 and not r.planned)
        for unit, ls in self.light_sets.items():
            if micro_batch is None or unit == micro_batch:
                total += sum(n for _, n in ls.sizes.values() if n > 0)
        return total

    def pending_bytes(self) -> int:
        """Device bytes of planned offloads still waiting for their point's O chain."""
        return sum(r.pool_bytes for r in self.planned.values() if r.planned)

    def offload_pending(self) -> int:
        """Carries out now the planned offloads still waiting for their O chain (counted as
        early offloads); returns the device bytes freed."""
        freed = 0
        for rec in sorted(self.planned.values(), key=lambda r: (-r.micro_batch, r.seq)):
            if rec.planned and rec.movable():
                issued = rec.issued  # its copy runs already: completing it is no early offload
                got = rec.offload()
                if got:
                    freed += got
                    if not issued:
                        self.counters["early_offloads"] += 1
        return freed

    def host_bytes(self, micro_batch: int) -> int:
        """Bytes of ``micro_batch``'s activations offloaded to the host (what reloading it
        brings back to the device)."""
        return sum(r.nbytes for r in self.by_mb.get(micro_batch, ()) if r.placement == HOST)

    def backward_bytes(self, micro_batch: int, ahead: int) -> int:
        """Device bytes the backward of ``micro_batch`` brings back at once beyond what it
        holds: its ``ahead`` + 1 largest offloaded (or FP8-stored) records, which come back a
        bounded number ahead of their consumers, and the dropped records of its largest
        recompute call, which one rerun regenerates together."""
        moved: List[int] = []
        calls: Dict[int, int] = {}
        for r in self.by_mb.get(micro_batch, ()):
            if r.placement == HOST:
                moved.append(r.nbytes)
            elif r.placement == FP8_PLACE:
                moved.append(max(r.nbytes - r.pool_bytes, 0))
            elif r.placement == DROPPED and r.regen is not None:
                calls[id(r.regen)] = calls.get(id(r.regen), 0) + r.nbytes
        moved.sort(reverse=True)
        return sum(moved[:ahead + 1]) + max(calls.values(), default=0)

    def evict(self, needed: int) -> int:
        """Pressure eviction (enforce/eviction.py) over the live records of every unit; nothing
        while reloading ahead (_prefetch)."""
        if self._reloading_ahead:
            return 0
        records = [r for recs in self.by_mb.values() for r in recs]
        return eviction.evict(records, needed, self.enforcer, self.counters, self.evict_fp8)


def param_storages(model: torch.nn.Module) -> Set[int]:
    """Storage pointers of the model's parameters and buffers (an FSDP2 shard's local
    storage): saved, but not activations. Parameters whose storage moves (FSDP2's unsharded
    ones) are recognised at pack time by type (discovery/sharding.py)."""
    return local_storage_ptrs(model)

