"""The per-process runtime behind bagualu.install(): allocator, tracker, governor, plans.

One Runtime per process (bagualu.install creates it). It owns the saved-tensor hooks of the
micro-batches in flight, asks the governor for a plan at every scheduling point, carries the
plan out (offload, FP8, recompute regions), reports what each forward retained, and writes one
log line per iteration."""
from __future__ import annotations

import gc
import logging
import math
import os
import pickle
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from . import _active
from . import discover
from . import pool as poolmod
from . import graph as graphmod
from . import issue as issuemod
from .blocks import BlockPath
from .enforcer import Enforcer
from .errors import InstallError, InstrumentError, OutOfMemoryError, PolicyError
from .modules import AutoLayers, ExpertParallel
from .pool import DevicePool
from .ops import OpBlock, regions
from .strategy import FP8, KEEP, OFFLOAD, RECOMPUTE, Op
from .tracker import Tracker, param_storages

log = logging.getLogger("bagualu")
POLICIES = ("keep-all", "static-under", "static-over", "bagualu")
CHUNK_STRIDE = 1 << 20  # tracker id = micro-batch + chunk * CHUNK_STRIDE


def active() -> Optional["Runtime"]:
    """The installed runtime, or None."""
    return _active.runtime


def parse_size(value: Any) -> int:
    """Bytes from an int or a string like '512MiB', '2GiB', '1.5GB'."""
    if isinstance(value, (int, float)):
        return int(value)
    s = str(value).strip()
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
             "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3,
             "mb": 10**6, "gb": 10**9, "tb": 10**12}
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].strip().lower()
    if unit not in units or not num:
        raise ValueError(f"not a size: '{value}' (examples: 268435456, 256MiB, 2GiB)")
    return int(float(num) * units[unit])


def check_policy(policy: str) -> str:
    """Returns the policy or raises PolicyError naming the known ones."""
    if policy not in POLICIES:
        raise PolicyError(f"unknown policy '{policy}' (known: {', '.join(POLICIES)})")
    return policy


ISSUE_ORDERS = ("dual-batch", "serial")


def check_issue_order(order: str) -> str:
    """Returns the issue order or raises PolicyError naming the known ones."""
    if order not in ISSUE_ORDERS:
        raise PolicyError(f"unknown issue_order '{order}' (known: {', '.join(ISSUE_ORDERS)})")
    return order


@dataclass(frozen=True)
class Settings:
    """What ``bagualu.install`` was asked for (validated there); immutable."""

    device: torch.device
    capacity: int                  # bytes of activation memory
    policy: str
    pipeline_rank: int = 0
    pipeline_stages: int = 1
    micro_batches: int = 1
    log_iterations: bool = True
    fp8_block: int = 128
    pinned_capacity: int = 16 << 30
    chunks: int = 1                # local stages of an interleaved schedule
    gc_freeze: bool = True
    issue_order: str = "dual-batch"  # or "serial" (issue.py)


