"""The governor daemon over gRPC (proto/bagualu/v1/governor.proto) with short deadlines.

Stubs are generated from the proto with grpcio-tools on first use into a cache directory
(``$BGL_CACHE_DIR`` or ~/.cache/bagualu/proto-<hash>) and imported from there."""
from __future__ import annotations

import hashlib
import importlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from .. import settings
from ..native import libs



def enum_name(enum: Any, value: int, default: str) -> str:
    """The lower-case name of a proto enum value without its prefix (``STRATEGY_FP8`` ->
    'fp8'): the proto is the one vocabulary, nothing is retyped here."""
    try:
        full = enum.Name(value)
    except ValueError:
        return default
    return full.split("_", 1)[1].lower()


def enum_value(enum: Any, prefix: str, name: str) -> int:
    """The value of ``PREFIX_NAME`` in a proto enum; 0 (unspecified) for an unknown name."""
    try:
        return int(enum.Value(f"{prefix}_{name.upper()}"))
    except ValueError:
        return 0


def proto_path() -> Path:
    """The governor's proto: the copy a pip-installed package carries (pyproject.toml), else the
    checkout's."""
    shipped = Path(__file__).resolve().parents[1] / "proto" / "governor.proto"
    if shipped.is_file():
        return shipped
    return libs.repo_root() / "proto" / "bagualu" / "v1" / "governor.proto"


def load_stubs() -> Tuple[Any, Any]:
    """(governor_pb2, governor_pb2_grpc), generated from the repository's proto if needed."""
    if "bgl_governor_pb2" in sys.modules:
        return sys.modules["bgl_governor_pb2"], sys.modules["bgl_governor_pb2_grpc"]
    src = proto_path()
    text = src.read_bytes()
    digest = hashlib.sha256(text).hexdigest()[:16]
    base = settings.cache_dir()
    out = base / f"proto-{digest}"
    if not (out / "bgl_governor_pb2_grpc.py").exists():
        from grpc_tools import protoc  # grpcio-tools
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="proto-", dir=out.parent))
        # A top-level module name that cannot clash with the `bagualu` package.
        (tmp / "bgl_governor.proto").write_bytes(text)
        rc = protoc.main(["protoc", f"-I{tmp}", f"--python_out={tmp}",
                          f"--grpc_python_out={tmp}", str(tmp / "bgl_governor.proto")])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed ({rc}) on {src}")
        try:
            os.replace(tmp, out)
        except OSError:  # another process won the race
            pass
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return importlib.import_module("bgl_governor_pb2"), importlib.import_module(
        "bgl_governor_pb2_grpc")


