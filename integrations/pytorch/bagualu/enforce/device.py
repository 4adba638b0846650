"""The (simulated) device's activation memory as the runtime sees it: the pool of
libbgl_alloc.so's host backend on CPU (every saved storage kept on the device holds one of its
blocks, so capacity, peak and OOM are real), or a byte count on CUDA where libbgl_alloc.so (or
PyTorch's allocator) is the device's allocator; allocation retried after pressure eviction
under the bagualu policy; the peak; the figures a report carries.

Not thread-safe: the training thread (and the autograd thread while it waits in backward)."""
from __future__ import annotations

import pickle
from typing import Any, Callable, Dict, Optional

import torch

from .. import _active
from ..errors import OutOfMemoryError
from ..native.alloc import last_error
from .pool import DevicePool, retry_after_eviction

Evict = Callable[[int], int]  # bytes needed -> bytes freed


class DeviceMemory:
    """Activation memory of one device; ``evict`` frees bytes when an allocation fails (None:
    running out of memory is an error at once)."""

    def __init__(self, device: torch.device, pool: Optional[DevicePool],
                 evict: Optional[Evict]) -> None:
        self.device = device
        self.pool = pool            # None on CUDA: count only
        self.evict = evict
        self.oom_count = 0
        self.counted = 0            # bytes in use where the pool is not ours (CUDA)
        self.counted_peak = 0
        self._cuda_view: Optional[DevicePool] = None
        if pool is not None and evict is not None:
            pool.add_pressure_callback(evict)

    @property
    def pool_backed(self) -> bool:
        """Whether alloc() gives blocks of the pool (CPU), not just a count."""
        return self.pool is not None

    def alloc(self, nbytes: int) -> int:
        """A block of ``nbytes`` (1 where only counted); OutOfMemoryError once eviction cannot
        make room."""
        pool = self.pool
        if pool is None:
            self.counted += nbytes
            self.counted_peak = max(self.counted_peak, self.counted)
            return 1
        ptr = pool.raw_alloc(nbytes)  # pool.alloc, without its error
        if ptr:
            return ptr
        error = OutOfMemoryError(f"activation memory: {last_error(pool.lib)}")
        if self.evict is None:
            self.oom_count += 1
            raise error
        try:
            return retry_after_eviction(lambda: self.pool.alloc(nbytes), nbytes, self.evict,
                                        error)
        except OutOfMemoryError:
            self.oom_count += 1
            raise

    def free(self, block: int, nbytes: int) -> None:
        pool = self.pool
        if pool is None:
            self.counted -= nbytes
            return
        pool.raw_free(block, nbytes)

    def reset_peak(self) -> None:
        if self.pool is not None:
            self.pool.reset_peak()
        self.counted_peak = self.counted

    def peak(self) -> int:
        """The peak of activation bytes since reset_peak()."""
        if self.pool is not None:
            return int(self.pool.stats().get("allocated_bytes_peak", 0))
        return self.counted_peak

    def allocator(self) -> Optional[DevicePool]:
        """The pool whose figures describe this device: ours on CPU, libbgl_alloc.so's view
        of the CUDA device when it is PyTorch's allocator, else None."""
        if self.pool is not None:
            return self.pool
        if self.device.type != "cuda" or not _active.cuda_allocator_swapped:
            return None
        if self._cuda_view is None:
            self._cuda_view = DevicePool(0, device=self.device.index or 0, configure=False)
        return self._cuda_view

    def report_stats(self, tracked_bytes: int, pinned_in_use: int) -> Dict[str, Any]:
        """This process's AllocatorStats for a report: the pool's figures (the tracked
        activation bytes where PyTorch's allocator is not the pool), OOMs, pinned use."""
        st = self.pool.stats() if self.pool is not None else {}
        in_use = int(st.get("allocated_bytes_current", tracked_bytes))
        return {"allocated_bytes": in_use,
                "reserved_bytes": int(st.get("reserved_bytes_current", in_use)),
                "peak_allocated_bytes": int(st.get("allocated_bytes_peak",
                                                   max(self.counted_peak, in_use))),
                "fragmentation": float(st.get("fragmentation", 0.0)),
                "oom_count": self.oom_count,
                "host_used_bytes": int(pinned_in_use)}

    def dump_snapshot(self, path: str) -> None:
        """Writes the allocator's snapshot as the pickle pytorch.org/memory_viz opens."""
        pool = self.allocator()
        if pool is None:  # CUDA with PyTorch's own allocator (install came too late)
            torch.cuda.memory._dump_snapshot(path)
            return
        with open(path, "wb") as f:
            pickle.dump(pool.snapshot(), f)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
