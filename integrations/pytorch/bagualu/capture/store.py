"""The records of the micro-batches in flight and the memory figures the planner reads: the live
records by storage pointer (a storage saved again finds its record) and by unit, the capture
micro-batch's records in the order they were made, each unit's light set (light capture and
small storages, capture/light.py), and what they hold on the device, on the host, once planned,
and at the start of a backward.

Not thread-safe: the training thread (and the autograd thread that runs unpack hooks while the
training thread waits in backward())."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set

from ..record import Record
from ..vocabulary import DROPPED, FP8_PLACE, HOST
from .light import LightSet


class RecordStore:
    """The live records and light sets of one tracker; ``alloc`` and ``free`` account light
    sets on the device memory, ``counters`` are the tracker's. The tracker hands ``live``,
    ``by_mb`` and ``light_sets`` to the compiled binding by name (csrc/hooks.cc adds records,
    csrc/packed.cc removes them): they are cleared, never replaced. Not thread-safe: the
    training thread (and autograd's while the training thread waits in backward())."""

    def __init__(self, alloc: Callable[[int], int], free: Callable[[int, int], None],
                 counters: Dict[str, int]) -> None:
        self.alloc = alloc
        self.free = free
        self.counters = counters
        self.live: Dict[int, Record] = {}          # storage ptr -> record (dedupe)
        self.by_mb: Dict[int, Set[Record]] = {}    # unit -> its live records
        self.captured: List[Record] = []           # filled while capture is on
        self.light_sets: Dict[int, LightSet] = {}  # unit -> its light set

    # -- records ----------------------------------------------------------------------------
    def add(self, rec: Record, capture: bool) -> None:
        """A new record, live until it retires (in ``captured`` too when ``capture``)."""
        self.live[rec.ptr] = rec
        recs = self.by_mb.get(rec.micro_batch)
        if recs is None:
            recs = self.by_mb[rec.micro_batch] = set()
        recs.add(rec)
        self.counters["records"] += 1
        if capture:
            self.captured.append(rec)

    def retire(self, rec: Record) -> None:
        """The record is released: no longer live."""
        if self.live.get(rec.ptr) is rec:
            del self.live[rec.ptr]
        recs = self.by_mb.get(rec.micro_batch)
        if recs is not None:
            recs.discard(rec)

    def records(self) -> List[Record]:
        """Every live record of every unit."""
        return [r for recs in self.by_mb.values() for r in recs]

    def take_captured(self, unit: int) -> List[Record]:
        """The capture's records of ``unit`` still live (what its backward will need: records
        released during the forward held memory only briefly), in the order they were made;
        the capture's list starts over."""
        live = self.by_mb.get(unit, set())
        recs = [r for r in self.captured if r in live]
        self.captured.clear()
        return recs

    # -- light sets -------------------------------------------------------------------------
    def light_set(self, unit: int, grain: int) -> LightSet:
        """The light set of ``unit``, made with blocks of ``grain`` bytes if it has none (a few
        small storages take blocks of four times min_move_bytes: a light capture's grain would
        inflate the peak by up to a grain per micro-batch)."""
        ls = self.light_sets.get(unit)
        if ls is None:
            ls = self.light_sets[unit] = LightSet(self.alloc, self.free, grain, unit)
        return ls

    def drop_light(self, unit: int) -> None:
        """Frees the light accounting of ``unit`` (its backward ended, or its forward failed
        and no backward will come)."""
        ls = self.light_sets.pop(unit, None)
        if ls is not None:
            ls.free()

    def light_bytes(self, micro_batch: int, in_layer_only: bool = False) -> int:
        """Bytes the light set of ``micro_batch`` counted (``in_layer_only``: of storages
        still alive and saved inside the layers only)."""
        ls = self.light_sets.get(micro_batch)
        if ls is None:
            return 0
        if in_layer_only:
            return sum(n for ref, n in ls.sizes.values() if n > 0 and ref() is not None)
        return ls.used

    def release_all(self) -> None:
        """Gives every block back to the pool (uninstall, or after a failed iteration whose
        graphs may still be referenced); records keep their data but are no longer counted."""
        for ls in self.light_sets.values():
            ls.free()
        self.light_sets.clear()
        for recs in list(self.by_mb.values()):
            for r in list(recs):
                r._unaccount()
        self.by_mb.clear()
        self.live.clear()

    # -- memory figures ---------------------------------------------------------------------
    def device_bytes(self, micro_batch: Optional[int] = None) -> int:
        """Device bytes the records and light sets of every unit (or ``micro_batch``) hold."""
        if micro_batch is None:
            return (sum(r.pool_bytes for recs in self.by_mb.values() for r in recs)
                    + sum(ls.reserved for ls in self.light_sets.values()))
        ls = self.light_sets.get(micro_batch)
        return (sum(r.pool_bytes for r in self.by_mb.get(micro_batch, ()))
                + (ls.reserved if ls is not None else 0))

    def layer_bytes(self, micro_batch: Optional[int] = None) -> int:
        """In-layer device bytes the live micro-batches (or ``micro_batch``) hold once their
        plans are carried out: what Algorithm 1 counts as used. Planned offloads still waiting
        for their point's O chain are not counted (the plan moves them), nor are bytes outside
        the layers (set aside from the planned capacity at register)."""
        units = (self.by_mb if micro_batch is None
                 else {micro_batch: self.by_mb.get(micro_batch, ())})
        # the cheap field first: a moved or dropped record holds no pool bytes (the planned
        # check asks the enforcer, in_layers reads the operators)
        total = sum(r.pool_bytes for recs in units.values() for r in recs
                    if r.pool_bytes and r.in_layers() and not r.planned)
        for unit, ls in self.light_sets.items():
            if micro_batch is None or unit == micro_batch:
                total += sum(n for _, n in ls.sizes.values() if n > 0)
        return total

    def host_bytes(self, micro_batch: int) -> int:
        """Bytes of ``micro_batch``'s activations offloaded to the host (what reloading it
        brings back to the device)."""
        return sum(r.nbytes for r in self.by_mb.get(micro_batch, ()) if r.placement == HOST)

    def reload_bytes(self, micro_batch: int, ahead: int) -> int:
        """Device bytes reloading ``micro_batch`` ahead brings back at once: its ``ahead`` + 1
        largest offloaded records (the enforcer's prefetch bound), those still waiting for
        their O chain included (layer_bytes counts them gone already)."""
        moved = sorted((r.nbytes for r in self.by_mb.get(micro_batch, ())
                        if r.placement == HOST or r.planned), reverse=True)
        return sum(moved[:ahead + 1])

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