class RemoteGovernor:
    """One session with bgl-governord. Creating it connects nothing: call wait_ready() (blocks
    until the channel connects) or probe() (one fail-fast call) first."""

    def __init__(self, address: str, deadline_s: float = 0.5) -> None:
        import grpc
        self.pb, pb_grpc = load_stubs()
        self.address = address
        self.deadline = deadline_s
        self.channel = grpc.insecure_channel(address)
        self.host_grant: Optional[int] = None
        # The process's AllocatorStats figures, sent whole with each report: the daemon takes
        # a report's stats as the process's state, so a field left out would read as zero.
        self.stats: Dict[str, Any] = {}
        # The plans in effect (InEffect fields), sent with each report when set.
        self.in_effect: Optional[Dict[str, Any]] = None
        self.stub = pb_grpc.GovernorStub(self.channel)
        self.session_id = ""
        self.operator_names: List[str] = []
        # The daemon's warm-up figures as of the last plan (None: the session does not warm up).
        self.warm_stats: Optional[Dict[str, Any]] = None

    def wait_ready(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for the channel to connect; TimeoutError if it does not."""
        import grpc
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"no connection within {timeout_s:g} s") from None

    def probe(self, timeout_s: float) -> None:
        """One cheap call that fails at once when nothing listens on the socket (no wait for
        the channel), and after ``timeout_s`` when something listens but does not answer."""
        self.stub.ListSessions(self.pb.ListSessionsRequest(), timeout=timeout_s)

    def register(self, model: Dict[str, Any], capacity: int, rank: int, job_id: str,
                 gpu_index: int, budget_step_bytes: int = 0, dual_batch: bool = True,
                 calibration: Optional[Dict[str, Any]] = None, allow_offload: bool = True,
                 allow_fp8: bool = True, warm_spike_bound: Optional[float] = None,
                 replaces_session_id: str = "") -> None:
        """budget_step_bytes: the plan cache's budget bucket (0: the daemon's 64 MiB);
        dual_batch False: plans issue in program order (serial); calibration: the machine's
        rooflines (planning/calibration.py), as the embedded planner gets them;
        allow_offload, allow_fp8 False: no plan of the session uses that strategy;
        warm_spike_bound: the daemon warms up to that load (RegisterRequest.warm_up, issue 43;
        None: no warm-up), sharing the plans with the job's other ranks of the same stage;
        replaces_session_id: this process's earlier session, which the new one replaces in the
        node's arbitration at once (the daemon ends it; an unknown one is ignored)."""
        import json
        req = self.pb.RegisterRequest(
            gpu_uuid=f"host-{gpu_index}", gpu_index=gpu_index, pid=os.getpid(), job_id=job_id,
            pipeline_rank=rank, capacity_bytes=int(capacity), model_json=json.dumps(model),
            disable_dual_batch=not dual_batch, budget_step_bytes=int(budget_step_bytes),
            disallow_offload=not allow_offload, disallow_fp8=not allow_fp8,
            replaces_session_id=replaces_session_id)
        if calibration:
            fill_calibration(req.calibration, calibration, self.pb)
        if warm_spike_bound is not None:
            req.warm_up.spike_bound = float(warm_spike_bound)
        resp = self.stub.Register(req, timeout=max(self.deadline, 2.0))
        self.session_id = resp.session_id
        self.host_grant = int(resp.host_grant_bytes) or None  # the node's pinned host grant
        self.operator_names = list(resp.operator_names)

    def _plan(self, req: Any) -> Dict[str, Any]:
        resp = self.stub.Plan(req, timeout=self.deadline)
        p = resp.plan
        pb = self.pb
        if resp.HasField("warm_up"):  # the warm-up's figures, as the embedded planner's stats
            w = resp.warm_up
            self.warm_stats = {"warm_keys": w.keys, "warm_hits": w.hits,
                               "warm_shared_hits": w.shared_hits,
                               "warm_submitted": w.submitted, "warm_done": w.done,
                               "warm_complete": w.complete, "warm_cpu_s": w.cpu_s,
                               "warm_shared_keys": w.shared_keys}
        return {
            # The node's arbitration (issue 14): 0 from a daemon without a node budget.
            "host_grant_bytes": resp.host_grant_bytes or None,
            "bandwidth_share": resp.bandwidth_share or None,
            "phase": enum_name(pb.Phase, p.phase, "unspecified"), "micro_batch": p.micro_batch,
            "chunk": p.chunk, "load_factor": p.load_factor, "budget_bytes": p.budget_bytes,
            "free_bytes": p.free_bytes, "k": p.k, "infeasible": p.infeasible,
            "m0_bytes": p.m0_bytes, "keep_all_bytes": p.keep_all_bytes,
            "predicted_bytes": p.predicted_bytes, "host_bytes": p.host_bytes,
            "overhead_s": p.overhead_s, "serial_s": p.serial_s, "overlapped_s": p.overlapped_s,
            "fallback_full_recompute": p.fallback_full_recompute, "deferred": p.deferred,
            "cache_hit": p.cache_hit, "first_answer": p.first_answer, "refined": p.refined,
            "warm": p.warm, "nearest": p.nearest,
            "operators": [{"name": self.operator_names[i] if i < len(self.operator_names)
                           else str(i), "strategy": enum_name(pb.Strategy, s, "keep")}
                          for i, s in enumerate(p.strategies)],
            "issue_order": [{"round": it.round,
                             "chain": enum_name(pb.Chain, it.chain, "?")[:1].upper(),
                             "stage": it.stage,
                             "resource": enum_name(pb.Resource, it.resource, "?"),
                             "duration_s": it.duration_s, "first": it.first, "last": it.last,
                             "label": it.label}
                            for it in p.issue_order],
        }

    def plan(self, point: Dict[str, Any]) -> Dict[str, Any]:
        kw: Dict[str, Any] = {"session_id": self.session_id,
                              "phase": enum_value(self.pb.Phase, "PHASE",
                                                  point.get("phase", "") or "unspecified"),
                              "forward_chunk": int(point.get("forward_chunk", 0)),
                              "backward_chunk": int(point.get("backward_chunk", 0)),
                              "load_factor": float(point.get("load_factor", 1.0))}
        for key in ("forward_micro_batch", "backward_micro_batch", "bytes_in_use"):
            if point.get(key) is not None:
                kw[key] = int(point[key])
        return self._plan(self.pb.PlanRequest(**kw))

    def plan_after_gate(self, mb: int, chunk: int, layer: int, load: float) -> Dict[str, Any]:
        gate = self.pb.GateObservation(micro_batch=mb, chunk=chunk, gate_layer=layer,
                                       observed_load_factor=float(load))
        return self._plan(self.pb.PlanRequest(session_id=self.session_id, gate=gate))

    def report(self, mb: int, chunk: int, actual: int) -> None:
        """What the forward of (mb, chunk) retained, with the process's allocator figures
        (``stats``, set by the caller; none: the daemon counts the planner's bytes) and the
        plans in effect (``in_effect``, set by the caller)."""
        stats = self.pb.AllocatorStats(**self.stats) if self.stats else None
        in_effect = self.pb.InEffect(**self.in_effect) if self.in_effect else None
        self.stub.Report(self.pb.ReportRequest(session_id=self.session_id, micro_batch=mb,
                                               chunk=chunk, actual_bytes=int(actual),
                                               stats=stats, in_effect=in_effect),
                         timeout=self.deadline)

    def reset_iteration(self) -> None:
        """The daemon follows the schedule itself; nothing to send."""

    def list_sessions(self) -> List[Any]:
        return list(self.stub.ListSessions(self.pb.ListSessionsRequest(),
                                           timeout=self.deadline).sessions)

    def unregister(self) -> None:
        if self.session_id:
            self.end_session(self.session_id)
            self.session_id = ""

    def end_session(self, session_id: str) -> None:
        """Ends a session of this process on the daemon (this one, or the one held before an
        outage, which the daemon may still hold)."""
        self.stub.Unregister(self.pb.UnregisterRequest(session_id=session_id),
                             timeout=self.deadline)

    def close(self) -> None:
        self.channel.close()


