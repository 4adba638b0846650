"""The simulated device's activation pool over libbgl_alloc.so (bgl/alloc.h), and the retry of a
failed allocation after pressure eviction.

On CPU every saved activation storage that stays "on the device" holds one block of the host
backend's pool, so the configured capacity, the peak and OOM behave as on a device of that
size. On CUDA the same library is PyTorch's allocator and the pool is only read (stats,
snapshot).
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, TypeVar

from ..errors import BagualuError, OutOfMemoryError
from ..native import ext
from ..native.alloc import PRESSURE_CFUNC, PressureFn, last_error, load, read_json

T = TypeVar("T")
EVICTION_ROUNDS = 12  # retries of a failed allocation, each after evicting twice as much


def retry_after_eviction(alloc: Callable[[], T], nbytes: int, evict: Callable[[int], int],
                         error: OutOfMemoryError) -> T:
    """``alloc()`` again after it failed with ``error``, each time after ``evict`` freed
    twice as much as the time before. The pool's own pressure call asks for the shortfall in
    bytes, but what it frees may lie in pages other blocks still use. Raises the last
    OutOfMemoryError once eviction frees nothing more."""
    for attempt in range(EVICTION_ROUNDS):
        if evict(nbytes << (attempt + 1)) == 0:
            break
        try:
            return alloc()
        except OutOfMemoryError as e:
            error = e
    raise error

class DevicePool:
    """Blocks of the simulated device, one per saved activation storage kept on it."""

    def __init__(self, capacity_bytes: int, device: int = 0, history: int = 0,
                 configure: bool = True) -> None:
        self.lib = load()
        self.device = device
        self.capacity_bytes = int(capacity_bytes)
        if configure:
            # The mapping page: 64 KiB, or less under a small capacity (at most 1/256 of it,
            # at least 4 KiB), so a capacity of a few pages does not run out of memory on page
            # fragmentation no device of that size would have (a GPU's 2 MiB page is well
            # under 1/1000 of its memory).
            page = 64 << 10
            while page > 4 << 10 and page * 256 > self.capacity_bytes:
                page //= 2
            self.capacity_bytes = (self.capacity_bytes + page - 1) // page * page
            conf = f"backend:host,capacity:{self.capacity_bytes},page_size:{page},log:false"
            if history:
                conf += f",history:{int(history)}"
            rc = self.lib.bgl_alloc_configure(conf.encode())
            if rc == 10:
                raise BagualuError(
                    "cannot reconfigure the host backend while activations of a previous "
                    "install are alive (free their graphs first)")
            if rc != 0:
                raise BagualuError(f"cannot configure the host backend ({conf}): "
                                   f"{last_error(self.lib)}")
        self._callbacks: List[Any] = []
        self._handles: List[int] = []
        # bgl_alloc and bgl_free of this device through the compiled binding (no ctypes): a
        # block per saved storage kept on the device. raw_alloc: nbytes -> pointer, 0 when
        # there is no room (bgl_alloc_last_error says why); raw_free: (pointer, nbytes).
        self.blocks = ext.load().Pool(self.lib._handle, device)
        self.raw_alloc = self.blocks.alloc
        self.raw_free = self.blocks.free

    def alloc(self, nbytes: int) -> int:
        """A block of ``nbytes``; raises OutOfMemoryError with the allocator's message."""
        ptr = self.raw_alloc(nbytes)
        if not ptr:
            raise OutOfMemoryError(f"activation memory: {last_error(self.lib)}")
        return ptr

    def free(self, ptr: int, nbytes: int) -> None:
        self.raw_free(ptr, nbytes)

    def stats(self) -> Dict[str, Any]:
        return read_json(lambda b, c, n: self.lib.bgl_alloc_stats_json(self.device, b, c, n),
                          self.lib)

    def snapshot(self) -> Dict[str, Any]:
        return read_json(self.lib.bgl_alloc_snapshot_json, self.lib)

    def reset_peak(self) -> None:
        self.lib.bgl_alloc_reset_peak_stats(self.device)

    def add_pressure_callback(self, fn: PressureFn) -> None:
        """fn(bytes_needed) -> bytes freed; called before an allocation would fail."""
        def trampoline(device: int, needed: int, user: Any) -> int:
            try:
                return int(fn(int(needed)))
            except Exception:  # never let an exception cross the C boundary
                return 0
        cb = PRESSURE_CFUNC(trampoline)
        handle = ctypes.c_int(0)
        rc = self.lib.bgl_alloc_add_pressure_callback(self.device, cb, None, ctypes.byref(handle))
        if rc != 0:
            raise BagualuError(f"pressure callback: {last_error(self.lib)}")
        self._callbacks.append(cb)
        self._handles.append(handle.value)

    def close(self) -> None:
        for h in self._handles:
            self.lib.bgl_alloc_remove_pressure_callback(self.device, h)
        self._handles.clear()
        self._callbacks.clear()
