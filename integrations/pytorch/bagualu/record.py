"""One saved storage and where its data is: its record (on the simulated device, on the host, in FP8,
or dropped for recompute, with its producer and the operators that saved it) and what autograd
keeps for each saved tensor of it (``Packed``: the tensor itself while the data is on the device,
else the view to rebuild on whatever storage holds the data then).

Hook capture over many records is the tracker's (capture/tracker.py), which owns the records
through the ``Owner`` protocol below; when the data moves is the Mover's (enforce/mover.py), and
every move of the data goes through the enforcer (enforce/enforcer.py). A record's fields are the compiled binding's ``RecordBase`` (the pack hook
makes and fills records there without a Python frame) and ``Packed`` is the binding's; the moves
are here. Not thread-safe: records are used from the training thread, like autograd's hooks.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Protocol

import torch

from .enforce.enforcer import fp8_supported
from .enforce.mover import Mover
from .errors import BagualuError
from .native import ext
from .vocabulary import DROPPED, HOST, OFFLOAD, RECOMPUTE, Op


class Owner(Protocol):
    """What a record needs from the tracker that owns it (capture/tracker.py)."""

    enforcer: Any                      # enforce.enforcer.Enforcer
    mover: Mover                       # its planned and copying records, track, acquired
    store: Any                         # capture/store.py's RecordStore: retire(rec)
    counters: Dict[str, int]
    pool_backed: bool
    device_alloc: Callable[[int], int]
    device_free: Callable[[int, int], None]


_C = ext.load()


class Record(_C.RecordBase):
    """One saved storage of one micro-batch (its fields: the binding's RecordBase). Its
    ``placement`` is derived, never stored: on the device while the record holds its storage,
    else the enforcer's placement of its handle (the one state machine, TrackedTensor), else
    dropped while a rerun can make it. So are ``planned`` (its offload left to the plan's issue
    order, or issued) and ``issued`` (an offload moved the data to the host while the record
    still holds the device data the copy reads): the enforcer's strategy and moves of its
    handle (csrc/record.cc OffloadOf)."""

    __slots__ = ()

    def __init__(self, tracker: Owner, storage: torch.UntypedStorage, ptr: int, nbytes: int,
                 device: torch.device, dtype: torch.dtype, producer: Op, micro_batch: int,
                 seq: int) -> None:
        self.tracker = tracker
        self.ptr = ptr  # the storage's (the caller read them from it once)
        self.nbytes = nbytes
        self.dtype = dtype
        self.device = device
        self.producer = producer
        self.consumers: List[Op] = []
        self.micro_batch = micro_batch
        self.storage: Optional[torch.UntypedStorage] = storage
        self.ref: Any = None  # weakref to the original storage once the data left it
        self.pool_block = 0
        self.pool_bytes = 0
        self.refs = 0
        self.in_backward = False
        self.seq = seq
        self.packs: Optional[List[Any]] = None  # weakrefs to Packed holding the tensor
        self.enf = 0             # the enforcer's handle (0: not tracked there: never moved)
        self.enf_block = False   # the device data is an enforcer block (the pool counts it)
        self.live_block = False  # PyTorch holds a block the enforcer made for it
        self.released = False    # every holder is gone
        self.regen: Any = None   # the recompute.Call that regenerates it while dropped
        self.regenerating = False
        # Kept: registered with the enforcer only once something must move it (enf 0 till
        # then); set by the tracker where the enforcer could move it.
        self.lazy = False
        self.stream: Optional[int] = None  # a kept record's producing CUDA stream

    def same_storage(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` is this record's storage (the original, even after it moved)."""
        if self.storage is not None and self.ref is None:
            return self.storage is st
        return self.ref is not None and self.ref() is st

    def _leave_device(self) -> None:
        if self.ref is None and self.storage is not None:
            self.ref = weakref.ref(self.storage)
        for w in self.packs or ():
            p = w()
            if p is not None:
                p.detach_tensor()
        self.packs = None

    # -- accounting -------------------------------------------------------------------------
    def _account(self, nbytes: int) -> None:
        if self.pool_block or self.enf_block:
            self._unaccount()
        self.pool_block = self.tracker.device_alloc(nbytes)
        self.pool_bytes = nbytes

    def _unaccount(self) -> None:
        if self.enf_block:  # the enforcer frees it when PyTorch lets go of the storage
            self.pool_bytes, self.enf_block = 0, False
            return
        if self.pool_block:
            self.tracker.device_free(self.pool_block, self.pool_bytes)
            self.pool_block, self.pool_bytes = 0, 0

    def device_bytes(self) -> int:
        return self.pool_bytes

    def in_layers(self) -> bool:
        """Whether the planned layers account for this storage: made inside them and saved by
        one of their operators. The stage's output (the last layer's, saved only by the head)
        is outside, with the embedding's and the loss's: the planner's layer graph names a
        layer's output the next layer's block input, and the last one has no next layer."""
        if self.producer.layer < 0:
            return False
        consumers = self.consumers
        if not consumers:
            return True
        for c in consumers:  # a loop, not any() over a generator: called per record per point
            if c.layer >= 0:
                return True
        return False

    # -- moves (all through the enforcer; the record follows where the data went) -----------
    def movable(self) -> bool:
        """Whether the data is on the device, in a storage the enforcer tracks and may move.
        Not while the enforcer's recompute callback regenerates it: the record has its data
        but the enforcer has it dropped until the callback returns (pressure eviction inside
        the rerun must not pick it)."""
        return (self.storage is not None
                and (self.enf != 0 or self.lazy) and not self.regenerating)

    def tracked(self) -> int:
        """The enforcer's handle, registering a kept record first (0: another record tracks
        its storage already, so it stays where it is)."""
        if self.lazy:
            self.lazy = False
            self.enf = self.tracker.mover.track(self)
        return self.enf

    def offload(self) -> int:
        """Copies the storage to the enforcer's pinned pool and lets the device copy go; bytes
        freed."""
        if not self.movable():
            return 0  # e.g. CPU scalars saved by a CUDA forward are not device memory
        t = self.tracker
        try:
            if not self.tracked():
                return 0
            if not (self.issued and t.enforcer.offloaded(self.enf)):
                t.enforcer.offload(self.enf)  # in need order (given at registration)
        except BagualuError as e:  # e.g. the pinned pool is full: the data stays
            t.mover.enforcer_failed("offload", e)
            return 0
        return self.left_for_host()

    def offload_behind(self) -> bool:
        """Issues the offload without waiting for its copy (the host backend's copy threads
        overlap compute): the device data stays, the copy reading it, until the Mover sees
        the copy done (Mover.poll_copies: left_for_host); whether it was issued. Issued, the
        record is planned and issued (the enforcer's state: offload() completes it)."""
        if not self.movable():
            return False
        t = self.tracker
        try:
            if not self.tracked():
                return False
            t.enforcer.offload(self.enf, wait=False)
        except BagualuError as e:
            t.mover.enforcer_failed("offload", e)
            return False
        t.mover.planned[self.enf] = self
        t.mover.copying.append(self)
        return True

    def plan_offload(self) -> None:
        """The offload is left to the plan's issue order: the stream scheduler issues it when
        compute reaches its round (left_for_host follows); planned from now on (the
        enforcer's strategy)."""
        self.tracker.enforcer.set_strategy(self.enf, OFFLOAD)

    def left_for_host(self) -> int:
        """The enforcer holds the data in its pinned pool now: let the device copy go; bytes
        freed."""
        t = self.tracker
        t.mover.planned.pop(self.enf, None)  # a planned one: carried out (no longer planned)
        self._leave_device()
        self.storage = None  # the enforcer's placement (host) is the record's now
        freed = self.pool_bytes
        self._unaccount()
        t.counters["offloads"] += 1
        t.counters["bytes_d2h"] += self.nbytes
        return freed

    def drop(self, call: Any, key: Any) -> int:
        """Lets the data go; ``call`` regenerates it at ``key`` when it is needed; bytes freed."""
        if self.storage is None:
            return 0
        if self.tracked():
            try:
                self.tracker.enforcer.set_strategy(self.enf, RECOMPUTE)
                self.tracker.enforcer.drop(self.enf, self._regenerate)
            except BagualuError as e:
                self.tracker.mover.enforcer_failed("drop", e)
                return 0
        self._leave_device()
        self.storage = None
        self.regen = call  # dropped: the enforcer's placement, or (untracked) the rerun held
        call.add(key, self)
        freed = self.pool_bytes
        self._unaccount()
        self.tracker.counters["drops"] += 1
        return freed

    def store_fp8(self) -> int:
        """Has the enforcer replace the storage by an e4m3 copy with per-block scales; bytes
        freed."""
        if not self.movable() or not fp8_supported(self.dtype):
            return 0
        t = self.tracker
        try:
            if not self.tracked():
                return 0
            fp8_bytes = t.enforcer.store_fp8(self.enf)
        except BagualuError as e:
            t.mover.enforcer_failed("fp8 cast", e)
            return 0
        return self.stored_fp8(fp8_bytes)

    def stored_fp8(self, fp8_bytes: int) -> int:
        """The enforcer holds the data as an FP8 copy of ``fp8_bytes`` now: let the device copy
        go; bytes freed."""
        self._leave_device()
        before = self.pool_bytes
        self._enforcer_bytes(fp8_bytes)
        self.storage = None
        self.tracker.counters["fp8_casts"] += 1
        return max(before - self.pool_bytes, 0)

    def _enforcer_bytes(self, nbytes: int) -> None:
        """The device data is now ``nbytes`` the enforcer allocated: in the pool already (the
        simulated device), else counted here."""
        if self.tracker.pool_backed:
            self._unaccount()
            self.pool_bytes, self.enf_block = nbytes, True
        else:
            self._account(nbytes)

    def materialize(self) -> torch.UntypedStorage:
        """The storage with full-precision data on the device: the enforcer reloads it,
        uncasts it or has it recomputed."""
        if self.storage is not None:
            return self.storage
        t = self.tracker
        if self.placement == DROPPED:
            if self.enf:
                t.enforcer.recompute(self.enf)  # calls back into _regenerate
            else:
                self.regen.regenerate()
            return self.storage
        placement = self.placement
        self.storage = t.enforcer.acquire(self.enf, self.nbytes, self)  # its end: the binding's
        self.live_block = True
        self._enforcer_bytes(self.nbytes)
        if placement == HOST:
            t.mover.acquired(self.micro_batch)
            t.counters["reloads"] += 1
            t.counters["bytes_h2d"] += self.nbytes
        else:
            t.counters["fp8_uncasts"] += 1
        return self.storage

    def _regenerate(self) -> int:
        """The enforcer needs the dropped data: rerun the producing call (which fills this
        record and the call's other dropped ones); returns the data pointer."""
        if self.storage is None:
            self.regenerating = True
            try:
                self.regen.regenerate()
            finally:
                self.regenerating = False
        if self.storage is None:
            raise BagualuError(f"recompute of {self.producer.qualname}: the rerun did not "
                               "regenerate this storage")
        return self.storage.data_ptr()

    def _retire(self) -> None:
        if self.enf:
            self.tracker.enforcer.retire(self.enf)
            self.enf = 0

    def regenerated(self, st: torch.UntypedStorage) -> None:
        """The rerun of the producing call made the data again (``st``)."""
        if st.nbytes() != self.nbytes:
            raise BagualuError(
                f"recompute of {self.regen.op.qualname}: the rerun made {st.nbytes()} bytes "
                f"where the forward saved {self.nbytes}; keep this operator")
        self._account(self.nbytes)
        self.storage, self.regen = st, None
        self.tracker.counters["recomputes"] += 1  # by the backward's need or the R chain
        if self.enf and not self.regenerating:
            # Made by the rerun of another record of the call: the enforcer takes it back too.
            self.tracker.enforcer.recompute(self.enf)

    def release(self) -> None:
        """Every holder is gone: the storage is no longer an activation."""
        if self.issued and self.storage is not None:  # its copy may still read the storage
            self.tracker.enforcer.wait_until_copied(self.enf)
            self.left_for_host()  # the offload it was, counted
        self._unaccount()
        if self.enf:  # a planned offload not carried out: not planned once the storage goes
            self.tracker.mover.planned.pop(self.enf, None)
        self.storage = self.regen = None
        self.packs = None
        self.released = True
        if not self.live_block:  # else once PyTorch lets go of the enforcer's block
            self._retire()
        self.tracker.store.retire(self)


class _Plain:
    """A tensor a recompute call holds that is not an activation (a parameter, an empty
    tensor)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def unpack(self) -> torch.Tensor:
        return self.t


# What autograd keeps for one saved tensor: its record, and either the tensor itself (while the
# record's data is on the device: the fast path) or how to rebuild the view; Packed(rec, t),
# .unpack(), .detach_tensor() (the data leaves the device); its death releases the record when it
# was the last holder (Record.release).
Packed = _C.Packed
