"""Reloads that start before their backward (issue 42: where bagualu's time went over the
emulated link): a point's own backward starts reloading under the point's forward, whose bytes
in use counted it; a backward starts the next one's reloads under itself where that one was
reloaded ahead at a point, or follows with no forward between and fits. The decisions of
planning/reloads.py on a fake tracker (no model, no planner); the time they save is measured in
docs/benchmarks/same-capacity.md, "Where the time goes over the emulated link"."""
from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Dict, List

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))

from bagualu.enforce.order import RankSchedule  # noqa: E402
from bagualu.planning.plans import Planning, unit_id  # noqa: E402

# Stage 0 of a 4-stage 1F1B over 4 micro-batches: F0 F1 F2 F3 B0 B1 B2 B3 (the cool-down
# runs B1..B3 back to back); and over 6: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5.
FOUR = [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("B", 1), ("B", 2), ("B", 3)]
SIX = [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5),
       ("B", 2), ("B", 3), ("B", 4), ("B", 5)]


def steps(order):
    return [{"forward": kind == "F", "micro_batch": mb, "phase": "steady"} for kind, mb in order]


class Store:
    """What the decision reads of the tracker's store: bytes per unit."""

    def __init__(self, layer: int, host: Dict[int, int]) -> None:
        self.layer, self.host = layer, host

    def layer_bytes(self) -> int:
        return self.layer

    def host_bytes(self, unit: int) -> int:
        return self.host.get(unit, 0)

    def reload_bytes(self, unit: int, ahead: int) -> int:
        return self.host.get(unit, 0)

    def backward_bytes(self, unit: int, ahead: int) -> int:
        return self.host.get(unit, 0)


def planning(order, capacity: int, layer: int, host: Dict[int, int]):
    early: List[int] = []
    tracker = SimpleNamespace(reload_ahead=True, store=Store(layer, host),
                              mover=SimpleNamespace(reload_early=early.append))
    p = Planning(SimpleNamespace(policy="bagualu", chunks=1, min_load_factor=None), None, None,
                 tracker, SimpleNamespace(max_inflight=2))
    p.rank_schedule = RankSchedule(steps(order))
    p.plan_capacity = capacity
    return p, early


def test_next_backward_is_the_first_backward_after_a_forward() -> None:
    four, six = RankSchedule(steps(FOUR)), RankSchedule(steps(SIX))
    assert [four.next_backward((mb, 0)) for mb in range(4)] == [(0, 0)] * 4
    assert [six.next_backward((mb, 0)) for mb in range(6)] == [(0, 0)] * 4 + [(1, 0), (2, 0)]
    assert six.next_backward((9, 0)) is None


def test_backs_to_back_names_the_cool_downs_backwards() -> None:
    rank = RankSchedule(steps(SIX))
    assert [mb for mb in range(6) if rank.backs_to_back((mb, 0))] == [3, 4, 5]
    four = RankSchedule(steps(FOUR))
    assert [mb for mb in range(4) if four.backs_to_back((mb, 0))] == [1, 2, 3]


def test_the_cool_down_starts_the_next_backwards_reloads_where_they_fit() -> None:
    p, early = planning(FOUR, capacity=100, layer=60, host={1: 10, 2: 10, 3: 10})
    p.reloads.backward_began((0, 0))  # B1 follows B0 with no forward between: 60 + 0 + 10
    p.reloads.backward_began((1, 0))  # B2: 60 + 10 (B1's) + 10
    p.reloads.backward_began((3, 0))  # the last backward: nothing after it
    assert early == [unit_id(1, 0), unit_id(2, 0)]


def test_reloads_that_would_not_fit_wait_for_their_backward() -> None:
    p, early = planning(FOUR, capacity=100, layer=85, host={1: 10, 2: 10})
    p.reloads.backward_began((0, 0))  # 85 + 0 + 10 fits
    p.reloads.backward_began((1, 0))  # 85 + 10 + 10 does not
    assert early == [unit_id(1, 0)]


