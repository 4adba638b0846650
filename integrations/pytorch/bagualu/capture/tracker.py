"""The saved-tensor hooks over the micro-batches in flight, and what they admit: the object the
compiled binding's Hooks (csrc/hooks.cc: pack, unpack, note_output) and every record are built
over. The binding's pack makes and finds the records of plain tensors whose producers keep them
or move them at once; the branches it leaves to Python are here (``_pack_py``): light capture (an
all-keep micro-batch's storages only counted), small storages (counted as light capture counts:
they never move), parameters and tensor subclasses, the capture micro-batch, and new records
whose strategy is not carried out at once.

The pack hook of torch.autograd.graph.saved_tensors_hooks receives only a tensor; the operator
that saves it is the innermost operator scope (pushed by capture/calls.py; the scopes and
producers are capture/scope.py's). Tensors are deduplicated by storage: a view of a larger
storage shares its base's record, and the unpack hook rebuilds the view (offset, sizes, strides)
on whatever storage holds the data then. The records and the memory figures are
capture/store.py's; when their data moves, enforce/mover.py's.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch

from ..discovery.sharding import is_parameter, local_storage_ptrs
from ..enforce.device import DeviceMemory
from ..enforce.enforcer import Enforcer, fp8_supported
from ..enforce.mover import Mover
from ..enforce.order import PointIssuer
from ..native import ext
from ..record import Packed, Record, _Plain
from ..vocabulary import FP8, KEEP, OFFLOAD, OUTSIDE, RECOMPUTE, Op
from .scope import ForwardScope
from .store import RecordStore

StrategyFn = Callable[[Op, int], str]


class Tracker:
    """The saved-tensor hooks of one runtime and the records of its micro-batches in flight
    (module docstring). Collaborators are given at construction; the model's facts
    (``set_model``) at instrument, the issuer (``set_issuer``) once plans carry an issue order.
    Not thread-safe: the training thread (and autograd's, which runs unpack hooks while the
    training thread waits in backward())."""

    def __init__(self, memory: DeviceMemory, enforcer: Optional[Enforcer],
                 strategy_of: StrategyFn, fp8_block: int = 128, light_grain: int = 0,
                 evict_fp8: bool = False, min_move_bytes: int = 0) -> None:
        self.memory = memory
        self.device_alloc: Callable[[int], int] = memory.alloc
        self.device_free: Callable[[int, int], None] = memory.free
        self.pool_backed = memory.pool_backed  # device_alloc gives pool blocks (CPU)
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
        self.counters: Dict[str, int] = {
            "offloads": 0, "reloads": 0, "bytes_d2h": 0, "bytes_h2d": 0, "fp8_casts": 0,
            "fp8_uncasts": 0, "evictions": 0, "evicted_bytes": 0, "records": 0, "drops": 0,
            "recomputes": 0, "scheduled_offloads": 0, "fp8_evictions": 0, "early_offloads": 0,
            "small_kept": 0}
        # Set by set_model at instrument: storages of parameters and buffers (never
        # activations). A storage follows the strategy of the operator that produced it.
        self.param_keys: Set[int] = set()
        self.micro_batch = -1     # the unit whose forward runs (or ran last)
        self.capture = False      # that forward is the capture micro-batch
        # Light capture: a micro-batch whose strategies are all keep needs no records. Saved
        # storages are only counted (the light set's sizes: storage ptr -> (weakref, nbytes),
        # nbytes negative once a consumer outside the layers saved it) and accounted in coarse
        # blocks freed when its backward ends. The weakref tells a storage from a dead one
        # whose pointer was reused (a graph piece dropped during the forward).
        self.light: Optional[Dict[int, Tuple[Any, int]]] = None  # the current forward's
        self.packs_seen = 0       # pack calls outside light capture (recompute calls count)
        self._seq = 0             # records made (their order: the need order's)
        self.issuer: Optional[PointIssuer] = None
        self.operators = ForwardScope()
        self.store = RecordStore(memory.alloc, memory.free, self.counters)
        self.mover = Mover(enforcer, self.counters, self.store.records, evict_fp8)
        # The names the binding reads and calls on this object (csrc/hooks.cc, packed.cc), each
        # the part's own container or method (never a copy: they are cleared, not replaced).
        ops, store, mover = self.operators, self.store, self.mover
        self.scope, self.producers, self.calls = ops.ops, ops.producers, ops.calls
        self.live, self.by_mb, self.light_sets = store.live, store.by_mb, store.light_sets
        self.scheduled, self.op_ids, self.unkeyed = mover.scheduled, mover.op_ids, mover.unkeyed
        self.sync_offloads, self.reload_ahead = mover.sync_offloads, mover.reload_ahead
        self.add_consumer = mover.add_consumer
        self._move_outcome = mover.move_outcome
        self.acquired = mover.acquired
        self.layer_bytes = store.layer_bytes  # (what timeline.py samples)
        # The saved-tensor hooks: the binding's pack makes and finds the records of plain
        # tensors whose producers keep them or move them at once (offload, FP8), its unpack
        # reloads and uncasts, its Packed releases (no Python frame); every other branch is
        # _pack_py's and record.py's.
        pool = memory.pool.blocks if memory.pool is not None else None
        self.hooks = ext.load().Hooks(
            self, Record, {"keep": KEEP, "offload": OFFLOAD, "fp8": FP8, "outside": OUTSIDE},
            pool)
        self.pack: Callable[[torch.Tensor], Any] = self.hooks.pack
        self.unpack: Callable[[Any], torch.Tensor] = self.hooks.unpack
        self._note_output = self.hooks.note_output

    def set_model(self, param_keys: Set[int]) -> None:
        """The instrumented model's parameter and buffer storages (the set itself changes in
        place after: loops/torchtitan.py adds FSDP2 units' gathered ones while they run)."""
        self.param_keys = set(param_keys)

    def set_issuer(self, issuer: Optional[PointIssuer]) -> None:
        """The stream scheduler's driver once plans carry an issue order."""
        self.issuer = issuer

    # -- a forward --------------------------------------------------------------------------
    def begin_forward(self, unit: int, capture: bool) -> None:
        """The forward of ``unit`` starts (the capture micro-batch when ``capture``)."""
        self.micro_batch = unit
        self.capture = capture
        self.store.drop_light(unit)  # a set left by an earlier forward whose backward never ran

    def begin_light(self, micro_batch: int) -> None:
        """Light capture for the forward of ``micro_batch`` (see __init__), after
        begin_forward (which dropped a set an earlier forward of the same id left)."""
        self.light = self.store.light_set(micro_batch, self.light_grain).sizes

    def end_light(self) -> None:
        """Back to records for the rest of the forward (the plan changed after the router)."""
        self.light = None

    def drop_light(self, micro_batch: int) -> None:
        """Frees the light accounting of ``micro_batch`` (its forward failed: no backward will
        come)."""
        self.store.drop_light(micro_batch)

    def note_output(self, out: Any, op: Op, overwrite: bool = True, call: Any = None) -> None:
        """Records ``op`` (and its recompute call, if any) as the producer of every tensor in
        ``out`` (tensors, tuples, lists, dict values) unless one is known and ``overwrite`` is
        False: ``producers`` maps a storage's pointer to (weakref, op, call). The binding's."""
        self._note_output(out, op, overwrite, call)

    def note_external(self, t: torch.Tensor) -> None:
        """``t`` enters a layer from outside (light capture counts it outside the layers)."""
        self.operators.note_external(t)

    def end_forward(self) -> None:
        """The forward ended: forgets its scopes and producers (their pointers may be
        reused); lets go of what finished copying."""
        self.mover.forward_ended()
        self.operators.clear()
        self.capture = False
        self.light = None

    # -- a backward -------------------------------------------------------------------------
    def begin_backward(self, micro_batch: int) -> None:
        """The backward of ``micro_batch`` starts: its offloaded records come back in need
        order (enforce/mover.py)."""
        self.mover.begin_backward(micro_batch)

    def end_backward(self, micro_batch: int) -> None:
        """Drops the light set of a micro-batch whose backward finished."""
        self.store.drop_light(micro_batch)

    def release_all(self) -> None:
        """Gives every block back to the pool (uninstall, or after a failed iteration whose
        graphs may still be referenced); records keep their data but are no longer counted."""
        self.light = None
        self.store.release_all()
        self.operators.clear()
        self.mover.release_all()

    # -- the pack's branches in Python ------------------------------------------------------
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
                self.light_sets[self.micro_batch].count(
                    st, key, st.nbytes(), self.operators.inside_layers(key, st))
            elif seen[1] > 0:
                scope = self.scope
                if not scope or scope[-1].layer < 0:
                    light[key] = (seen[0], -seen[1])
            return t
        self.packs_seen += 1  # recompute calls find their saved tensors by this count
        found = self._activation(t)
        if found is None:
            return t
        st, key = found
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
            self.mover.drop_found(rec, self.packs_seen - 1)
        if op not in rec.consumers:
            self.add_consumer(rec, op)
        return Packed(rec, t)

    def _activation(self, t: torch.Tensor) -> Optional[Tuple[torch.UntypedStorage, int]]:
        """The storage of ``t`` and its pointer when ``t`` is an activation of the forward
        running now: not empty, sparse or storage-less (a wrapper subclass such as
        AsyncCollectiveTensor), no parameter or buffer (by type, or its storage); else None
        (it stays as it is)."""
        if self.micro_batch < 0 or t.numel() == 0 or t.is_sparse or is_parameter(t):
            return None
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except RuntimeError:  # a wrapper subclass without storage
            return None
        return None if key in self.param_keys else (st, key)

    def hold(self, t: torch.Tensor) -> Any:
        """A handle that keeps ``t`` for a recompute call: through its record (which follows
        its producer's strategy) when it is an activation, else the tensor itself. A storage
        made inside a call still running is not being packed, so that call's rerun cannot
        find it: it stays on the device."""
        found = self._activation(t)
        if found is None:
            return _Plain(t)
        st, key = found
        ls = self.light_sets.get(self.micro_batch)
        if ls is not None and ls.holds(key, st):
            return _Plain(t)  # counted in the light set: it stays on the device
        rec = self.live.get(key)
        if rec is None or not rec.same_storage(st) or rec.micro_batch != self.micro_batch:
            rec = self._produced_record(st, t.dtype, self.operators.current_op(), None)
        return Packed(rec, t)

    def _produced_record(self, st: torch.UntypedStorage, dtype: torch.dtype, op: Op,
                         pack_index: Optional[int], consumer: Optional[Op] = None,
                         key: Optional[int] = None) -> Optional[Record]:
        """A new record under producer strategies: its producer's strategy applies once (the
        Mover's on_saved). A recompute producer's call drops it if its rerun can find it again:
        by ``pack_index`` (the pack being made now) while the call runs, by its outputs after.
        ``consumer``: the operator saving it now (registered with it). A kept record meets the
        enforcer only if something must move it later (pressure eviction); an offload the
        training thread carries out at once on the host backend's synchronous copies is never
        accounted on the device (its copy is complete when the pack returns).

        With ``key`` (a pack at that storage pointer), outside the capture, a storage of at
        most min_move_bytes whose producer does not recompute it gets no record (None): moving
        it would cost the enforcer's calls for next to no bytes, so it stays and is counted as
        light capture counts, in the micro-batch's light set until its backward ends (a
        recompute producer's call drops and regenerates its storages through records)."""
        producer, call = self.operators.producer_call(st, op)
        s = self.strategy_of(producer, self.micro_batch)
        n = st.nbytes()
        if key is not None and s != RECOMPUTE and not self.capture:
            if n <= self.min_move_bytes:
                grain = min(self.light_grain, 4 * self.min_move_bytes)
                self.store.light_set(self.micro_batch, grain).count(
                    st, key, n, self.operators.inside_layers(key, st))
                self.counters["small_kept"] += 1
                return None
        at_once = self.mover.sync_offloads and (
            (s == OFFLOAD and self.micro_batch not in self.scheduled)
            or (s == FP8 and fp8_supported(dtype)))
        rec = self.new_record(st, dtype, producer, consumer,
                              register=s != KEEP and not at_once, account=not at_once,
                              ptr=key, nbytes=n)
        if s != KEEP:
            self.mover.on_saved(rec, s, at_once, call, pack_index)
        return rec

    def new_record(self, st: torch.UntypedStorage, dtype: torch.dtype, producer: Op,
                   consumer: Optional[Op] = None, register: bool = True,
                   account: bool = True, ptr: Optional[int] = None,
                   nbytes: Optional[int] = None) -> Record:
        """A record of ``st``, registered with the enforcer in one call (its reload order and
        ``consumer``, the operator saving it now, if any) or, not ``register``, when a move
        needs it (Mover.track); accounted on the device unless not ``account``. ``ptr`` and
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
            self.mover.register(rec, st, consumer, register)
        if account:
            rec._account(rec.nbytes)
        self.store.add(rec, self.capture)
        return rec


def param_storages(model: torch.nn.Module) -> Set[int]:
    """Storage pointers of the model's parameters and buffers (an FSDP2 shard's local
    storage): saved, but not activations. Parameters whose storage moves (FSDP2's unsharded
    ones) are recognised at pack time by type (discovery/sharding.py)."""
    return local_storage_ptrs(model)
