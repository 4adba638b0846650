"""The per-process runtime behind bagualu.install(): it composes the rooms (device memory,
enforcer, tracker, strategies, plans, iteration log), instruments one model, and runs each
micro-batch's forward and backward under the saved-tensor hooks. What the hooks ask of it (the
Host of capture/host.py) is hooks_host.py's.

One Runtime per process (installer.py creates it; the public API in __init__.py drives it)."""
from __future__ import annotations

import atexit
import gc
import logging
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import nn

from . import _active
from .capture import dispatch as dispatch_hooks
from .capture import foreign
from .capture.blocks import BlockPath
from .capture.modules import AutoLayers, ExpertParallel
from .capture.tracker import Tracker, param_storages
from .describe import describe_backward, describe_capture
from .discovery import find as discover
from .discovery.opblock import OpBlock
from .discovery.sharding import Sharding, refuse_legacy_wrappers
from .enforce.device import DeviceMemory
from .enforce.enforcer import Enforcer
from .enforce.pool import DevicePool
from .errors import InstrumentError
from .hooks_host import HooksHost
from .iteration import IterationLog
from .planning import graph
from .planning.governor import Governor
from .planning.plans import Planning, unit_id
from .planning.strategies import Strategies
from .settings import Settings
from .vocabulary import Op


log = logging.getLogger("bagualu")


def active() -> Optional["Runtime"]:
    """The installed runtime, or None."""
    return _active.runtime


_thaw_at_exit = False


def freeze_long_lived() -> None:
    """Moves every object alive now (the model, torch internals) out of the collector's scans
    (gc.freeze), so that the full collections saved-tensor capture triggers stay cheap.

    Frozen objects are never collected, not even when the interpreter exits: gc.unfreeze()
    runs at uninstall and at exit, or the objects of native modules that check for leaks at
    exit stay alive (triton's, which torch._dynamo imports when torch.utils.checkpoint,
    transformers or torch.compile first run: 'nanobind: leaked 4 instances!')."""
    global _thaw_at_exit
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:
        atexit.register(gc.unfreeze)
        _thaw_at_exit = True


# Storages of at most this many bytes (and at most 1/4096 of the capacity) are never moved: the
# enforcer's calls for one cost more than its bytes are worth (capture/tracker.py, _produced_record).
MIN_MOVE_BYTES = 16 << 10