def error_kind(error: BaseException) -> Tuple[str, str]:
    """What a failed call means, and the daemon's message (or the error's text):

    - "refused": the daemon understood and refused the request (INVALID_ARGUMENT,
      FAILED_PRECONDITION, OUT_OF_RANGE): a planning error, which the embedded planner would
      repeat;
    - "lost_session": NOT_FOUND on the session id: the daemon does not know the session (it
      restarted, or reaped it); register again;
    - "not_planned": another NOT_FOUND (a micro-batch the session never planned, e.g. one the
      embedded planner planned before the switch back to the daemon);
    - "quota": RESOURCE_EXHAUSTED on the daemon's session quota ("sessions: ..."), which
      frees up when other sessions end;
    - "exhausted": another RESOURCE_EXHAUSTED: the request exceeds one of the daemon's limits
      (a size, a plan time), and would again;
    - "outage": anything else (UNAVAILABLE, DEADLINE_EXCEEDED, grpc missing, ...)."""
    code = getattr(error, "code", None)
    name = getattr(code(), "name", "") if callable(code) else ""
    details = error.details() if callable(getattr(error, "details", None)) else None
    text = details if details else str(error)
    if name in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE"):
        return "refused", text
    if name == "NOT_FOUND":
        return ("lost_session" if text.startswith("session_id") else "not_planned"), text
    if name == "RESOURCE_EXHAUSTED":
        return ("quota" if text.startswith("sessions") else "exhausted"), text
    return "outage", text


def fill_calibration(out: Any, doc: Dict[str, Any], pb: Any) -> None:
    """The RegisterRequest's Calibration from a calibration document (its fields the proto
    carries; the rest are the profile's on both planners: planning/calibration.py writes none
    of them)."""
    out.gpu_profile = str(doc.get("gpu", ""))
    for name, roof in (doc.get("rooflines") or {}).items():
        target = getattr(out, name)
        target.launch_floor_us = float(roof.get("launch_floor_us", 0))
        target.peak_gbps = float(roof.get("peak_GBps", 0))
    for key, field in (("peak_tflops", "peak_tflops"), ("matmul_efficiency", "matmul_efficiency"),
                       ("hbm_GBps", "hbm_gbps"), ("memory_efficiency", "memory_efficiency"),
                       ("kernel_launch_us", "kernel_launch_us")):
        if key in doc:
            setattr(out, field, float(doc[key]))
    for key in ("copy_overlap", "copy_host_us", "rerun_host_us"):  # optional: absent stays so
        if key in doc:
            setattr(out, key, float(doc[key]))
