"""Pressure eviction: the fallback when an allocation finds no room. First completes offloads
whose copy was issued without waiting, carries out early the plan's own offloads still waiting
for their point's O chain (counted as early offloads, not evictions: the plan moves those bytes
anyway), then offloads the other movable device-resident
records needed last (later micro-batches first; within one, the earliest saved, whose backward
runs last), stores in FP8 what the full pinned pool cannot take (when allowed),
and gives back reloads no consumer took yet. Each move goes through the record (and so the
enforcer). Not thread-safe: runs on the allocating thread."""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable

log = logging.getLogger("bagualu")


def evict(records: Iterable[Any], needed: int, enforcer: Any, counters: Dict[str, int],
          fp8_fallback: bool) -> int:
    """Frees at least ``needed`` device bytes if it can; returns the bytes freed. ``records``
    are record.Record objects; ``counters`` the tracker's counters it adds to."""
    cands = [r for r in records if r.movable() and not r.in_backward and r.pool_bytes > 0]
    cands.sort(key=lambda r: (not r.planned, -r.micro_batch, r.seq))
    freed = 0
    for r in cands:
        if freed >= needed:
            break
        planned, issued = r.planned, r.issued
        got = r.offload()
        if issued and got:  # its copy ran already (offload_behind): completing it moves nothing
            freed += got
            continue
        early = planned and got > 0
        if not got and fp8_fallback and r.movable():
            got = r.store_fp8()  # no pinned room left: a quarter or half the bytes stay
            if got:
                if counters["fp8_evictions"] == 0:
                    log.warning("bagualu: the pinned host pool is full (the node's grant): "
                                "pressure eviction stores activations in FP8 instead")
                counters["fp8_evictions"] += 1
        if early:
            freed += got
            counters["early_offloads"] += 1
        elif got:
            freed += got
            counters["evictions"] += 1
            counters["evicted_bytes"] += got
    if freed < needed and enforcer is not None:
        # Reloads issued ahead of the backward that no consumer took yet: needed soonest, so
        # given back last (their data is still on the host).
        freed += enforcer.give_back(needed - freed)
    return freed