def test_a_forward_between_backwards_holds_them_back_unless_a_point_counted_them() -> None:
    p, early = planning(SIX, capacity=100, layer=10, host={1: 10, 2: 10})
    p.reloads.backward_began((0, 0))  # F4 runs between B0 and B1, its budget did not count B1
    assert early == []
    p.reloaded_ahead.add(unit_id(2, 0))  # the point of F5 counted B2's host bytes (R chain)
    p.reloads.backward_began((1, 0))
    assert early == [unit_id(2, 0)]


def test_other_policies_and_synchronous_copies_reload_nothing_early() -> None:
    p, early = planning(FOUR, capacity=100, layer=0, host={1: 10})
    p.tracker.reload_ahead = False  # synchronous copies: the acquire reloads
    p.reloads.backward_began((0, 0))
    p.tracker.reload_ahead = True
    p.settings = SimpleNamespace(policy="keep-all")
    p.reloads.backward_began((0, 0))
    assert early == []


class Governor:
    """Answers every point with an empty plan and keeps the points it was asked."""
    ready = True

    def __init__(self) -> None:
        self.points: List[dict] = []

    def plan(self, point: dict) -> dict:
        self.points.append(point)
        return {"operators": [], "predicted_bytes": 0, "budget_bytes": 1 << 30}


def test_the_forwards_before_a_backward_set_aside_what_it_brings_back() -> None:
    """Algorithm 1's bytes in use at each point: the steady point counts what its backward
    brings back (B0's: 7) and the room for the cool-down's first early reloads (B1's: 3); in
    the next iteration each warm-up forward before B0 sets aside the same 10, so that the four
    forwards share what is left alike."""
    p, early = planning(FOUR, capacity=100, layer=20, host={0: 7, 1: 3})
    p.governor = gov = Governor()
    p.strategies = SimpleNamespace(set_plan=lambda *a: True)
    p.tracker.mover.pending_bytes = lambda: 0
    p.tracker.issuer = None
    schedule = [("warmup", 0, None), ("warmup", 1, None), ("warmup", 2, None), ("steady", 3, 0)]
    for _ in range(2):
        for phase, f, b in schedule:
            p.step_point(phase, f, b, 0, 0)
    used = [pt["bytes_in_use"] for pt in gov.points]
    assert used[:4] == [20, 20, 20, 20 + 7 + 3]
    assert used[4:] == [20 + 10] * 4
    assert unit_id(0, 0) in early  # the steady point's own backward reloads under its forward


def test_the_next_point_plans_with_the_median_load_of_recent_forwards() -> None:
    """A spike seen in one forward is not planned for again at the next point (its router
    downgrades a spiked forward); a lasting change is, once it holds in most of the window.
    forward_ended still returns each forward's own (mean) load (the iteration line's)."""
    p, _ = planning(FOUR, capacity=100, layer=0, host={})
    seen = []
    for unit, load in enumerate([1.0, 1.0, 3.0, 1.0]):
        p.loads[unit] = [load]
        seen.append(p.forward_ended(unit))
        if unit == 2:
            assert p.last_load == 1.0  # the spike: planned for at no later point
    assert seen == [1.0, 1.0, 3.0, 1.0]
    for unit in range(4, 12):  # the load stays at 2.0
        p.loads[unit] = [2.0]
        p.forward_ended(unit)
    assert p.last_load == 2.0


def test_the_next_point_plans_for_the_highest_router_load_of_recent_forwards() -> None:
    """Routers of one forward meet different loads; a plan made for their mean is passed by
    about half of them, each a revision after its router. The next point plans with the median
    of the forwards' highest router loads, not of their means."""
    p, _ = planning(FOUR, capacity=100, layer=0, host={})
    seen = []
    for unit, loads in enumerate([[0.6, 1.4, 1.0], [0.8, 1.3, 0.9], [1.0, 0.7, 1.25],
                                  [3.0, 2.5, 3.0], [0.5, 1.2, 1.0]]):
        p.loads[unit] = loads
        seen.append(p.forward_ended(unit))
    # each forward's own (mean) load, whose median (1.0) the points planned for before
    assert seen == pytest.approx([1.0, 1.0, 0.9833333, 2.8333333, 0.9])
    # highest loads 1.4, 1.3, 1.25, 3.0, 1.2: their median, the spike's 3.0 outvoted
    assert p.last_load == pytest.approx(1.3)
