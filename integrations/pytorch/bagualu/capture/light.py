"""Light capture: the storages one all-keep micro-batch saved, only counted, and accounted in
coarse blocks of the device memory (one allocator call per grain instead of two per storage);
and the kept storages of a micro-batch that moves others (``keep``), counted the same way but
given back as PyTorch lets go of each. Not thread-safe: the training thread (a kept storage's
death runs on the thread that dropped it last: autograd's, which is the training thread on CPU
and the one running the hooks on CUDA)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import weakref

import torch


class LightSet:
    """The storages one light micro-batch saved, accounted in blocks of the tracker's
    light_grain bytes (one allocator call per chunk instead of two per storage)."""

    __slots__ = ("alloc", "free_block", "grain", "micro_batch", "sizes", "used", "reserved",
                 "blocks", "kept", "freed")

    def __init__(self, alloc: Callable[[int], int], free: Callable[[int, int], None],
                 grain: int, micro_batch: int) -> None:
        self.alloc = alloc
        self.free_block = free
        self.grain = grain
        self.micro_batch = micro_batch
        self.sizes: Dict[int, Tuple[Any, int]] = {}  # storage ptr -> (weakref, nbytes)
        self.used = 0
        self.reserved = 0
        self.blocks: List[Tuple[int, int]] = []
        self.kept = 0  # bytes counted by keep() still alive
        self.freed = False

    def holds(self, key: int, storage: torch.UntypedStorage) -> bool:
        """Whether ``storage`` (at pointer ``key``) was counted here."""
        seen = self.sizes.get(key)
        return seen is not None and seen[0]() is storage

    def grow(self, nbytes: int) -> None:
        """Counts ``nbytes`` more; OutOfMemoryError (nothing counted) as for a record."""
        used = self.used + nbytes
        if used > self.reserved:
            size = max(used - self.reserved, self.grain)
            block = self.alloc(size)
            self.blocks.append((block, size))
            self.reserved += size
        self.used = used

    def forget(self, nbytes: int) -> None:
        """A counted storage died before backward (its blocks stay until the set is freed)."""
        self.used -= nbytes

    def keep(self, key: int, storage: torch.UntypedStorage, nbytes: int, in_layer: bool) -> None:
        """Counts a storage whose producer keeps it in a micro-batch that moves others (no
        record: nothing will move it); its bytes go back when the storage dies (autograd lets
        go of a saved tensor once its node ran), as a record's block does at its release."""
        self.grow(nbytes)
        self.sizes[key] = (weakref.ref(storage, lambda w, k=key: self._died(k, w)),
                           nbytes if in_layer else -nbytes)
        self.kept += nbytes

    def _died(self, key: int, ref: Any) -> None:
        seen = self.sizes.get(key)
        if self.freed or seen is None or seen[0] is not ref:
            return
        del self.sizes[key]
        n = abs(seen[1])
        self.used -= n
        self.kept -= n
        blocks = self.blocks  # the blocks no longer needed go back, last first
        while blocks and self.reserved - blocks[-1][1] >= self.used:
            block, size = blocks.pop()
            self.reserved -= size
            self.free_block(block, size)

    def free(self) -> None:
        for block, size in self.blocks:
            self.free_block(block, size)
        self.blocks.clear()
        self.reserved = 0
        self.freed = True
        self.kept = 0
