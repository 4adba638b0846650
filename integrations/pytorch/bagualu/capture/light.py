"""Light capture: the storages one all-keep micro-batch saved, only counted, and accounted in
coarse blocks of the device memory (one allocator call per grain instead of two per storage).
Not thread-safe: the training thread."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

from ..native import ext

_C = ext.load()


class LightSet:
    """The storages one light micro-batch saved, accounted in blocks of the tracker's
    light_grain bytes (one allocator call per chunk instead of two per storage). Not
    thread-safe: the training thread."""

    __slots__ = ("alloc", "free_block", "grain", "micro_batch", "sizes", "used", "reserved", "blocks")

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

    def count(self, storage: torch.UntypedStorage, key: int, nbytes: int, inside: bool) -> None:
        """Counts ``storage`` (``nbytes`` at pointer ``key``), saved inside the layers or not
        (``inside``: ``sizes`` holds ``-nbytes`` then); a dead storage counted at the same
        pointer is forgotten first. OutOfMemoryError as grow's. The binding's ``light_count``
        is this method's one definition: the pack hook counts small storages through it with
        no Python frame."""
        _C.light_count(self, storage, key, nbytes, inside)

    def forget(self, nbytes: int) -> None:
        """A counted storage died before backward (its blocks stay until the set is freed)."""
        self.used -= nbytes

    def free(self) -> None:
        for block, size in self.blocks:
            self.free_block(block, size)
        self.blocks.clear()
        self.reserved = 0
