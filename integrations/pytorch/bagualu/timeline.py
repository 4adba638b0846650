"""Recording one iteration's activation memory over time (``bagualu.record_iteration``): what
the allocator holds, what the layers hold once the plans are carried out, what the plans said
each micro-batch would hold, the capacity, each micro-batch's forward and backward with its
strategies, load factor and downgrades; what ``bagualu.plot_iteration`` draws (plot.py).

Off unless asked: while a recording is open it wraps the installed runtime's own methods on
that one instance (begin_iteration, step_point, forward, backward, observe_router,
end_iteration; and its governor's plan_after_gate, to read a downgrade's plan) and takes a
sample at each; closed, the wrappers are gone and nothing else ever
changed. A sample reads the allocator's activation bytes (the host backend's pool on CPU, the
runtime's count on CUDA) and the tracker's in-layer bytes: a few tens of microseconds, four
or five times per micro-batch. Not thread-safe: the training thread."""
from __future__ import annotations

import csv
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from . import _active
from .errors import BagualuError
from .vocabulary import STRATEGIES

FORMAT = "bagualu-iteration/1"  # the JSON file's "format"
SPIKE = 1.5  # the load factor over which a micro-batch's forward is called a spike
SERIES = ("actual_bytes", "layer_bytes", "planned_bytes")
_UNIT_STRIDE = 1 << 20  # planning/plans.py's unit id = micro-batch + chunk * stride


class Recording:
    """One iteration's activation memory over time.

    ``samples``: one dict per event (``t_ms`` since the iteration began, ``event``:
    begin, point, forward_begin, forward_end, downgrade, backward_begin, backward_end, end;
    ``micro_batch`` and ``chunk`` where the event is one micro-batch's; ``evictions``: the
    iteration's pressure evictions so far) with the three series:

    - ``actual_bytes``: activation bytes the allocator holds (every saved activation on the
      device: the layers', those outside them, offloads still copying, FP8 copies);
    - ``layer_bytes``: in-layer device bytes the live micro-batches hold once their plans are
      carried out (what the planner counts: ``Tracker.layer_bytes``);
    - ``planned_bytes``: the same as the plans say: a finished forward that was planned counts
      its plan's ``predicted_bytes`` (after a downgrade, the replan's) until its backward
      ends; a forward nobody planned (the capture, other policies) or one still running
      counts what it holds.

    ``micro_batches``: one dict per micro-batch forward (times of its forward and backward,
    whether it was planned, its plan's predicted bytes (``point_predicted_bytes`` at its
    scheduling point, ``predicted_bytes`` of the plan carried out: the last deferred replan's
    after a downgrade), budget and in-use bytes, what it held at the forward's end, its load
    factors, its strategy counts over the layers' operators, its downgrades). ``line``: the
    iteration's ``end_iteration`` line once it ended.
    """

    def __init__(self, policy: str = "", device: str = "", capacity_bytes: int = 0) -> None:
        self.policy = policy
        self.device = device
        self.capacity_bytes = int(capacity_bytes)
        self.plan_capacity_bytes = 0  # what the planner may fill with the layers (0: no plans)
        self.iteration: Optional[int] = None
        self.samples: List[Dict[str, Any]] = []
        self.micro_batches: List[Dict[str, Any]] = []
        self.line: Optional[Dict[str, Any]] = None

    # -- views ------------------------------------------------------------------------------
    def series(self) -> Dict[str, List[float]]:
        """``t_ms`` and the three series (SERIES), one value per sample."""
        out: Dict[str, List[float]] = {"t_ms": [s["t_ms"] for s in self.samples]}
        for name in SERIES:
            out[name] = [s[name] for s in self.samples]
        return out

    @property
    def planned(self) -> bool:
        """Whether any micro-batch of the iteration was planned (bagualu's policy)."""
        return any(m["planned"] for m in self.micro_batches)

    def spikes(self, threshold: float = SPIKE) -> List[Dict[str, Any]]:
        """The micro-batches whose largest router load factor exceeds ``threshold``."""
        return [m for m in self.micro_batches if m["max_load_factor"] > threshold]

    def downgrades(self) -> List[Dict[str, Any]]:
        """The deferred replans (a router saw more load than the plan was made for, and the
        rest of the forward was downgraded), as samples."""
        return [s for s in self.samples if s["event"] == "downgrade"]

    # -- files ------------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "policy": self.policy, "device": self.device,
                "capacity_bytes": self.capacity_bytes,
                "plan_capacity_bytes": self.plan_capacity_bytes, "iteration": self.iteration,
                "samples": self.samples, "micro_batches": self.micro_batches,
                "line": self.line}

    @classmethod
    def from_dict(cls, doc: Dict[str, Any]) -> "Recording":
        if doc.get("format") != FORMAT:
            raise ValueError(f"not a recorded iteration (format {doc.get('format')!r}, "
                             f"expected {FORMAT!r})")
        rec = cls(doc.get("policy", ""), doc.get("device", ""), doc.get("capacity_bytes", 0))
        rec.plan_capacity_bytes = int(doc.get("plan_capacity_bytes", 0))
        rec.iteration = doc.get("iteration")
        rec.samples = list(doc["samples"])
        rec.micro_batches = list(doc["micro_batches"])
        rec.line = doc.get("line")
        return rec

    def save(self, path: Union[str, Path]) -> Path:
        """Writes the recording as JSON (what ``python -m bagualu.plot`` reads)."""
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1, default=_jsonable))
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Recording":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def write_csv(self, path: Union[str, Path]) -> Path:
        """The samples as CSV: t_ms, event, micro_batch, chunk, the three series, evictions."""
        path = Path(path)
        cols = ["t_ms", "event", "micro_batch", "chunk", *SERIES, "evictions"]
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for s in self.samples:
                w.writerow(["" if s.get(c) is None else s.get(c) for c in cols])
        return path


