"""Where one saved storage lives: its record (on the simulated device, on the host, in FP8,
or dropped for recompute, with its producer and the operators that saved it) and what autograd
keeps for each saved tensor of it (``Packed``: the tensor itself while the data is on the device,
else the view to rebuild on whatever storage holds the data then).

Hook capture, accounting and pressure eviction over many records are the tracker's
(tracker.py). Not thread-safe: records are used from the training thread, like autograd's
hooks.
"""
from __future__ import annotations

import weakref
from typing import Any, List, Optional, Tuple

import torch

from . import fp8 as fp8mod
from .errors import BagualuError
from .strategy import Op

DEVICE, HOST, FP8_PLACE, DROPPED = "device", "host", "fp8", "dropped"


class Record:
    """One saved storage of one micro-batch."""

    __slots__ = ("key", "nbytes", "dtype", "device", "producer", "consumers", "micro_batch",
                 "placement", "storage", "host", "fp8", "block", "block_bytes", "refs",
                 "pinned", "in_backward", "tracker", "ref", "seq", "packs", "enf", "enf_block",
                 "regen", "__weakref__")

    def __init__(self, tracker: "Tracker", storage: torch.UntypedStorage, dtype: torch.dtype,
                 producer: Op, micro_batch: int, seq: int) -> None:
        self.tracker = tracker
        self.key = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.dtype = dtype
        self.device = storage.device
        self.producer = producer
        self.consumers: List[Op] = []
        self.micro_batch = micro_batch
        self.placement = DEVICE
        self.storage: Optional[torch.UntypedStorage] = storage
        self.ref: Any = None  # weakref to the original storage once the data left it
        self.host: Optional[torch.Tensor] = None
        self.fp8: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None
        self.block = 0
        self.block_bytes = 0
        self.refs = 0
        self.pinned = False
        self.in_backward = False
        self.seq = seq
        self.packs: Optional[List[Any]] = None  # weakrefs to Packed holding the tensor
        self.enf = 0             # enforcer handle while the data is in its pinned pool
        self.enf_block = False   # the device data is an enforcer block (the pool counts it)
        self.regen: Any = None   # the recompute.Call that regenerates it while dropped

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
        self._unaccount()
        self.block = self.tracker.device_alloc(nbytes)
        self.block_bytes = nbytes

    def _unaccount(self) -> None:
        if self.enf_block:  # the enforcer frees it when PyTorch lets go of the storage
            self.block_bytes, self.enf_block = 0, False
            return
        if self.block:
            self.tracker.device_free(self.block, self.block_bytes)
            self.block, self.block_bytes = 0, 0

    def device_bytes(self) -> int:
        return self.block_bytes

    # -- moves ------------------------------------------------------------------------------
    def offload(self) -> int:
        """Copies the storage to host memory and lets the device copy go; bytes freed."""
        if self.placement != DEVICE or self.pinned or self.storage is None \
                or self.device.type != self.tracker.device_type:
            return 0  # CPU scalars saved by a CUDA forward are not device memory
        t = self.tracker
        if t.enforcer is not None:
            return self._offload_through_enforcer()
        self._leave_device()
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(self.storage)
        host = torch.empty(self.nbytes, dtype=torch.uint8, device="cpu",
                           pin_memory=t.pin_memory)
        t.copy_to_host(host, src)
        self.host = host
        return self._left_for_host()

    def _offload_through_enforcer(self) -> int:
        t = self.tracker
        try:
            self.enf = t.enforcer.offload(self.storage.data_ptr(), self.nbytes, self.micro_batch)
        except BagualuError as e:  # e.g. the pinned pool is full: the data stays
            t.enforcer_failed(e)
            return 0
        self._leave_device()
        return self._left_for_host()

    def _left_for_host(self) -> int:
        """The data is on the host now: drop the device storage; bytes freed."""
        t = self.tracker
        self.storage = None
        self.placement = HOST
        freed = self.block_bytes
        self._unaccount()
        t.counters["offloads"] += 1
        t.counters["bytes_d2h"] += self.nbytes
        return freed

    def drop(self, call: Any, key: Any) -> int:
        """Lets the data go; ``call`` regenerates it at ``key`` when it is needed; bytes freed."""
        if self.placement != DEVICE or self.pinned or self.storage is None:
            return 0
        self._leave_device()
        self.storage = None
        self.placement = DROPPED
        self.regen = call
        call.add(key, self)
        freed = self.block_bytes
        self._unaccount()
        self.tracker.counters["drops"] += 1
        return freed

    def store_fp8(self) -> int:
        """Replaces the storage by an e4m3 copy with per-block scales; bytes freed."""
        if (self.placement != DEVICE or self.pinned or self.storage is None
                or not fp8mod.supported(self.dtype)
                or self.device.type != self.tracker.device_type):
            return 0
        t = self.tracker
        self._leave_device()
        numel = self.nbytes // torch.empty(0, dtype=self.dtype).element_size()
        flat = torch.empty(0, dtype=self.dtype, device=self.device).set_(
            self.storage, 0, (numel,), (1,))
        data, scales = fp8mod.quantize(flat, t.fp8_block)
        before = self.block_bytes
        self._account(fp8mod.nbytes(numel, t.fp8_block))
        self.fp8 = (data, scales, numel)
        self.storage = None
        self.placement = FP8_PLACE
        t.counters["fp8_casts"] += 1
        return max(before - self.block_bytes, 0)

    def materialize(self) -> torch.UntypedStorage:
        """The storage with full-precision data on the device, reloading or uncasting it."""
        if self.storage is not None:
            return self.storage
        t = self.tracker
        if self.placement == HOST and self.enf:
            handle = self.enf
            self.storage = t.enforcer.acquire(handle, self.nbytes)
            self.enf = 0
            t.acquired(self.micro_batch, handle)
            if t.pool_backed:  # the reload is a block of the pool already
                self._unaccount()
                self.block_bytes, self.enf_block = self.nbytes, True
            else:
                self._account(self.nbytes)
            t.counters["reloads"] += 1
            t.counters["bytes_h2d"] += self.nbytes
        elif self.placement == HOST:
            self._account(self.nbytes)
            dst = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            t.copy_to_device(dst, self.host)
            self.storage = dst.untyped_storage()
            self.host = None
            t.counters["reloads"] += 1
            t.counters["bytes_h2d"] += self.nbytes
        elif self.placement == DROPPED:
            self.regen.regenerate()  # fills this record and the call's other dropped ones
            t.counters["recomputes"] += 1
            return self.storage
        elif self.placement == FP8_PLACE:
            data, scales, numel = self.fp8
            flat = fp8mod.dequantize(data, scales, numel, self.dtype, t.fp8_block)
            self._account(self.nbytes)
            self.storage = flat.untyped_storage()
            self.fp8 = None
            t.counters["fp8_uncasts"] += 1
        self.placement = DEVICE
        return self.storage

    def regenerated(self, st: torch.UntypedStorage) -> None:
        """The rerun of the producing call made the data again (``st``)."""
        if st.nbytes() != self.nbytes:
            raise BagualuError(
                f"recompute of {self.regen.op.qualname}: the rerun made {st.nbytes()} bytes "
                f"where the forward saved {self.nbytes}; keep this operator")
        self._account(self.nbytes)
        self.storage, self.regen, self.placement = st, None, DEVICE

    def release(self) -> None:
        """Every holder is gone: the storage is no longer an activation."""
        self._unaccount()
        if self.enf:  # offloaded and never needed again: free the pinned copy
            self.tracker.enforcer.release(self.enf)
            self.enf = 0
        self.storage = self.host = self.fp8 = self.regen = None
        self.packs = None
        self.tracker.retire(self)


