"""When a backward's reloads start (issue 42, where the time went over the emulated link):
by default each offloaded activation comes back during its own backward, a bounded number
ahead of its consumer (the enforcer's prefetch); a backward whose first consumers need a
reload at once then waits for the whole copy. These start them earlier, under compute, where
the room for them was counted:

- a point's R chain reloads the backward after the point's own, where it fits beside the
  forward's keep-all (``ahead_of_point``: the point counts its host bytes in use);
- a point's own backward starts its first reloads under the point's forward, whose bytes in
  use counted them (``under_point``: Planning.step_point adds its backward_bytes);
- a backward starts the next one's first reloads under itself where that one was reloaded
  ahead at a point, or follows with no forward between (the cool-down) and fits beside what
  this one holds and brings back (``backward_began``; the point of the backward before the
  cool-down sets that room aside, ``cool_down_room``).

Not thread-safe: the training thread."""
from __future__ import annotations

from typing import Any, Optional, Tuple

from ..enforce.order import unit_id
from . import graph


class EarlyReloads:
    """The early-reload decisions of one process's Planning (``planning``: its rank schedule,
    tracker, enforcer, planned capacity and the units reloaded ahead). Not thread-safe: the
    training thread."""

    def __init__(self, planning: Any) -> None:
        self.planning = planning

    def held_bytes(self) -> int:
        """What Algorithm 1 counts in use now: the live micro-batches' in-layer bytes once
        their plans are carried out, and what R chains reloaded ahead of a backward."""
        p = self.planning
        memory = p.tracker.store
        return memory.layer_bytes() + sum(memory.host_bytes(u) for u in p.reloaded_ahead)

    def ahead_of_point(self, backward: Optional[Tuple[int, int]], load: float,
                       in_use: int) -> Optional[Tuple[int, int]]:
        """The unit whose offloaded activations this point's R chain reloads ahead of its
        backward (the backward after ``backward``), or None: only when they fit beside the
        forward's keep-all, so that reloading early never costs the forward a mitigation."""
        p = self.planning
        rank = p.rank_schedule
        if backward is None or rank is None or p.tracker.issuer is None:
            return None
        after = rank.backward_after(backward)
        if after is None:
            return None
        keep_all = graph.keep_all_bytes(p.description, load)
        if in_use + p.tracker.store.host_bytes(unit_id(*after)) + keep_all > p.plan_capacity:
            return None
        return after

    def under_point(self, backward: Optional[Tuple[int, int]]) -> None:
        """The point's own backward (not reloaded ahead): its first reloads, counted in the
        point's bytes in use (backward_bytes), start now under the point's forward rather than
        when the backward needs them."""
        p = self.planning
        if backward is not None and unit_id(*backward) not in p.reloaded_ahead:
            p.tracker.mover.reload_early(unit_id(*backward))

    def cool_down_room(self, backward: Tuple[int, int]) -> int:
        """The room a point sets aside for the next backward's first reloads when that one
        follows ``backward`` in the cool-down (backward_began starts them under it): their
        bytes at the enforcer's bound, else 0."""
        p = self.planning
        rank, t = p.rank_schedule, p.tracker
        if rank is None or not t.reload_ahead:
            return 0
        after = rank.backward_after(backward)
        if after is None or not rank.backs_to_back(after):
            return 0
        return t.store.reload_bytes(unit_id(*after), p.enforcer.max_inflight)

    def backward_began(self, backward: Tuple[int, int]) -> None:
        """The backward of ``backward`` (micro-batch, chunk) starts: the next backward's first reloads start under it
        where their room is counted: that backward's unit was reloaded ahead at a point (its
        host bytes were in use there), or it follows this one with no forward between (the
        cool-down, where nothing else is allocated) and its first reloads fit beside what
        this one holds and brings back. Else they start when that backward does."""
        p = self.planning
        rank, t = p.rank_schedule, p.tracker
        if rank is None or not t.reload_ahead or p.settings.policy != "bagualu":
            return
        after = rank.backward_after(backward)
        if after is None:
            return
        nxt = unit_id(*after)
        if nxt not in p.reloaded_ahead:
            if not rank.backs_to_back(after):
                return
            memory, ahead = t.store, p.enforcer.max_inflight
            in_use = self.held_bytes() + memory.backward_bytes(unit_id(*backward), ahead)
            if in_use + memory.reload_bytes(nxt, ahead) > p.plan_capacity:
                return
        t.mover.reload_early(nxt)
