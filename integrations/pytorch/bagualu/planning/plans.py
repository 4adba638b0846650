"""The plans of this process: registering the captured model with the governor, planning each
scheduling point, the deferred replan after a router, reports, the node's grant for the pinned
pool, and handing each plan's issue order to the enforcer's stream scheduler.

Not thread-safe: the training thread."""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any, Dict, List, Optional, Set, Tuple

from ..capture.tracker import Tracker
from ..enforce import order
from ..enforce.enforcer import Enforcer
from ..enforce.order import UNIT_STRIDE, unit_id
from ..errors import PolicyError
from ..iteration import IterationLog
from ..record import Record
from ..settings import Settings
from . import graph
from .governor import Governor
from .reloads import EarlyReloads
from .strategies import Strategies

SERVED_KEPT = 64  # iterations whose served plans are kept (served_plans)
LOAD_WINDOW = 8  # forwards whose median highest load factor the next point plans with


class Planning:
    """Plans for one process's forwards; ``governor`` None plans nothing (keep-all)."""

    def __init__(self, settings: Settings, governor: Optional[Governor],
                 strategies: Strategies, tracker: Tracker, enforcer: Enforcer,
                 log: Optional[IterationLog] = None) -> None:
        self.settings = settings
        self.governor = governor
        self.strategies = strategies
        self.tracker = tracker
        self.enforcer = enforcer
        self.log = log  # the iteration log the points are noted in
        self.layer_count = 0               # planned layers of this rank (all chunks)
        self._registered: Tuple[Any, ...] = ()  # register's arguments (register_backward)
        self.model_doc: Optional[Dict[str, Any]] = None    # what was registered
        self.description: Optional[Dict[str, Any]] = None  # the planner's stage graph
        self.tensor_names: Optional[graph.TensorNames] = None
        self.plans: Dict[int, Dict[str, Any]] = {}     # unit -> its forward's plan
        # unit -> the plan its forward runs under: its plan, or the revision after a gate
        self.served: Dict[int, Dict[str, Any]] = {}
        self.loads: Dict[int, List[float]] = {}        # unit -> its routers' load factors
        self.last_load = 1.0  # the load factor the next point plans with
        self.recent_loads: deque = deque(maxlen=LOAD_WINDOW)  # the last forwards' highest loads
        self.rank_schedule: Optional[order.RankSchedule] = None
        self.index: Optional[order.StageGraphIndex] = None
        self._pinned_size: Optional[int] = None
        self.budget = math.inf   # the iteration's smallest budget
        self.plan_capacity = 0   # the capacity the governor plans with (register)
        self.reloaded_ahead: Set[int] = set()  # units an R chain reloads ahead of backward
        self.deferred = 0        # the iteration's deferred replans
        # unit -> the plan its forward ran under, this iteration (served, not popped)
        self._served_now: Dict[int, Dict[str, Any]] = {}
        self.served_log: deque = deque(maxlen=SERVED_KEPT)  # per iteration: _served_now
        self.reloads = EarlyReloads(self)  # when backwards' reloads start
        # backward unit -> the bytes its backward brought back, as its point last counted them
        self.bring_back: Dict[int, int] = {}

    @property
    def ready(self) -> bool:
        return self.governor is not None and self.governor.ready

    def wants_capture(self) -> bool:
        """Whether the next forward is the capture micro-batch."""
        return self.governor is not None and not self.governor.ready and self.layer_count > 0

    # -- after the capture ------------------------------------------------------------------
    def register(self, layer_graph: Dict[str, Any], names: graph.TensorNames,
                 outside_bytes: int, model_info: Dict[str, Any]) -> None:
        """Describes the captured model to the governor (capacity less what stays outside the
        layers for every micro-batch in flight) and sets up the issue order."""
        s = self.settings
        doc = graph.model_document(layer_graph, self.layer_count, s.pipeline_stages,
                                   s.micro_batches, model_info,
                                   vp=self.layer_count // s.chunks if s.chunks > 1 else 0)
        in_flight = max(s.pipeline_stages - s.pipeline_rank, 1)
        plan_capacity = int(s.capacity * 0.95) - outside_bytes * in_flight
        if plan_capacity <= 0:
            mib = 1 << 20
            raise PolicyError(
                f"install(capacity={s.capacity / mib:.2f} MiB) leaves no room for the layers: "
                f"{outside_bytes / mib:.2f} MiB of each micro-batch's saved activations are "
                f"outside the planned layers (embeddings, the head, the loss) and are counted "
                f"for each of the {in_flight} micro-batches this rank may hold (pipeline_stages "
                f"{s.pipeline_stages} - pipeline_rank {s.pipeline_rank}): "
                f"{outside_bytes * in_flight / mib:.2f} MiB, over 95% of the capacity; give "
                f"at least {outside_bytes * in_flight / 0.95 / mib:.2f} MiB plus the layers' "
                f"own room")
        self.model_doc = doc
        self._registered = (layer_graph, names, outside_bytes, model_info)
        self.plan_capacity = plan_capacity
        self.tensor_names = names
        bagualu = s.policy == "bagualu"
        self.governor.register(doc, plan_capacity, s.pipeline_rank, allow_offload=bagualu,
                               allow_fp8=bagualu and s.allow_fp8,
                               dual_batch=s.issue_order == "dual-batch")
        self.description = self.governor.description
        self.apply_grant()
        if bagualu and self.description is not None:
            self.index = order.StageGraphIndex(self.description,
                                               self.layer_count // max(s.chunks, 1))
            self.tracker.set_issuer(order.PointIssuer(self.enforcer.scheduler, self.index,
                                                      self.tracker.mover.collect_offloaded))
            self.rank_schedule = order.RankSchedule(self.description.get("steps", []))
        if s.policy == "static-under":
            # static-under: recompute only (the policy a user would set by hand)
            self.strategies.static = self.governor.static_plan(
                (self.description or {}).get("steps", []), moves=False)

    def register_backward(self, backward_ms: float) -> None:
        """The capture's layer graph again with the layer's measured backward time (ms, its
        backward_ms): the governor plans with it from the next point on (describe.py's
        describe_backward says when: where no forward is planned and not yet run back)."""
        layer_graph, names, outside_bytes, model_info = self._registered
        self.register(dict(layer_graph, backward_ms=backward_ms), names, outside_bytes,
                      model_info)

    def locate(self, rec: Record) -> Tuple[int, int]:
        """(producer operator, graph tensor) of a record in the planner's stage graph."""
        layer, name = self.tensor_names.locate(rec)
        return self.index.op(rec.producer), self.index.tensor(layer, name)

    # -- points -----------------------------------------------------------------------------
    def _global_name(self, name: str, chunk: int) -> str:
        """A plan names layers within its chunk ('L0.x' of chunk 1); this rank numbers them
        over all its chunks."""
        chunks = self.settings.chunks
        if chunks == 1 or not name.startswith("L"):
            return name
        layer, _, rest = name[1:].partition(".")
        if not layer.isdigit():
            return name
        return f"L{int(layer) + chunk * (self.layer_count // chunks)}.{rest}"

    def step_point(self, phase: str, forward_mb: Optional[int], backward_mb: Optional[int],
                   forward_chunk: int, backward_chunk: int) -> Optional[Dict[str, Any]]:
        """Plans the forward of ``forward_mb`` of local stage ``forward_chunk`` (if any)."""
        if phase not in ("warmup", "steady", "cooldown"):
            raise ValueError(f"unknown phase '{phase}' (warmup, steady, cooldown)")
        if forward_mb is None or self.settings.policy != "bagualu" or not self.ready:
            return None
        load = max(self.last_load, self.settings.min_load_factor or 0.05)
        forward = (forward_mb, forward_chunk)
        backward = (backward_mb, backward_chunk) if backward_mb is not None else None
        t, memory = self.tracker, self.tracker.store
        # Algorithm 1 counts what the live micro-batches hold once their plans are carried
        # out (docs/algorithms.md sec. 3: a planned offload waiting for its O chain is gone;
        # the bytes outside the layers were set aside from the capacity at register) and what
        # R chains brought back, or this point's brings back, ahead of a backward.
        in_use = self.reloads.held_bytes()
        back = 0
        if backward is not None and unit_id(*backward) not in self.reloaded_ahead:
            # This point's backward runs after the forward planned here, and brings its
            # offloaded and dropped activations back while it runs: their room at once (the
            # enforcer's bound ahead of need, or one at a time on synchronous copies).
            back = memory.backward_bytes(unit_id(*backward),
                                         self.enforcer.max_inflight if t.reload_ahead else 0)
        elif backward is None and self.rank_schedule is not None:
            # Every forward until the next backward is still live while that backward brings
            # its activations back: that room (as its point last counted it) is set aside at
            # each of them, so that they share what is left alike (Algorithm 1's free / k)
            # rather than the last of them giving up the whole of it.
            nxt = self.rank_schedule.next_backward(forward)
            in_use += self.bring_back.get(unit_id(*nxt), 0) if nxt is not None else 0
        recover = self.reloads.ahead_of_point(backward, load, in_use + back)
        if recover is not None:
            in_use += memory.host_bytes(unit_id(*recover))
        elif backward is not None:  # the next backward's first reloads, in the cool-down
            back += self.reloads.cool_down_room(backward)
        if backward is not None:
            self.bring_back[unit_id(*backward)] = back
        in_use += back
        point: Dict[str, Any] = {"phase": phase, "forward_micro_batch": int(forward_mb),
                                 "load_factor": load, "bytes_in_use": int(in_use)}
        if backward_mb is not None:
            point["backward_micro_batch"] = int(backward_mb)
        if self.settings.chunks > 1:
            point["forward_chunk"] = int(forward_chunk)
            point["backward_chunk"] = int(backward_chunk)
        t0 = time.perf_counter()
        plan = self.governor.plan(point)
        if plan is None:
            return None
        self.apply_grant()
        unit = unit_id(*forward)
        if self.log is not None:
            self.log.note_plan(unit, plan, (time.perf_counter() - t0) * 1e3, int(in_use),
                               t.counters["evictions"])
        self.plans[unit] = self.served[unit] = self._served_now[unit] = plan
        self.strategies.set_plan(unit, {self._global_name(o["name"], forward_chunk):
                                        o["strategy"] for o in plan["operators"]})
        self.budget = min(self.budget, plan["budget_bytes"])
        pending = t.mover.pending_bytes()
        if pending and in_use + pending + plan["predicted_bytes"] > self.plan_capacity:
            # The earlier forward's offloads were to run under this one, but this forward's
            # plan needs their room: they go first.
            self.tracker.mover.flush_pending()
            pending = 0
        # This forward's own offloads may wait for the next point's O chain while it holds
        # them beside its plan's prediction (the next point flushes them if its forward needs
        # the room); else they leave as their operators save them.
        defer = in_use + pending + plan["predicted_bytes"] + plan.get("host_bytes", 0) \
            <= self.plan_capacity
        if recover is not None and self.tracker.issuer is not None and plan.get("issue_order"):
            self.reloaded_ahead.add(unit_id(*recover))  # only once an R chain is issued
        self._issue(plan, forward, backward, recover, defer)
        self.reloads.under_point(backward)
        return plan

    def apply_grant(self) -> None:
        """Sizes the enforcer's pinned pool to the node's grant for this process, never above
        install(pinned_capacity=...)."""
        grant = getattr(self.governor, "grant", None)
        if grant is None:
            return
        size = min(int(grant), self.settings.pinned_capacity)
        if size != self._pinned_size:
            self.enforcer.set_pinned_capacity(size)
            self._pinned_size = size

    def _issue(self, plan: Dict[str, Any], forward: Tuple[int, int],
               backward: Optional[Tuple[int, int]], recover: Optional[Tuple[int, int]],
               defer: bool) -> None:
        """Hands the point's issue order to the enforcer's stream scheduler (enforce/order.py);
        the forward's planned offloads wait for a later point's O chain (``defer``)."""
        issuer = self.tracker.issuer
        if issuer is None or not plan.get("issue_order"):
            return
        rank = self.rank_schedule
        before, after = rank.forward_before(forward), recover
        issuer.begin(plan["issue_order"], unit_id(*forward),
                     unit_id(*backward) if backward is not None else -1,
                     unit_id(*before) if before is not None else -1,
                     unit_id(*after) if after is not None else -1)
        if defer and rank.has_later_forward(forward):
            self.tracker.scheduled.add(unit_id(*forward))

    # -- during a forward -------------------------------------------------------------------
    def note_load(self, unit: int, load: float) -> None:
        """A router of ``unit``'s forward ran with load factor ``load``."""
        self.loads.setdefault(unit, []).append(load)

    def observe_router(self, unit: int, layer: int, load: float) -> bool:
        """The router of ``layer`` ran with load factor ``load``; returns True when deferred
        planning changed the strategies of the rest of the forward."""
        self.note_load(unit, load)
        if self.settings.policy != "bagualu" or self.governor is None or unit not in self.plans:
            return False
        if load <= self.plans[unit].get("load_factor", 0.0) * 1.02:
            return False  # the plan was made for at least this load: it still fits
        chunks = self.settings.chunks
        t0 = time.perf_counter()
        plan = self.governor.plan_after_gate(unit % UNIT_STRIDE, unit // UNIT_STRIDE,
                                             layer % max(self.layer_count // chunks, 1), load)
        if self.log is not None:
            self.log.note_gate((time.perf_counter() - t0) * 1e3)
        if not plan or not plan.get("deferred"):
            return False
        before = self.strategies.in_effect([unit])
        if not self.strategies.set_plan(unit, {o["name"]: o["strategy"]
                                               for o in plan["operators"]}):
            return False
        self.served[unit] = self._served_now[unit] = plan
        self.deferred += 1
        if self.log is not None:
            self.log.note_downgrade(unit, layer, load, before, self.strategies.in_effect([unit]))
        return True

    def forward_ended(self, unit: int) -> float:
        """The forward of ``unit`` ended: returns its mean load factor (the planned one where
        it has no router). The next point plans with the median, over the last LOAD_WINDOW
        forwards, of each forward's highest router load: a plan fits a forward only where no
        router passes its load (``observe_router`` revises the rest of the forward after one
        that does), so the forwards' mean loads left about half of them revised. A spike seen
        in one forward is not planned for again in the next (a spiked forward is downgraded
        after its router), a lasting change is after a few forwards."""
        loads = self.loads.get(unit) or [self.last_load]
        self.recent_loads.append(max(loads))
        self.last_load = statistics.median(self.recent_loads)
        return sum(loads) / len(loads)

    def in_effect(self) -> Dict[str, Any]:
        """The micro-batches in flight (forward planned and run, backward not yet) under the
        plans this process serves them, whichever planner made them (the daemon's, the
        embedded one's, a gate's revision): activation bytes planned against actual, on the
        device and on host, and the strategy mix (the proto's InEffect; bgl-top shows it)."""
        units = list(self.plans)
        served = [self.served.get(u, self.plans[u]) for u in units]
        store = self.tracker.store
        return {"micro_batches": len(units),
                "planned_bytes": int(sum(p.get("predicted_bytes", 0) for p in served)),
                "actual_bytes": int(sum(store.layer_bytes(u) for u in units)),
                "planned_host_bytes": int(sum(p.get("host_bytes", 0) for p in served)),
                "actual_host_bytes": int(sum(store.host_bytes(u) for u in units)),
                "strategy_counts": self.strategies.in_effect(units)}

    def report(self, unit: int, retained: int, stats: Optional[Dict[str, Any]]) -> None:
        """What the forward of ``unit`` retained on the device, to the governor; to a daemon,
        with the plans in effect (``in_effect``)."""
        if self.ready and unit in self.plans:
            if self.log is not None:
                self.log.note_forward(unit, retained, self.tracker.counters["evictions"])
            in_effect = self.in_effect() if stats is not None else None
            self.governor.report(unit % UNIT_STRIDE, unit // UNIT_STRIDE, retained, stats,
                                 in_effect)

    def backward_ended(self, unit: int) -> None:
        self.plans.pop(unit, None)
        self.served.pop(unit, None)
        self.reloaded_ahead.discard(unit)

    def begin_iteration(self) -> None:
        self.strategies.clear()
        self.plans.clear()
        self.served.clear()
        self.budget = math.inf
        self.deferred = 0
        self.reloaded_ahead.clear()
        if self.ready:
            self.governor.reset_iteration()

    def end_iteration(self) -> None:
        self.served_log.append(self._served_now)
        self._served_now = {}
        if self.tracker.issuer is not None:
            self.tracker.issuer.finish()

    def served_plans(self) -> Dict[str, Any]:
        """The plans the last SERVED_KEPT iterations' forwards ran under (a gate's revision
        where one replaced the plan), as bgl-sim --plans reads them (tools/bgl-sim/
        served_plans.h): per iteration, each plan's micro-batch, chunk, load factor, operator
        strategies and issue order, in the planner's plan fields."""
        keys = ("micro_batch", "chunk", "load_factor", "operators", "issue_order")
        return {"format": "bgl-served-plans", "version": 1,
                "iterations": [{"plans": [{k: p[k] for k in keys if k in p}
                                          for _, p in sorted(it.items())]}
                               for it in self.served_log]}

    def close(self) -> None:
        if self.governor is not None:
            self.governor.close()