class _Plain:
    """A tensor a recompute call holds that is not an activation (a parameter, an empty
    tensor)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def unpack(self) -> torch.Tensor:
        return self.t


class Packed:
    """What autograd keeps for one saved tensor: its record, and either the tensor itself
    (while the record's data is on the device: the fast path) or the view to rebuild."""

    __slots__ = ("rec", "t", "meta", "__weakref__")

    def __init__(self, rec: Record, t: torch.Tensor) -> None:
        self.rec = rec
        rec.refs += 1
        if rec.placement == DEVICE and rec.storage is not None:
            self.t: Optional[torch.Tensor] = t
            self.meta: Optional[Tuple[Any, ...]] = None
            if rec.packs is None:
                rec.packs = [weakref.ref(self)]
            else:
                rec.packs.append(weakref.ref(self))
        else:
            self.t = None
            self.meta = _view_meta(t)

    def detach_tensor(self) -> None:
        """The record's data leaves the device: keep only how to rebuild the view."""
        if self.t is not None:
            self.meta = _view_meta(self.t)
            self.t = None

    def unpack(self) -> torch.Tensor:
        rec = self.rec
        rec.in_backward = True
        if self.t is not None:
            return self.t
        storage = rec.materialize()
        dtype, offset, size, stride = self.meta
        return torch.empty(0, dtype=dtype, device=rec.device).set_(storage, offset, size, stride)

    def __del__(self) -> None:
        rec = self.rec
        rec.refs -= 1
        if rec.refs == 0:
            rec.release()


def _view_meta(t: torch.Tensor) -> Tuple[Any, ...]:
    return (t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))