def _jsonable(value: Any) -> Any:
    """What json cannot write itself (a float('inf') budget is written as null by the line)."""
    return str(value)


class Recorder:
    """Samples the runtime ``rt`` into a Recording while attached (module docstring)."""

    WRAPPED = ("begin_iteration", "step_point", "forward", "backward", "observe_router",
               "end_iteration")

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.recording = Recording()
        self._t0 = time.perf_counter()
        self._evictions0 = 0
        self._mb: Dict[int, Dict[str, Any]] = {}        # unit -> its micro-batch dict
        self._live: Dict[int, Optional[int]] = {}       # unit -> planned contribution (None:
        #                                                  running, counts what it holds)
        self._gate_plan: Optional[Dict[str, Any]] = None  # the last deferred replan's plan
        self._reset()

    # -- the iteration ----------------------------------------------------------------------
    def _reset(self) -> None:
        rt = self.rt
        rec = Recording(rt.policy, str(rt.device), rt.capacity)
        rec.plan_capacity_bytes = int(rt.planning.plan_capacity)
        self.recording = rec
        self._t0 = time.perf_counter()
        self._evictions0 = rt.tracker.counters.get("evictions", 0)
        self._mb = {}
        self._live = {}

    def _allocator_bytes(self) -> int:
        """Activation bytes the allocator holds: the host backend's pool (CPU), else the
        runtime's count of activation bytes (CUDA, where the pool holds everything)."""
        mem = self.rt.memory
        if mem.pool is not None:
            return int(mem.pool.stats().get("allocated_bytes_current", 0))
        return int(mem.counted)

    def sample(self, event: str, unit: Optional[int] = None, **extra: Any) -> Dict[str, Any]:
        t = self.rt.tracker
        planned = 0
        for u, contribution in self._live.items():
            planned += t.layer_bytes(u) if contribution is None else contribution
        s: Dict[str, Any] = {"t_ms": (time.perf_counter() - self._t0) * 1e3, "event": event,
                             "micro_batch": None, "chunk": None,
                             "actual_bytes": self._allocator_bytes(),
                             "layer_bytes": int(t.layer_bytes()), "planned_bytes": int(planned),
                             "evictions": t.counters.get("evictions", 0) - self._evictions0}
        if unit is not None:
            s["micro_batch"], s["chunk"] = unit % _UNIT_STRIDE, unit // _UNIT_STRIDE
        s.update(extra)
        self.recording.samples.append(s)
        return s

    def _micro_batch(self, unit: int) -> Dict[str, Any]:
        m = self._mb.get(unit)
        if m is None:
            m = self._mb[unit] = {
                "micro_batch": unit % _UNIT_STRIDE, "chunk": unit // _UNIT_STRIDE,
                "planned": False, "predicted_bytes": None, "point_predicted_bytes": None,
                "budget_bytes": None,
                "in_use_bytes": None, "plan_load_factor": None, "forward_ms": None,
                "backward_ms": None, "actual_bytes": None, "load_factor": None,
                "max_load_factor": 0.0, "strategies": {}, "downgrades": 0, "evictions": 0}
            self.recording.micro_batches.append(m)
        return m

    # -- the wrappers -----------------------------------------------------------------------
    def attach(self) -> None:
        rt = self.rt
        orig = {name: getattr(rt, name) for name in self.WRAPPED}
        self._orig = orig

        def begin_iteration() -> None:
            orig["begin_iteration"]()
            self._reset()
            self.sample("begin")

        def step_point(phase: str, forward_mb: Optional[int], backward_mb: Optional[int],
                       forward_chunk: int = 0, backward_chunk: int = 0) -> Any:
            plan = orig["step_point"](phase, forward_mb, backward_mb, forward_chunk,
                                      backward_chunk)
            if forward_mb is not None:
                unit = rt.unit_id(forward_mb, forward_chunk)
                m = self._micro_batch(unit)
                if plan is not None:
                    m.update(planned=True, predicted_bytes=int(plan["predicted_bytes"]),
                             point_predicted_bytes=int(plan["predicted_bytes"]),
                             budget_bytes=int(plan["budget_bytes"]),
                             plan_load_factor=float(plan.get("load_factor", 0.0)))
                    m["in_use_bytes"] = int(rt.planning.log.points[-1]["in_use_bytes"]) \
                        if rt.planning.log is not None and rt.planning.log.points else None
                self.sample("point", unit, phase=phase)
            return plan

        @contextmanager
        def forward(mb: int, chunk: int = 0) -> Iterator[None]:
            unit = rt.unit_id(mb, chunk)
            m = self._micro_batch(unit)
            ev0 = rt.tracker.counters.get("evictions", 0)
            self._live[unit] = None
            start = self.sample("forward_begin", unit)["t_ms"]
            with orig["forward"](mb, chunk):
                yield
            held = int(rt.tracker.layer_bytes(unit))
            loads = rt.planning.loads.get(unit) or []
            m.update(actual_bytes=held,
                     load_factor=sum(loads) / len(loads) if loads else None,
                     max_load_factor=max(loads, default=0.0),
                     strategies=self._strategies(unit),
                     evictions=m["evictions"] + rt.tracker.counters.get("evictions", 0) - ev0)
            self._live[unit] = m["predicted_bytes"] if m["planned"] else held
            m["forward_ms"] = [start, self.sample("forward_end", unit)["t_ms"]]

        @contextmanager
        def backward(mb: int, chunk: int = 0) -> Iterator[None]:
            unit = rt.unit_id(mb, chunk)
            start = self.sample("backward_begin", unit)["t_ms"]
            try:
                with orig["backward"](mb, chunk):
                    yield
            finally:
                self._live.pop(unit, None)
                end = self.sample("backward_end", unit)["t_ms"]
                if unit in self._mb:
                    self._mb[unit]["backward_ms"] = [start, end]

        def observe_router(layer: int, load: float) -> bool:
            self._gate_plan = None
            changed = orig["observe_router"](layer, load)
            if changed:
                unit = rt.tracker.micro_batch
                m = self._micro_batch(unit)
                m["downgrades"] += 1
                gate = self._gate_plan or {}
                if m["planned"] and gate.get("predicted_bytes") is not None:
                    m["predicted_bytes"] = int(gate["predicted_bytes"])  # the plan carried out
                self.sample("downgrade", unit, layer=int(layer), load_factor=float(load),
                            predicted_bytes=m["predicted_bytes"])
            return changed

        governor = rt.planning.governor
        if governor is not None:  # the deferred replan's plan, for observe_router above
            gate = governor.plan_after_gate

            def plan_after_gate(*args: Any) -> Any:
                self._gate_plan = gate(*args)
                return self._gate_plan

            governor.plan_after_gate = plan_after_gate

        def end_iteration() -> Dict[str, Any]:
            line = orig["end_iteration"]()
            rec = self.recording
            rec.plan_capacity_bytes = int(rt.planning.plan_capacity)
            rec.iteration = line.get("iteration")
            rec.line = line
            self.sample("end")
            return line

        for name, fn in (("begin_iteration", begin_iteration), ("step_point", step_point),
                         ("forward", forward), ("backward", backward),
                         ("observe_router", observe_router), ("end_iteration", end_iteration)):
            setattr(rt, name, fn)
        self.sample("start")

    def detach(self) -> None:
        for name in self.WRAPPED:
            self.rt.__dict__.pop(name, None)  # the class's own methods again
        if self.rt.planning.governor is not None:
            self.rt.planning.governor.__dict__.pop("plan_after_gate", None)

    def _strategies(self, unit: int) -> Dict[str, int]:
        """How many of the layers' operators had each strategy in ``unit``'s forward (after
        any downgrade)."""
        rt = self.rt
        counts = {s: 0 for s in STRATEGIES}
        for ops in rt.layer_ops.values():
            for op in ops:
                s = rt.strategies.of(op, unit)
                counts[s] = counts.get(s, 0) + 1
        return counts