class Runtime:
    """State of bagualu in this process (see module docstring). Not thread-safe: the training
    thread drives it (the pool's pressure callback runs on the allocating thread)."""

    def __init__(self, settings: Settings, governor: Any, pool: Any) -> None:
        if settings.chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {settings.chunks}")
        self.settings = settings
        device, capacity, policy = settings.device, settings.capacity, settings.policy
        fp8_block = settings.fp8_block
        self.chunks = settings.chunks
        self.device = device
        self.pinned_capacity = settings.pinned_capacity
        self.capacity = capacity
        self.policy = check_policy(policy)
        self.governor = governor            # governor.Governor (remote or embedded), lazily set up
        self.pipeline_rank = settings.pipeline_rank
        self.pipeline_stages = settings.pipeline_stages
        self.micro_batches = settings.micro_batches
        self.log_iterations = settings.log_iterations
        self.pool = pool
        self._host_used = 0
        self.tracker = Tracker(self._device_alloc, self._device_free, self.strategy_of,
                               fp8_block=fp8_block,
                               light_chunk=max(capacity >> 10, 4 << 10) if pool is not None
                               else 0,
                               pool_backed=pool is not None, device_type=device.type,
                               evict_fp8=self.policy == "bagualu")
        self.tracker.enforcer = Enforcer(
            device, self.pinned_capacity,
            borrowed_free_is_safe=device.type == "cuda" and _active.cuda_allocator_swapped,
            evict=self.tracker.evict, fp8_block=fp8_block)
        if pool is not None and policy == "bagualu":
            pool.add_pressure_callback(self._on_pressure)
        self.blocks: List[OpBlock] = []
        self.auto: Optional[AutoLayers] = None  # hooks of an unmodified model
        self.discovery: Optional[discover.Discovery] = None  # its layers and operators
        self.layer_count = 0                    # planned layers (either path)
        self.layer_ops: Dict[int, List[Op]] = {}
        self.block_path = BlockPath(self)      # models of bagualu.OpBlock layers
        self.model_info: Dict[str, Any] = {}
        self.description: Optional[Dict[str, Any]] = None
        self.static_strategies: Dict[str, str] = {}
        self.mb_strategies: Dict[int, Dict[str, str]] = {}
        self.mb_plan: Dict[int, Dict[str, Any]] = {}
        self.mb_loads: Dict[int, List[float]] = {}
        self.last_load = 1.0
        self.forwarding = False
        self.op_ms: Dict[str, float] = {}
        self.iteration = 0
        self.iter: Dict[str, Any] = {}
        self.history: List[Dict[str, Any]] = []
        self.accuracy: List[Tuple[float, float, float]] = []  # (load, predicted, captured)
        self.oom_count = 0
        self.forced: Optional[Dict[str, str]] = None
        self.gc_freeze = settings.gc_freeze
        self._reset_iteration_stats()

    # -- device accounting ------------------------------------------------------------------
    def _device_alloc(self, nbytes: int) -> int:
        if self.pool is None:  # CUDA: the real allocator is the pool; count only
            self._host_used += nbytes
            return 1
        try:
            return self.pool.alloc(nbytes)
        except OutOfMemoryError as e:
            if self.policy != "bagualu":
                self.oom_count += 1
                raise
            error = e
        try:
            return poolmod.retry_after_eviction(lambda: self.pool.alloc(nbytes), nbytes,
                                                self.tracker.evict, error)
        except OutOfMemoryError:
            self.oom_count += 1
            raise

    def _device_free(self, block: int, nbytes: int) -> None:
        if self.pool is None:
            self._host_used -= nbytes
            return
        self.pool.free(block, nbytes)

    @property
    def enforcer(self) -> Enforcer:
        """The enforcer every move of a saved activation goes through."""
        return self.tracker.enforcer

    def _on_pressure(self, needed: int) -> int:
        return self.tracker.evict(needed)

    # -- instrumentation --------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        """Whether the running forward is the capture (the first micro-batch)."""
        return self.tracker.capture

    def op_time(self, name: str, ms: float) -> None:
        """Adds ``ms`` to the measured forward time of operator ``name`` (capture)."""
        self.op_ms[name] = self.op_ms.get(name, 0.0) + ms

    def instrument(self, model: nn.Module, info: Optional[Dict[str, Any]] = None,
                   layers: discover.Layers = None, ops: Optional[Dict[str, str]] = None,
                   expert_parallel: Optional[int] = None, ep_rank: int = 0,
                   local_experts: Optional[List[int]] = None) -> int:
        """Maps the model's modules to operators; returns the number of operators per layer
        (unmodified models) or in all (OpBlock layers)."""
        if self.blocks or self.auto is not None:
            raise InstrumentError("a model is instrumented already in this runtime; call "
                                  "bagualu.install() again for another model")
        blocks = [m for m in model.modules() if isinstance(m, OpBlock)]
        if blocks and layers is None and ops is None:
            if expert_parallel is not None or local_experts is not None:
                raise InstrumentError("expert_parallel/local_experts apply to unmodified "
                                      "models; OpBlock layers route in their own steps")
            return self.block_path.instrument(model, blocks, info)
        # Unmodified model: discover everything first, so an error leaves nothing installed.
        ep = ExpertParallel(expert_parallel, ep_rank, local_experts)
        if layers is None:
            layers = discover.chunk_layers(model, self.chunks)
        found = discover.find(model, layers, ops)
        if self.chunks > 1 and (len(found.planned) % self.chunks
                                or len(found.planned) != len(found.blocks)):
            raise InstrumentError(
                f"install(chunks={self.chunks}): the {len(found.blocks)} blocks at "
                f"{found.layers_path} ({len(found.planned)} planned alike) do not split into "
                f"{self.chunks} stages of equal planned layers; instrument a list of the "
                "rank's stage modules (chunk order) or pass layers=[path per stage]")
        self.auto = AutoLayers(self, model, found, ep)
        self.model_info = dict(info or {})
        self.tracker.param_keys = param_storages(model)
        self.tracker.by_producer = True
        self.layer_count = len(found.planned)
        for li in range(self.layer_count):
            self.layer_ops[li] = [Op(n, found.kinds[n], li) for n in found.op_names]
        self.discovery = found
        self._freeze_gc()
        return len(found.op_names)

    def _freeze_gc(self) -> None:
        if self.gc_freeze:
            # Saved-tensor capture allocates a few small Python objects per saved tensor; move
            # the long-lived ones (model, torch internals) out of the collector's full scans.
            gc.collect()
            gc.freeze()

    def remove_hooks(self) -> None:
        self.block_path.remove_hooks()
        if self.auto is not None:
            self.auto.remove()

    # -- strategies -------------------------------------------------------------------------
    @property
    def may_defer(self) -> bool:
        """Whether a router may switch later operators of the forward to recompute."""
        return self.policy == "bagualu" and self.forced is None

    def strategy_of(self, op: Op, mb: int) -> str:
        """The strategy of ``op`` in the forward of micro-batch ``mb``."""
        if op.layer >= 0 and self.forced is not None:
            return self.forced.get(op.name, self.forced.get(op.qualname, KEEP))
        if op.layer < 0 or self.policy == "keep-all":
            return KEEP
        if self.policy == "static-over":
            return RECOMPUTE
        if self.policy == "static-under":
            return self.static_strategies.get(op.qualname, KEEP)
        return self.mb_strategies.get(mb, {}).get(op.qualname, KEEP)

    def _light(self, mb: int) -> bool:
        """Whether the forward of ``mb`` can use light capture: every operator keeps its
        activations and nothing may have to move them later. Forced strategies (tests,
        debugging) always use records. Under bagualu on the simulated device, pressure eviction
        needs records, so light capture also needs the plan to leave a quarter of its
        prediction free."""
        if self.forced is not None:
            return False
        if self.policy == "keep-all":
            return True
        if self.policy == "static-over":
            return False
        if self.policy == "static-under":
            return all(s == KEEP for s in self.static_strategies.values())
        if not all(s == KEEP for s in self.mb_strategies.get(mb, {"": RECOMPUTE}).values()):
            return False
        if self.pool is None:
            return True
        predicted = self.mb_plan.get(mb, {}).get("predicted_bytes", self.capacity)
        return self.tracker.device_bytes() + 1.25 * predicted <= self.capacity

    def force_strategies(self, strategies: Optional[Dict[str, str]]) -> None:
        """Overrides every plan: operator name ('expert_fc1', every layer) or qualname
        ('L0.expert_fc1') -> strategy; None returns to the policy."""
        for s in (strategies or {}).values():
            if s not in (KEEP, OFFLOAD, FP8, RECOMPUTE):
                raise PolicyError(f"unknown strategy '{s}' (keep, offload, fp8, recompute)")
        self.forced = dict(strategies) if strategies is not None else None

    # -- governor and plans -----------------------------------------------------------------
    def _observe_only(self, layer: int, load: float) -> None:
        self.mb_loads.setdefault(self.tracker.micro_batch, []).append(load)

    def observe_gate(self, layer: int, load: float) -> bool:
        """The router of ``layer`` ran with load factor ``load``; returns True when deferred
        planning changed the strategies of the rest of the micro-batch."""
        mb = self.tracker.micro_batch
        self._observe_only(layer, load)
        if self.policy != "bagualu" or self.governor is None or mb not in self.mb_plan:
            return False
        if load <= self.mb_plan[mb].get("load_factor", 0.0) * 1.02:
            return False  # the plan was made for at least this load: it still fits
        plan = self.governor.plan_after_gate(mb % CHUNK_STRIDE, mb // CHUNK_STRIDE,
                                             layer % max(self.layer_count // self.chunks, 1),
                                             load)
        if not plan or not plan.get("deferred"):
            return False
        new = {o["name"]: o["strategy"] for o in plan["operators"]}
        if new == self.mb_strategies.get(mb):
            return False
        self.mb_strategies[mb] = new
        self.iter["deferred"] += 1
        return True

    def _ensure_planner(self) -> None:
        """After the capture micro-batch: describe the model to the governor."""
        if self.governor is None or self.governor.ready or not self.layer_count:
            return
        # What the backward will need: records released during the forward (graph pieces
        # that lead nowhere, e.g. a router's selection arithmetic) held memory only briefly.
        live = self.tracker.by_mb.get(self._capture_mb, set())
        recs = [r for r in self.tracker.captured if r in live]
        self.tracker.captured = []
        loads = self.mb_loads.get(self._capture_mb, [])
        load0 = loads[0] if loads else 1.0
        if self.auto is not None:
            # Operators in the order of their first call (the block's own code first).
            ops = [Op(n, self.discovery.kinds[n], 0)
                   for n in self.auto.op_order(self.discovery.op_names)]
            self.tensor_names = graphmod.TensorNames(True, ops)
            lg = graphmod.build_produced_graph(recs, ops, load0, self.op_ms, self.auto.readers,
                                               self.tensor_names)
            outside = sum(r.nbytes for r in recs if r.consumers and r.producer.layer < 0)
        else:
            self.tensor_names = graphmod.TensorNames(False, self.layer_ops[0])
            lg = graphmod.build_layer_graph(recs, self.layer_ops[0], load0, self.op_ms,
                                            self.tensor_names)
            # The graph is stated at r=1 for layer 0; learn which steps save each named tensor.
            self.block_path.learn_savers(recs)
            outside = sum(r.nbytes for r in recs if not r.consumers or
                          any(c.layer < 0 for c in r.consumers))
        doc = graphmod.model_document(lg, self.layer_count, self.pipeline_stages,
                                      self.micro_batches, self.model_info,
                                      vp=self.layer_count // self.chunks
                                      if self.chunks > 1 else 0)
        in_flight = max(self.pipeline_stages - self.pipeline_rank, 1)
        plan_capacity = int(self.capacity * 0.95) - outside * in_flight
        self.model_doc = doc
        names = self.tensor_names
        self.governor.register(doc, plan_capacity, self.pipeline_rank,
                               allow_offload=self.policy == "bagualu",
                               allow_fp8=self.policy == "bagualu",
                               dual_batch=self.settings.issue_order == "dual-batch")
        self.description = self.governor.description
        self._apply_grant()
        if self.policy == "bagualu" and self.description is not None:
            index = issuemod.StageGraphIndex(self.description,
                                             self.layer_count // max(self.chunks, 1))
            self.tracker.issuer = issuemod.PointIssuer(self.enforcer, index,
                                                       self.tracker.collect_offloaded)
            self.rank_schedule = issuemod.RankSchedule(self.description.get("steps", []))
            self._locate = lambda r: self._graph_index(index, names, r)
        if self.policy == "static-under":
            self.static_strategies = self.governor.static_plan(
                (self.description or {}).get("steps", []))

    @staticmethod
    def _graph_index(index: "issuemod.StageGraphIndex", names: "graphmod.TensorNames",
                     rec: Any) -> Tuple[int, int]:
        """(producer operator, graph tensor) of a record in the planner's stage graph."""
        layer, name = names.locate(rec)
        return index.op(rec.producer), index.tensor(layer, name)

    def _forward_steps(self) -> List[Dict[str, Any]]:
        d = self.description or {}
        return [s for s in d.get("steps", []) if s["forward"]]

    def _global_name(self, name: str, chunk: int) -> str:
        """A plan names layers within its chunk ('L0.x' of chunk 1); this rank numbers them
        over all its chunks."""
        if self.chunks == 1 or not name.startswith("L"):
            return name
        layer, _, rest = name[1:].partition(".")
        if not layer.isdigit():
            return name
        return f"L{int(layer) + chunk * (self.layer_count // self.chunks)}.{rest}"

    def key(self, mb: int, chunk: int = 0) -> int:
        """The tracker's id of micro-batch ``mb`` of local stage ``chunk`` (interleaved
        schedules run each micro-batch once per chunk)."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} outside 0..{self.chunks - 1} (install(chunks=...))")
        return mb + chunk * CHUNK_STRIDE

    def step_point(self, phase: str, forward_mb: Optional[int],
                   backward_mb: Optional[int], forward_chunk: int = 0,
                   backward_chunk: int = 0) -> Optional[Dict[str, Any]]:
        """A pipeline scheduling point: plans the forward of ``forward_mb`` of local stage
        ``forward_chunk`` (if any)."""
        if phase not in ("warmup", "steady", "cooldown"):
            raise ValueError(f"unknown phase '{phase}' (warmup, steady, cooldown)")
        if forward_mb is None or self.policy != "bagualu" or self.governor is None \
                or not self.governor.ready:
            return None
        point: Dict[str, Any] = {"phase": phase, "forward_micro_batch": int(forward_mb),
                                 "load_factor": max(self.last_load, 0.05),
                                 "bytes_in_use": int(self.tracker.device_bytes())}
        if backward_mb is not None:
            point["backward_micro_batch"] = int(backward_mb)
        if self.chunks > 1:
            point["forward_chunk"] = int(forward_chunk)
            point["backward_chunk"] = int(backward_chunk)
        plan = self.governor.plan(point)
        if plan is None:
            return None
        self._apply_grant()
        key = self.key(forward_mb, forward_chunk)
        self.mb_plan[key] = plan
        self.mb_strategies[key] = {self._global_name(o["name"], forward_chunk): o["strategy"]
                                   for o in plan["operators"]}
        self.iter["budget"] = min(self.iter["budget"], plan["budget_bytes"])
        self._issue(plan, (forward_mb, forward_chunk),
                    (backward_mb, backward_chunk) if backward_mb is not None else None)
        return plan

    def _apply_grant(self) -> None:
        """Sizes the enforcer's pinned pool to the node's grant for this process (issue 14),
        never above install(pinned_capacity=...)."""
        grant = getattr(self.governor, "grant", None)
        if grant is None:
            return
        size = min(int(grant), self.pinned_capacity)
        if size != getattr(self, "_pinned_size", None):
            self.enforcer.set_pinned_capacity(size)
            self._pinned_size = size

    def _issue(self, plan: Dict[str, Any], forward: Tuple[int, int],
               backward: Optional[Tuple[int, int]]) -> None:
        """Hands the point's issue order to the enforcer's stream scheduler (issue.py); the
        forward's planned offloads wait for a later point's O chain."""
        issuer = self.tracker.issuer
        if issuer is None or not plan.get("issue_order"):
            return
        rank = self.rank_schedule
        before, after = rank.forward_before(forward), rank.backward_after(backward)
        issuer.begin(plan["issue_order"], self.key(*forward),
                     self.key(*backward) if backward is not None else -1,
                     self.key(*before) if before is not None else -1,
                     self.key(*after) if after is not None else -1)
        if rank.has_later_forward(forward):
            self.tracker.scheduled.add(self.key(*forward))

    # -- micro-batch contexts ---------------------------------------------------------------
    @contextmanager
    def forward(self, mb: int, chunk: int = 0) -> Iterator[None]:
        """Runs a micro-batch's forward (of local stage ``chunk``) under the saved-tensor
        hooks."""
        chunk_of = chunk
        mb = self.key(mb, chunk)
        capture = self.governor is not None and not self.governor.ready and self.layer_count > 0
        t = self.tracker
        t.micro_batch = mb
        t.capture = capture
        self._capture_mb = mb
        self.forwarding = True
        self.mb_loads[mb] = []
        before = (t.counters["offloads"], t.counters["fp8_casts"], t.counters["evictions"],
                  self.iter["recompute_ops"])
        self._env_keys = getattr(self, "_env_keys", {}) if not capture else {}
        if capture:
            self._record_env = True
        elif self._light(mb):
            t.begin_light(mb)
        try:
            with torch.autograd.graph.saved_tensors_hooks(t.pack, t.unpack):
                yield
        except BaseException:
            t.drop_light(mb)  # no backward will come for this forward
            raise
        finally:
            self.forwarding = False
            t.scope.clear()
            t.end_forward()
            t.capture = False
            if mb in t.scheduled:
                t.place_planned(mb, self._locate, later=True)
        loads = self.mb_loads.get(mb) or [self.last_load]
        load = sum(loads) / len(loads)
        self.last_load = load
        self.iter["loads"].append(load)
        in_layers = (graphmod.produced_in_layers if self.auto is not None
                     else graphmod.in_layer_bytes)
        captured = in_layers(t.by_mb.get(mb, ())) + t.light_bytes(mb, True)
        if capture:
            self._ensure_planner()
        after = (t.counters["offloads"], t.counters["fp8_casts"], t.counters["evictions"],
                 self.iter["recompute_ops"])
        if self.description is not None and captured > 0 and after == before \
                and self.chunks == 1:
            # Nothing was mitigated: the planner's keep-all bytes at the observed load.
            self.accuracy.append((load, graphmod.keep_all_bytes(self.description, load),
                                  float(captured)))
        if self.governor is not None and self.governor.ready and mb in self.mb_plan:
            # The allocator's figures matter to the daemon only (bgl-top, the node's grants).
            stats = (self._report_stats()
                     if getattr(self.governor, "remote", None) is not None else None)
            self.governor.report(mb % CHUNK_STRIDE, chunk_of, t.retained_bytes(mb), stats)
        self._note_peak()

    def _report_stats(self) -> Dict[str, Any]:
        """This process's AllocatorStats for a report: the pool's figures (the tracker's count
        of activation bytes where PyTorch's allocator is not the pool), OOMs, pinned use."""
        st = self.pool.stats() if self.pool is not None else {}
        in_use = int(st.get("allocated_bytes_current", self.tracker.device_bytes()))
        return {"allocated_bytes": in_use,
                "reserved_bytes": int(st.get("reserved_bytes_current", in_use)),
                "peak_allocated_bytes": int(st.get("allocated_bytes_peak",
                                                   max(self._peak, in_use))),
                "fragmentation": float(st.get("fragmentation", 0.0)),
                "oom_count": self.oom_count,
                "host_used_bytes": int(self.enforcer.stats().get("pinned_in_use", 0))}

    @contextmanager
    def backward(self, mb: int, chunk: int = 0) -> Iterator[None]:
        """Runs a micro-batch's backward (of local stage ``chunk``); afterwards its
        activations are gone."""
        mb = self.key(mb, chunk)
        self.tracker.begin_backward(mb)
        try:
            yield
        finally:
            self._note_peak()
            self.tracker.end_backward(mb)
            self.mb_plan.pop(mb, None)

    def record_env(self, layer: int, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            self._env_keys.setdefault(layer, {})[value.untyped_storage().data_ptr()] = name

    # -- iterations and observability -------------------------------------------------------
    def _reset_iteration_stats(self) -> None:
        self.iter = {"loads": [], "budget": math.inf, "recompute_ms": 0.0, "recompute_ops": 0,
                     "deferred": 0, "t0": time.perf_counter(),
                     "counters0": dict(self.tracker.counters), "ooms0": self.oom_count}
        if self.pool is not None:
            self.pool.reset_peak()
        self._peak = 0

    def _note_peak(self) -> None:
        if self.pool is None:
            self._peak = max(self._peak, self._host_used)

    def begin_iteration(self) -> None:
        self._reset_iteration_stats()
        self.mb_strategies.clear()
        self.mb_plan.clear()
        if self.governor is not None and self.governor.ready:
            self.governor.reset_iteration()

    def end_iteration(self) -> Dict[str, Any]:
        """Closes the iteration and logs its line; returns the line's fields."""
        if self.tracker.issuer is not None:
            self.tracker.issuer.finish()
        it = self.iter
        c0, c = it["counters0"], self.tracker.counters
        loads = it["loads"] or [1.0]
        peak = self._peak
        if self.pool is not None:
            peak = int(self.pool.stats().get("allocated_bytes_peak", 0))
        counts = self._strategy_counts()
        elapsed = (time.perf_counter() - it["t0"]) * 1e3
        line = {
            "iteration": self.iteration, "policy": self.policy,
            "load_factor": sum(loads) / len(loads), "max_load_factor": max(loads),
            "budget_bytes": None if it["budget"] == math.inf else int(it["budget"]),
            "peak_bytes": peak, "capacity_bytes": self.capacity, "strategies": counts,
            "offloads": c["offloads"] - c0["offloads"], "fp8_casts": c["fp8_casts"] - c0["fp8_casts"],
            "recomputed_ops": it["recompute_ops"], "evictions": c["evictions"] - c0["evictions"],
            "deferred": it["deferred"], "overhead_ms": it["recompute_ms"],
            "iteration_ms": elapsed, "ooms": self.oom_count - it["ooms0"],
        }
        self.history.append(line)
        if self.log_iterations:
            budget = "-" if line["budget_bytes"] is None else _mib(line["budget_bytes"])
            strat = " ".join(f"{k}={v}" for k, v in counts.items() if v)
            log.info("bagualu: iter %d policy %s load %.2f (max %.2f) budget %s peak %s/%s "
                     "strategies %s offloads %d fp8 %d recomputed %d evictions %d deferred %d "
                     "overhead %.1fms (%.1f%%)", line["iteration"], self.policy,
                     line["load_factor"], line["max_load_factor"], budget, _mib(peak),
                     _mib(self.capacity), strat or "keep", line["offloads"], line["fp8_casts"],
                     line["recomputed_ops"], line["evictions"], line["deferred"],
                     line["overhead_ms"], 100 * line["overhead_ms"] / max(elapsed, 1e-9))
        self.iteration += 1
        return line

    def _strategy_counts(self) -> Dict[str, int]:
        counts = {KEEP: 0, OFFLOAD: 0, FP8: 0, RECOMPUTE: 0}
        for layer, ops in self.layer_ops.items():
            for mb in (self.mb_strategies or {-1: {}}):
                for op in ops:
                    s = self.strategy_of(op, mb)
                    counts[s] = counts.get(s, 0) + 1
        return counts

    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"policy": self.policy, "device": str(self.device),
                               "capacity_bytes": self.capacity,
                               "tracker": dict(self.tracker.counters),
                               "activation_bytes": self.tracker.device_bytes(),
                               "ooms": self.oom_count,
                               "governor": self.governor.kind if self.governor else None}
        if self.pool is not None:
            out["allocator"] = self.pool.stats()
        elif self._cuda_pool() is not None:
            out["allocator"] = self._cuda_pool().stats()
        out["enforcer"] = self.enforcer.stats()
        if self.accuracy:
            errs = [abs(p - c) / c for _, p, c in self.accuracy if c > 0]
            out["memory_model"] = {"samples": len(errs), "mean_error": sum(errs) / len(errs),
                                   "worst_error": max(errs)}
        return out

    def dump_snapshot(self, path: str) -> None:
        """Writes the allocator's snapshot as the pickle pytorch.org/memory_viz opens."""
        pool = self.pool if self.pool is not None else self._cuda_pool()
        if pool is None:  # CUDA with PyTorch's own allocator (install came too late)
            torch.cuda.memory._dump_snapshot(path)
            return
        snap = pool.snapshot()
        with open(path, "wb") as f:
            pickle.dump(snap, f)

    def _cuda_pool(self) -> Any:
        """libbgl_alloc.so's view of this CUDA device when it is PyTorch's allocator."""
        if self.device.type != "cuda" or not _active.cuda_allocator_swapped:
            return None
        if getattr(self, "_cuda_pool_view", None) is None:
            self._cuda_pool_view = DevicePool(0, device=self.device.index or 0, configure=False)
        return self._cuda_pool_view

    def close(self) -> None:
        self.remove_hooks()
        self.tracker.release_all()
        self.enforcer.close()
        if self.pool is not None:
            self.pool.close()
        if self.governor is not None:
            self.governor.close()


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / (1 << 20):.1f}MiB"