class Runtime(HooksHost):
    """State of bagualu in this process (see module docstring); the Host of the hooks it
    installs (hooks_host.py). Not thread-safe: the training thread drives it (the pool's
    pressure callback runs on the allocating thread)."""

    def __init__(self, settings: Settings, governor: Optional[Governor],
                 pool: Optional[DevicePool]) -> None:
        self.settings = settings
        self.device = settings.device
        self.policy = settings.policy
        self.capacity = settings.capacity
        self.chunks = settings.chunks
        bagualu = settings.policy == "bagualu"
        evict = self._evict
        # Other policies move nothing on pressure, but wait for the offloads they issued (a
        # GPU's allocator waits on those copies' events before it reports out of memory).
        self.memory = DeviceMemory(self.device, pool, evict if bagualu else self._settle_copies)
        self.enforcer = Enforcer(
            self.device, settings.pinned_capacity,
            borrowed_free_is_safe=self.device.type == "cuda" and _active.cuda_allocator_swapped,
            evict=evict, fp8_block=settings.fp8_block, sync_copies=settings.sync_copies,
            emulated_link=settings.emulated_link)
        strategies = Strategies(settings.policy)
        tracker = Tracker(self.memory, self.enforcer, strategies.of,
                          fp8_block=settings.fp8_block,
                          light_grain=max(settings.capacity >> 10, 4 << 10)
                          if pool is not None else 0,
                          evict_fp8=bagualu and settings.allow_fp8,
                          min_move_bytes=min(MIN_MOVE_BYTES, settings.capacity >> 12))
        log = IterationLog(settings.policy, settings.capacity, settings.log_iterations)
        planning = Planning(settings, governor, strategies, tracker, self.enforcer, log)
        super().__init__(self.device, tracker, strategies, planning, log)
        self.governor = governor
        self.auto: Optional[AutoLayers] = None        # hooks of an unmodified model
        self.discovery: Optional[discover.Discovery] = None  # its layers and operators
        self.block_path: Optional[BlockPath] = None    # a model of bagualu.OpBlock layers
        self._layer_ops: Dict[int, List[Op]] = {}     # planned layer -> its operators
        self.model_info: Dict[str, Any] = {}
        self._capture_unit = -1
        self.log.begin(self.tracker.counters, self.memory.oom_count, self._copy_wait_ns())

    @property
    def layer_ops(self) -> Dict[int, List[Op]]:
        """Planned layer -> its operators (compiled blocks: one operator each)."""
        return self._layer_ops

    @layer_ops.setter
    def layer_ops(self, ops: Dict[int, List[Op]]) -> None:
        self._layer_ops = ops
        self.strategies.learn(op for layer in ops.values() for op in layer)

    def _evict(self, needed: int) -> int:
        return self.tracker.mover.evict(needed)

    def _settle_copies(self, needed: int) -> int:
        """An allocation failed under a policy other than bagualu's: completes the offloads
        issued without waiting (their device blocks stay until the copy is done), oldest first,
        until ``needed`` bytes are free; moves nothing else. Bytes freed (issue 42: offload-all
        ran out of memory over an emulated link while its own copies held the device)."""
        copying = self.tracker.mover.copying
        freed = 0
        while copying and freed < needed:
            rec = copying.popleft()
            if rec.issued and rec.storage is not None:
                freed += rec.offload()
        return freed

    # -- instrumentation --------------------------------------------------------------------
    @property
    def layer_count(self) -> int:
        return self.planning.layer_count

    def instrument(self, model: nn.Module, info: Optional[Dict[str, Any]] = None,
                   layers: discover.Layers = None, ops: Optional[Dict[str, str]] = None,
                   expert_parallel: Optional[int] = None, ep_rank: int = 0,
                   local_experts: Optional[List[int]] = None,
                   dispatch: Optional[Union[str, Sequence[str]]] = None) -> int:
        """Maps the model's modules to operators; returns the number of operators per layer
        (unmodified models) or in all (OpBlock layers)."""
        if self.block_path is not None or self.auto is not None:
            raise InstrumentError("a model is instrumented already in this runtime; call "
                                  "bagualu.install() again for another model")
        refuse_legacy_wrappers(model)
        blocks = [m for m in model.modules() if isinstance(m, OpBlock)]
        if blocks and layers is None and ops is None:
            if expert_parallel is not None or local_experts is not None or \
                    dispatch is not None:
                raise InstrumentError("expert_parallel/local_experts/dispatch apply to "
                                      "unmodified models; OpBlock layers route in their own "
                                      "steps")
            path = BlockPath(self, model, blocks)
            self.block_path = path
            self.layer_ops = path.layer_ops
            count = path.count
            self.tracker.set_model(param_storages(model))
            self.planning.layer_count = len(blocks)
        else:
            # Unmodified model: discover everything first, so an error leaves nothing
            # installed.
            ep = ExpertParallel(expert_parallel, ep_rank, local_experts)
            if layers is None:
                layers = discover.chunk_layers(model, self.chunks)
            dispatches = None
            if dispatch is not None:
                if ep.simulate or ep.local is not None:
                    raise InstrumentError("dispatch= is real expert parallelism (the experts "
                                          "live on other ranks); expert_parallel=/"
                                          "local_experts= simulate it: give one or the other")
                patterns = dispatch_hooks.patterns_of(dispatch)
                ops = dispatch_hooks.operators_with(model, layers, ops, patterns)
                dispatches = dispatch_hooks.Dispatches(self, patterns)
            found = discover.find(model, layers, ops)
            if self.chunks > 1 and (len(found.planned) % self.chunks
                                    or len(found.planned) != len(found.blocks)):
                raise InstrumentError(
                    f"install(chunks={self.chunks}): the {len(found.blocks)} blocks at "
                    f"{found.layers_path} ({len(found.planned)} planned alike) do not split "
                    f"into {self.chunks} stages of equal planned layers; instrument a list of "
                    "the rank's stage modules (chunk order) or pass layers=[path per stage]")
            self.auto = AutoLayers(self, model, found, ep, dispatches,
                                   self.settings.compiled_operators == "operators")
            self.tracker.set_model(param_storages(model))
            self.planning.layer_count = len(found.planned)
            self.layer_ops = {li: [Op(n, found.kinds[n], li) for n in found.op_names]
                              for li in range(len(found.planned))}
            self.discovery = found
            count = len(found.op_names)
        self.sharding = Sharding(model)
        own = foreign.own_checkpointing(blocks if self.block_path is not None else
                                        [found.blocks[i] for i in found.planned])
        if own is not None:
            log.warning("bagualu: the model checkpoints its own blocks (%s): the tensors they "
                        "save are hidden from bagualu, which plans only what is left; the first "
                        "micro-batch (the capture) counts them", own)
        self.model_info = dict(info or {})
        if self.settings.gc_freeze:
            freeze_long_lived()
        return count

    def remove_hooks(self) -> None:
        if self.block_path is not None:
            self.block_path.remove_hooks()
        if self.auto is not None:
            self.auto.remove()

    # -- micro-batch contexts ---------------------------------------------------------------
    def unit_id(self, mb: int, chunk: int = 0) -> int:
        """The tracker's id of micro-batch ``mb`` of local stage ``chunk``."""
        if not 0 <= chunk < self.chunks:
            raise ValueError(f"chunk {chunk} outside 0..{self.chunks - 1} (install(chunks=...))")
        return unit_id(mb, chunk)

    def step_point(self, phase: str, forward_mb: Optional[int], backward_mb: Optional[int],
                   forward_chunk: int = 0, backward_chunk: int = 0) -> Optional[Dict[str, Any]]:
        """A pipeline scheduling point: plans the forward of ``forward_mb`` of local stage
        ``forward_chunk`` (if any)."""
        return self.planning.step_point(phase, forward_mb, backward_mb, forward_chunk,
                                        backward_chunk)

    def _light(self, unit: int) -> bool:
        """Whether the forward of ``unit`` can use light capture: every operator keeps its
        activations and nothing may have to move them later. Under bagualu on the simulated
        device, pressure eviction needs records, so light capture also needs the plan to
        leave a quarter of its prediction free."""
        if not self.strategies.all_keep(unit):
            return False
        if self.policy != "bagualu" or not self.memory.pool_backed:
            return True
        predicted = self.planning.plans.get(unit, {}).get("predicted_bytes", self.capacity)
        return self.tracker.store.device_bytes() + 1.25 * predicted <= self.capacity

    def _mitigations(self) -> tuple:
        c = self.tracker.counters
        return c["offloads"], c["fp8_casts"], c["evictions"], c["drops"]

    @contextmanager
    def forward(self, mb: int, chunk: int = 0) -> Iterator[None]:
        """Runs a micro-batch's forward (of local stage ``chunk``) under saved-tensor hooks."""
        unit = self.unit_id(mb, chunk)
        capture = self.planning.wants_capture()
        t = self.tracker
        if self.auto is not None and self.auto.before_forward():
            self.layer_ops = self.auto.layer_ops()  # compiled blocks: one operator each
        t.begin_forward(unit, capture)
        self._capture_unit = unit if capture else self._capture_unit
        self.forwarding = True
        self.planning.loads[unit] = []
        before = self._mitigations()
        if not capture and self._light(unit):
            t.begin_light(unit)
        try:
            with torch.autograd.graph.saved_tensors_hooks(t.pack, t.unpack):
                yield
        except BaseException:
            t.drop_light(unit)  # no backward will come for this forward
            raise
        finally:
            self.forwarding = False
            self.hidden.close()
            t.end_forward()
            if unit in t.scheduled:
                t.mover.place_planned(unit, self.planning.locate, later=True)
        load = self.planning.forward_ended(unit)
        self.log.loads.append(load)
        captured = (graph.produced_in_layers(t.by_mb.get(unit, ()))
                    + t.store.light_bytes(unit, True))
        if capture:
            describe_capture(self, self._capture_unit)
        description = self.planning.description
        if description is not None and captured > 0 and self._mitigations() == before \
                and self.chunks == 1 and not capture:
            # Nothing was mitigated: the planner's keep-all bytes at the observed load (not
            # for the capture itself, which the graph was built from).
            self.log.accuracy.append((load, graph.keep_all_bytes(description, load),
                                      float(captured)))
        if self.planning.ready and unit in self.planning.plans:
            # The allocator's figures matter to the daemon only (bgl-top, the node's grants).
            stats = (self.memory.report_stats(t.store.device_bytes(),
                                              self.enforcer.stats().get("pinned_in_use", 0))
                     if getattr(self.governor, "remote", None) is not None else None)
            self.planning.report(unit, t.store.layer_bytes(unit), stats)

    @contextmanager
    def backward(self, mb: int, chunk: int = 0) -> Iterator[None]:
        """Runs a micro-batch's backward (of local stage ``chunk``); afterwards its
        activations are gone."""
        unit = self.unit_id(mb, chunk)
        self.tracker.begin_backward(unit)
        self.planning.reloads.backward_began((mb, chunk))
        try:
            yield
        finally:
            self.tracker.end_backward(unit)
            self.planning.backward_ended(unit)
            if unit == self._capture_unit:
                describe_backward(self, at_backward=True)

    # -- iterations and observability -------------------------------------------------------
    def begin_iteration(self) -> None:
        describe_backward(self)  # once, after the capture's backward (if end_iteration did not)
        self.log.begin(self.tracker.counters, self.memory.oom_count, self._copy_wait_ns())
        self.memory.reset_peak()
        self.planning.begin_iteration()

    def end_iteration(self) -> Dict[str, Any]:
        """Closes the iteration and logs its line; returns the line's fields. Then the planners
        the capture's backward time asks for start (describe_backward: warm-up between)."""
        self.planning.end_iteration()
        line = self.log.end(self.tracker.counters, self.memory.oom_count, self.planning.budget,
                            self.memory.peak(), self.strategies.counts(self.layer_ops.values()),
                            self.planning.deferred, self._planner_stats(), self._copy_wait_ns())
        describe_backward(self)
        return line

    def _copy_wait_ns(self) -> int:
        """The enforcer's blocked waits for copies and casts so far (ns)."""
        return int(self.enforcer.stats().get("copy_wait_ns", 0))

    def _planner_stats(self) -> Optional[Dict[str, Any]]:
        """The embedded planner's counters (None without a planner)."""
        stats = getattr(self.governor, "planner_stats", None)
        return stats() if stats is not None else None

    @property
    def history(self) -> List[Dict[str, Any]]:
        return self.log.history

    def stats(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"policy": self.policy, "device": str(self.device),
                               "capacity_bytes": self.capacity,
                               "tracker": dict(self.tracker.counters),
                               "activation_bytes": self.tracker.store.device_bytes(),
                               "ooms": self.memory.oom_count,
                               "governor": self.governor.kind if self.governor else None,
                               "grant_bytes": getattr(self.governor, "grant", None),
                               "job_id": getattr(self.governor, "job_id", None),
                               # the link the host backend's copies emulate (None: their own)
                               "emulated_link": self.enforcer.emulated_link}
        pool = self.memory.allocator()
        if pool is not None:
            out["allocator"] = pool.stats()
        out["enforcer"] = self.enforcer.stats()
        if self.auto is not None and self.auto.compiled.active:
            out["compiled"] = self.auto.compiled_stats()
        lines = self.log.history
        out["planning"] = {"plan_ms": sum(x["plan_ms"] for x in lines),
                           "cache_hits": sum(x["plan_cache_hits"] for x in lines),
                           "cache_misses": sum(x["plan_cache_misses"] for x in lines),
                           "early_offloads": sum(x["early_offloads"] for x in lines),
                           "evictions": sum(x["evictions"] for x in lines),
                           "warm_hits": sum(x.get("warm_hits", 0) for x in lines),
                           "warm_nearest": sum(x.get("warm_nearest", 0) for x in lines),
                           "gate_calls": sum(x.get("gate_calls", 0) for x in lines),
                           "gate_ms": sum(x.get("gate_ms", 0.0) for x in lines),
                           # the activation capacity the planner was given (plans.py register)
                           "capacity_bytes": self.planning.plan_capacity}
        planner = self._planner_stats()
        if planner is not None:
            # the warm-up (issue 43): its plans cached now, keys searched, the worker's CPU;
            # the downgrades' searches after the gate and their price (docs/planner.md)
            for key in ("warm_keys", "warm_submitted", "warm_done", "warm_complete",
                        "warm_cpu_s", "refine_cpu_s", "first_answers", "gate_searches",
                        "gate_searches_cut", "gate_search_s"):
                out["planning"][key] = planner.get(key)
        model = self.log.memory_model()
        if model is not None:
            out["memory_model"] = model
        return out

    def dump_snapshot(self, path: str) -> None:
        self.memory.dump_snapshot(path)

    def close(self) -> None:
        self.remove_hooks()
        self.tracker.release_all()
        self.enforcer.close()
        self.memory.close()
        self.planning.close()
        if self.settings.gc_freeze:
            gc.unfreeze()  # what instrument() froze is the collector's again