_open: Optional[Tuple[Recorder, "RecordingSession"]] = None
_last: Optional[Recording] = None


class RecordingSession:
    """What ``record_iteration()`` returns: recording runs from the call until ``stop()`` (or
    the end of its ``with`` block); ``recording`` holds the last iteration begun meanwhile (or
    what ran, when none began)."""

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder
        self.stopped = False

    @property
    def recording(self) -> Recording:
        return self._recorder.recording

    def stop(self) -> Recording:
        """Stops recording (the runtime's methods are its own again); returns the recording.
        Calling it again does nothing more."""
        global _open, _last
        if not self.stopped:
            self._recorder.detach()
            self.stopped = True
            if _open is not None and _open[1] is self:
                _open = None
            _last = self._recorder.recording
        return self._recorder.recording

    def __enter__(self) -> Recording:
        return self.recording

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def record_iteration() -> RecordingSession:
    """Starts recording the installed runtime's activation memory over time; wrap one
    iteration (``with bagualu.record_iteration() as rec:`` around ``begin_iteration()`` ...
    ``end_iteration()``, or call ``stop()`` on what it returns). Several iterations inside
    keep the last one begun. ``bagualu.plot_iteration(path)`` draws the last recording
    stopped. BagualuError when bagualu is not installed or a recording is open."""
    global _open
    rt = _active.runtime
    if rt is None:
        raise BagualuError("bagualu is not installed: call bagualu.install() first")
    if _open is not None and not _open[1].stopped:
        if _open[0].rt is rt:
            raise BagualuError("an iteration is being recorded already (stop() it first)")
        _open[1].stop()  # its runtime was uninstalled
    recorder = Recorder(rt)
    recorder.attach()
    session = RecordingSession(recorder)
    _open = (recorder, session)
    return session


def last_recording() -> Optional[Recording]:
    """The recording stopped last in this process, or None."""
    return _last
