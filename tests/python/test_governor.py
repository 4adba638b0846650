"""Bytes are real everywhere: the planners (embedded and daemon) get the installed capacity and
the captured tensor sizes, with a plan-cache budget step sized from the capacity instead."""
from __future__ import annotations

import json
import logging
import subprocess
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

import bagualu
from bagualu.planning.governor import Backoff, Governor, budget_step_bytes
from bagualu.planning.embedded import EmbeddedPlanner
from bagualu.planning.remote import RemoteGovernor
from conftest import FakeRpcError, require_libs, small_config
from test_torchrun import daemon, daemon_binary  # noqa: F401  (daemon: the fixture)

CAPACITY = 8 << 20




def _graph_bytes(doc: Dict[str, Any]) -> int:
    """Saved bytes of all the stage's layers at load 1.0, as captured."""
    return doc["layers"] // doc["pp"] * sum(t["bytes"] for t in doc["layer_graph"]["tensors"])


def test_budget_step_follows_the_capacity() -> None:
    assert budget_step_bytes(8 << 20) == 128 << 10  # capacity / 64
    assert budget_step_bytes(10 << 20) == 128 << 10  # rounded down to a power of two
    assert budget_step_bytes(1 << 20) == 64 << 10  # floor
    assert budget_step_bytes(0) == 64 << 10
    assert budget_step_bytes(80 << 30) == 64 << 20  # large GPUs keep the planner's default


def test_embedded_planner_sees_real_bytes(model_doc) -> None:
    gov = Governor("none")
    gov.register(model_doc, CAPACITY, 0)
    try:
        assert gov.kind == "embedded"
        assert gov._options["budget_step_bytes"] == 128 << 10
        # The planner's own description (not a rescaled copy) has the installed capacity.
        assert gov.embedded.description["activation_capacity_bytes"] == CAPACITY
        assert gov.description["activation_capacity_bytes"] == CAPACITY
        described = {t["name"]: t["bytes"] for t in gov.description["tensors"]}
        for t in model_doc["layer_graph"]["tensors"]:  # layer 0 as captured
            assert described["L0." + t["name"]] == t["bytes"]
        plan = gov.plan({"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0,
                         "bytes_in_use": 0})
        assert plan is not None
        # The planner's keep-all bytes are what was captured, to the byte (one micro-batch of
        # every layer of the stage at load 1.0).
        assert plan["keep_all_bytes"] == _graph_bytes(model_doc)
        assert 0 < plan["predicted_bytes"] <= plan["keep_all_bytes"]
        assert plan["budget_bytes"] <= CAPACITY
        gov.report(0, 0, plan["predicted_bytes"])
    finally:
        gov.close()


def _threads_at_nice(nice: int) -> int:
    """This process's threads at ``nice`` (Linux: /proc/self/task/<tid>/stat, field 19)."""
    import os
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        count += int(fields[16]) == nice  # field 19 of stat: the 17th after the command
    return count


def test_the_embedded_planners_refiner_runs_at_nice_19(model_doc, monkeypatch) -> None:
    """In the training process the first answers' refinements take only the CPU training
    leaves (PlannerOptions::refine_nice, docs/planner.md "The anytime path")."""
    import os
    if os.nice(0) >= 19:
        pytest.skip("this process runs at nice 19 already")
    monkeypatch.setenv("BGL_WARM_UP", "0")  # the warm-up's worker runs at 19 too
    before = _threads_at_nice(19)
    gov = Governor("none")
    gov.register(model_doc, CAPACITY, 0)
    try:
        deadline = time.monotonic() + 5
        while _threads_at_nice(19) == before and time.monotonic() < deadline:
            time.sleep(0.005)  # the worker lowers itself as it starts
        assert _threads_at_nice(19) == before + 1
    finally:
        gov.close()
    assert _threads_at_nice(19) == before


def test_reproducible_plans_search_every_miss_on_the_call(model_doc, monkeypatch) -> None:
    """BGL_REPRODUCIBLE_PLANS=1: no first answers and no refiner thread (a miss is the full
    search on the call), the downgrade's search unpriced; the plans equal those of the full
    search whatever the threads' speed. Off (the default) the misses are first answers."""
    import os
    monkeypatch.setenv("BGL_WARM_UP", "0")
    point = {"phase": "steady", "forward_micro_batch": 0, "load_factor": 2.0, "bytes_in_use": 0}
    firsts = {}
    for value in ("1", "0"):
        monkeypatch.setenv("BGL_REPRODUCIBLE_PLANS", value)
        before = _threads_at_nice(19) if os.nice(0) < 19 else None
        gov = Governor("none")
        gov.register(model_doc, _graph_bytes(model_doc), 0)  # at load 2 half of keep-all fits
        try:
            time.sleep(0.2)  # a refiner, if any, has lowered itself by now
            if before is not None:
                assert _threads_at_nice(19) == before + (0 if value == "1" else 1), value
            plan = gov.plan(dict(point))
            firsts[value] = plan["first_answer"]
            assert gov.embedded.stats()["first_answers"] == (0 if value == "1" else 1)
        finally:
            gov.close()
    assert firsts == {"1": False, "0": True}


def _registered_remotely(model_doc: Dict[str, Any], daemon: str, tmp_path,
                         monkeypatch) -> Governor:
    """A Governor registered with the test's daemon (the test closes it)."""
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("grpc_tools")
    gov = Governor(daemon, deadline_s=2.0)
    gov.register(model_doc, CAPACITY, 0)
    if gov.kind != "remote":
        gov.close()
        pytest.fail("the daemon refused or did not answer")
    return gov


def test_registering_again_replaces_the_session_on_the_daemon(
        model_doc, daemon, tmp_path, monkeypatch, caplog) -> None:  # noqa: F811
    """The stage registered again (its measured backward time): the daemon holds one session
    for the process throughout, the new one, and the old id is unknown to it."""
    gov = _registered_remotely(model_doc, daemon, tmp_path, monkeypatch)
    try:
        first = gov.remote.session_id
        with caplog.at_level(logging.DEBUG, logger="bagualu"):
            gov.register(model_doc, CAPACITY, 0)
        assert gov.kind == "remote" and gov.remote.session_id != first
        assert [s.session_id for s in gov.remote.list_sessions()] == [gov.remote.session_id]
        ended = [r.getMessage() for r in caplog.records if "ending the old session" in
                 r.getMessage()]
        assert ended and "NOT_FOUND" in ended[0], ended  # the daemon had ended it already
    finally:
        gov.close()


def test_daemon_session_has_the_real_capacity(model_doc, daemon, tmp_path,  # noqa: F811
                                              monkeypatch) -> None:
    gov = _registered_remotely(model_doc, daemon, tmp_path, monkeypatch)
    try:
        sessions = gov.remote.list_sessions()
        assert [s.capacity_bytes for s in sessions] == [CAPACITY]  # what bgl-top shows
        remote = gov.plan({"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0,
                           "bytes_in_use": 0})
        assert gov.kind == "remote" and remote is not None
        assert remote["keep_all_bytes"] == _graph_bytes(model_doc)  # the daemon's, as captured
        assert 0 < remote["predicted_bytes"] <= remote["keep_all_bytes"]
        assert remote["budget_bytes"] <= CAPACITY
    finally:
        gov.close()


def test_disallowed_strategies_reach_the_daemons_plans(model_doc, daemon, tmp_path,  # noqa: F811
                                                        monkeypatch) -> None:
    """install(allow_fp8=False) against the daemon: the registration says so and no plan of the
    session stores in FP8 (the losses of such a run are plain PyTorch's bit for bit). On a
    machine whose FP8 cast costs next to nothing and whose copies and recomputes are dear, the
    same point is planned with FP8 where only offloads are disallowed."""
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("grpc_tools")
    calibration = {"gpu": "host", "peak_tflops": 0.01, "hbm_GBps": 1, "copy_overlap": 0.0,
                   "rooflines": {"offload": {"peak_GBps": 0.01}, "reload": {"peak_GBps": 0.01},
                                 "fp8_cast": {"peak_GBps": 1e4}}}
    used = {}
    for fp8 in (True, False):
        gov = Governor(daemon, deadline_s=2.0)
        gov.register(model_doc, CAPACITY, 0, allow_offload=False, allow_fp8=fp8,
                     calibration=calibration)
        try:
            assert gov.kind == "remote", "the daemon refused or did not answer"
            keep_all = _graph_bytes(model_doc)
            plan = gov.plan({"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0,
                             "bytes_in_use": CAPACITY - keep_all * 7 // 10})
            assert gov.kind == "remote" and plan is not None
            assert plan["budget_bytes"] < plan["keep_all_bytes"], plan["budget_bytes"]
            used[fp8] = {o["strategy"] for o in plan["operators"]}
        finally:
            gov.close()
    assert "fp8" in used[True] and "offload" not in used[True], used
    assert "fp8" not in used[False] and "offload" not in used[False], used
    assert "recompute" in used[False], used


# -- the daemon goes away and comes back --------------------------------------------------------

class Daemon:
    """bgl-governord on one socket, which a test kills and starts again (a restarted daemon
    knows no session)."""

    def __init__(self, tmp_path, flags: Sequence[str] = ()) -> None:
        self.flags = list(flags)
        self.binary = daemon_binary()
        self.sock = tmp_path / "governor.sock"
        self.log = tmp_path / "daemon.log"
        self.address = f"unix://{self.sock}"
        self.proc: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([str(self.binary), "--listen", self.address,
                                          "--metrics-port", "0", *self.flags],
                                         stdout=log, stderr=subprocess.STDOUT)
        for _ in range(200):  # up to ~10 s on a loaded machine
            if self.proc.poll() is not None:
                break
            probe = RemoteGovernor(self.address)  # a new channel: no reconnect backoff
            try:
                probe.probe(0.2)
                return
            except Exception:
                time.sleep(0.05)
            finally:
                probe.close()
        pytest.fail(f"bgl-governord did not start: {self.log.read_text()[-2000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def sessions(self) -> List[Any]:
        remote = RemoteGovernor(self.address, deadline_s=2.0)
        try:
            return remote.list_sessions()
        finally:
            remote.close()


@pytest.fixture
def restartable(tmp_path, monkeypatch):
    pytest.importorskip("grpc_tools")
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    d = Daemon(tmp_path)
    d.start()
    yield d
    d.stop()


class StepClock:
    """A clock that only the test moves, so that retries follow plan points, not the speed
    of the machine."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _messages(caplog, text: str) -> List[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def _strategies(plan: Dict[str, Any]) -> List[str]:
    return [o["strategy"] for o in plan["operators"]]


def test_backoff_doubles_up_to_its_cap_with_jitter() -> None:
    b = Backoff(rand=lambda: 0.0)  # no jitter drawn: the nominal delays
    assert [round(b.next_delay(), 6) for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    b.reset()
    assert b.next_delay() == pytest.approx(0.1)
    shortest = Backoff(rand=lambda: 1.0)  # the most jitter takes 20% off
    assert [round(shortest.next_delay(), 6) for _ in range(3)] == [0.08, 0.16, 0.32]
    with pytest.raises(ValueError, match="initial <= maximum"):
        Backoff(initial=3.0, maximum=2.0)


def test_absent_daemon_is_retried_only_at_plan_points_after_the_delay(
        model_doc, tmp_path, monkeypatch, caplog) -> None:
    """Nothing listens: plan points before the backoff deadline do not touch the socket; each
    retry after it is one fail-fast probe; the outage is logged once."""
    pytest.importorskip("grpc_tools")
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    probes: List[float] = []
    real_probe = RemoteGovernor.probe

    def counting_probe(self, timeout_s):
        probes.append(clock.now)
        return real_probe(self, timeout_s)

    monkeypatch.setattr(RemoteGovernor, "probe", counting_probe)
    clock = StepClock()
    gov = Governor(f"unix://{tmp_path / 'nobody.sock'}", deadline_s=0.05,
                   backoff=Backoff(rand=lambda: 0.0), clock=clock)
    point = {"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0, "bytes_in_use": 0}
    with caplog.at_level(logging.DEBUG, logger="bagualu"):
        gov.register(model_doc, CAPACITY, 0)
        try:
            assert gov.kind == "embedded"
            for _ in range(50):  # the clock stands still: no probe at all
                assert gov.plan(point) is not None
            assert probes == []
            for _ in range(40):  # 0.25 s per plan point
                clock.now += 0.25
                assert gov.plan(point) is not None
        finally:
            gov.close()
    # Retries 0.1, 0.2, 0.4, ... 2.0 s after the previous one, at the next plan point.
    assert probes[:5] == [0.25, 0.5, 1.0, 2.0, 3.75]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert max(gaps) == 2.0 and gaps[-1] == 2.0, probes
    assert gov.kind == "embedded" and gov.registrations == 0
    assert len(_messages(caplog, "governor unreachable")) == 1
    assert "planning in-process" in _messages(caplog, "governor unreachable")[0]
    assert _messages(caplog, "governor back") == []


class Trainer:
    """The small MoE stage under bagualu (one stage, two micro-batches, 1F1B) against the
    daemon at ``address``; ``run(n)`` goes through n scheduling points (whole iterations) and
    keeps (governor kind, plan) of every planned forward, and the embedded planner's plan for
    the same call (it is asked every time, so that it is in step for a switch)."""

    def __init__(self, address: str, monkeypatch) -> None:
        import torch
        from moe_model import MoEStage
        torch.manual_seed(0)
        cfg = small_config()
        self.model = MoEStage(cfg)
        self.x = torch.randint(0, cfg.vocab, (cfg.micro_batch_size, cfg.seq_len))
        bagualu.install(capacity="16MiB", policy="bagualu", governor=address,
                        pipeline_stages=1, micro_batches=2, log_iterations=False)
        bagualu.instrument(self.model, cfg.info())
        self.gov: Governor = bagualu.current().governor
        self.plans: List[Tuple[str, Dict[str, Any], Dict[str, Any]]] = []
        self.points = 0
        self.embedded_plans: List[Dict[str, Any]] = []
        real_plan = EmbeddedPlanner.plan

        def recording_plan(planner, point):
            self.embedded_plans.append(real_plan(planner, point))
            return self.embedded_plans[-1]

        monkeypatch.setattr(EmbeddedPlanner, "plan", recording_plan)

    def run(self, points: int, on_point: Optional[Callable[[int], None]] = None) -> None:
        end = self.points + points
        while self.points < end:
            bagualu.begin_iteration()
            losses: Dict[int, Any] = {}
            for phase, f, b in bagualu.schedule.one_f_one_b(2, 1, 0):
                if on_point is not None:
                    on_point(self.points)
                plan = bagualu.step_point(phase, f, b)
                if plan is not None:
                    self.plans.append((self.gov.kind, plan, self.embedded_plans[-1]))
                if f is not None:
                    with bagualu.forward(f):
                        losses[f] = self.model(self.x).float().mean()
                if b is not None:
                    with bagualu.backward(b):
                        losses.pop(b).backward()
                self.points += 1
            bagualu.end_iteration()


def _record_registrations(monkeypatch) -> List[Tuple[str, int, int, int, str]]:
    """(model document as JSON, capacity, pipeline rank, budget step, session id) of every
    successful Register."""
    out: List[Tuple[str, int, int, int, str]] = []
    real_register = RemoteGovernor.register

    def recording_register(self, model, capacity, rank, job_id, gpu_index,
                           budget_step_bytes=0, **options):
        real_register(self, model, capacity, rank, job_id, gpu_index, budget_step_bytes,
                      **options)
        out.append((json.dumps(model, sort_keys=True), capacity, rank, budget_step_bytes,
                    self.session_id))

    monkeypatch.setattr(RemoteGovernor, "register", recording_register)
    return out


def test_daemon_killed_mid_training_comes_back_with_the_same_model(
        restartable, monkeypatch, caplog) -> None:
    """SIGKILL mid-iteration: the next calls plan in-process; the daemon restarted on the same
    socket gets the same model registered again within a few plan points (the clock moves one
    second per scheduling point, the default backoff); one log line each way."""
    require_libs()
    registered = _record_registrations(monkeypatch)
    clock = StepClock()
    with caplog.at_level(logging.INFO, logger="bagualu"):
        t = Trainer(restartable.address, monkeypatch)
        t.gov.clock = clock
        t.run(8)  # capture, registration, one iteration with the daemon
        # Registered at the capture's forward, then again with its measured backward time
        # (the layer graph's backward_ms) after its backward: the daemon takes it, and the
        # first session is ended.
        assert t.gov.kind == "remote" and len(registered) == 2
        graphs = [json.loads(r[0])["layer_graph"] for r in registered]
        assert "backward_ms" not in graphs[0] and graphs[1]["backward_ms"] > 0
        assert dict(graphs[1], backward_ms=None) == dict(graphs[0], backward_ms=None)
        assert [s.session_id for s in restartable.sessions()] == [registered[1][4]]
        first = t.gov.remote.session_id
        down_at, up_at = t.points + 1, t.points + 9  # after F0 (planned remotely), before B0
        restarted_after: List[int] = []  # plans made before the restart

        def on_point(i: int) -> None:
            clock.now += 1.0
            if i == down_at:
                restartable.kill()
            elif i == up_at:
                restartable.start()
                restarted_after.append(len(t.plans))

        t.run(8, on_point)  # 2 iterations: the kill, the outage
        assert t.gov.kind == "embedded" and len(registered) == 2
        t.run(12, on_point)  # the restart at the first point, then 3 iterations
    kinds = [k for k, _, _ in t.plans]
    # Planned by the daemon, in-process during the outage, by the daemon again.
    switch_back = kinds.index("remote", kinds.index("embedded"))
    assert "embedded" not in kinds[switch_back:], kinds
    assert kinds.count("embedded") >= 3, kinds
    # Back after the restart (how many points later depends on the machine's load: a probe of
    # the new daemon may time out, so only the order is checked), and for good.
    assert restarted_after[0] <= switch_back, kinds
    # The same registration as the first, with a new session, which the new daemon has.
    assert len(registered) == 3, registered
    assert registered[2][:4] == registered[1][:4]
    second = t.gov.remote.session_id
    assert registered[2][4] == second != first
    assert [(s.session_id, s.capacity_bytes) for s in restartable.sessions()] == [
        (second, registered[1][1])]
    assert bagualu.stats()["governor"] == "remote"
    # One line each way.
    down = _messages(caplog, "governor unreachable")
    assert len(down) == 1 and restartable.address in down[0] and "in-process" in down[0], down
    assert _messages(caplog, "governor back") == [f"bagualu: governor back: session {second}"]
    # Plans are those of the embedded planner, which saw every call: the daemon's before and
    # after the switch, and its own during the outage.
    for kind, plan, embedded in t.plans:
        assert plan["budget_bytes"] == embedded["budget_bytes"], (kind, plan, embedded)
        assert _strategies(plan) == _strategies(embedded), kind
        assert plan["predicted_bytes"] == embedded["predicted_bytes"], kind


F0 = {"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0, "bytes_in_use": 0}
F1 = {"phase": "steady", "forward_micro_batch": 1, "load_factor": 1.0, "bytes_in_use": 1 << 20}
B0 = {"phase": "cooldown", "backward_micro_batch": 0, "load_factor": 1.0, "bytes_in_use": 0}


def test_restarted_daemon_that_forgot_the_session_gets_it_again(model_doc, restartable,
                                                                 caplog) -> None:
    """The daemon restarts between two calls, so the client's next call reaches the new one,
    which does not know the session (NOT_FOUND): that call is planned in-process, the next
    plan point registers again (no backoff: the daemon answers)."""
    gov = Governor(restartable.address)
    with caplog.at_level(logging.INFO, logger="bagualu"):
        gov.register(model_doc, CAPACITY, 0)
        try:
            assert gov.kind == "remote"
            first = gov.remote.session_id
            plan = gov.plan(F0)
            gov.report(0, 0, plan["predicted_bytes"])
            gov.plan(B0)
            gov.reset_iteration()
            restartable.kill()
            restartable.start()
            assert restartable.sessions() == []
            assert gov.plan(F0) is not None and gov.kind == "embedded"
            assert gov.plan(B0) is not None and gov.kind == "remote"
            second = gov.remote.session_id
            assert second != first and gov.registrations == 2
            assert [s.session_id for s in restartable.sessions()] == [second]
            gov.reset_iteration()
            plan = gov.plan(F0)
            assert gov.kind == "remote" and plan["budget_bytes"] <= CAPACITY
        finally:
            gov.close()
    down = _messages(caplog, "governor unreachable")
    assert len(down) == 1 and f"does not know session {first}" in down[0], down
    assert _messages(caplog, "governor back") == [f"bagualu: governor back: session {second}"]


def test_calls_about_micro_batches_planned_in_process_stay_with_the_daemon(
        model_doc, restartable, monkeypatch) -> None:
    """After the switch back, the new session has not planned the forwards planned in-process:
    the daemon's NOT_FOUND on their report or gate revision is no outage (the client stays
    with the daemon) and the embedded planner, which planned them, answers."""
    doc = dict(model_doc, micro_batches=2)
    gov = Governor(restartable.address)
    gov.register(doc, CAPACITY, 0)
    try:
        assert gov.kind == "remote"
        restartable.kill()
        restartable.start()
        in_process = gov.plan(F0)  # the daemon lost the session: planned in-process
        assert gov.kind == "embedded"
        gov.plan(F1)  # registered again; the daemon plans F1
        assert gov.kind == "remote" and gov.registrations == 2
        gov.report(0, 0, in_process["predicted_bytes"])  # NOT_FOUND from the daemon: ignored
        assert gov.kind == "remote"
        # the embedded planner answers (a revision, or the plan unrevised where it still fits)
        revised = gov.plan_after_gate(0, 0, 0, 1.5)
        assert revised is not None and revised["load_factor"] == 1.5 and "deferred" in revised
        assert gov.kind == "remote"
        assert gov.plan(B0) is not None and gov.kind == "remote"
    finally:
        gov.close()


def test_refused_registration_is_not_retried(model_doc, restartable, monkeypatch,
                                             caplog) -> None:
    """A daemon that refuses the model (INVALID_ARGUMENT) would refuse it again: planning stays
    in-process without retries, and the log says it was refused, not unreachable."""
    attempts: List[int] = []
    real_register = RemoteGovernor.register

    def refused(self, model, *args, **kw):
        attempts.append(1)
        return real_register(self, dict(model, layers=-1), *args, **kw)

    monkeypatch.setattr(RemoteGovernor, "register", refused)
    clock = StepClock()
    gov = Governor(restartable.address, clock=clock)
    with caplog.at_level(logging.WARNING, logger="bagualu"):
        gov.register(model_doc, CAPACITY, 0)
        try:
            for _ in range(10):
                clock.now += 5.0
                assert gov.plan(F0) is not None
                gov.plan(B0)
                gov.reset_iteration()
        finally:
            gov.close()
    assert gov.kind == "embedded" and attempts == [1]
    assert _messages(caplog, "governor unreachable") == []
    refusals = _messages(caplog, "refused the model")
    assert len(refusals) == 1 and "for good" in refusals[0], caplog.text


def test_failed_calls_are_classified() -> None:
    from bagualu.planning.remote import error_kind
    cases = {("UNAVAILABLE", "failed to connect"): "outage",
             ("DEADLINE_EXCEEDED", "Deadline Exceeded"): "outage",
             ("INVALID_ARGUMENT", "load_factor: must be in (0, 64]"): "refused",
             ("NOT_FOUND", "session_id: unknown session"): "lost_session",
             ("NOT_FOUND", "micro_batch: (0, chunk 0) was not planned"): "not_planned",
             ("RESOURCE_EXHAUSTED", "sessions: uid 1000 already has 64 sessions"): "quota",
             ("RESOURCE_EXHAUSTED", "model_json: 5000000 bytes exceed the limit"): "exhausted"}
    for (code, details), kind in cases.items():
        assert error_kind(FakeRpcError(code, details)) == (kind, details)
    assert error_kind(TimeoutError("no connection within 2 s"))[0] == "outage"
    assert error_kind(ImportError("No module named 'grpc'"))[0] == "outage"


@pytest.mark.parametrize("details, retried", [
    ("model_json: 5000000 bytes exceed the limit of 4194304", False),  # would be refused again
    ("sessions: uid 1000 already has 64 sessions (limit 64)", True),  # frees up later
])
def test_registration_over_a_limit(model_doc, monkeypatch, caplog, details, retried) -> None:
    pytest.importorskip("grpc_tools")
    attempts: List[int] = []

    def exhausted(self, *args, **kw):
        attempts.append(1)
        raise FakeRpcError("RESOURCE_EXHAUSTED", details)

    monkeypatch.setattr(RemoteGovernor, "wait_ready", lambda self, timeout_s: None)
    monkeypatch.setattr(RemoteGovernor, "probe", lambda self, timeout_s: None)
    monkeypatch.setattr(RemoteGovernor, "register", exhausted)
    clock = StepClock()
    gov = Governor("unix:///nowhere.sock", clock=clock)
    with caplog.at_level(logging.WARNING, logger="bagualu"):
        gov.register(model_doc, CAPACITY, 0)
        try:
            for _ in range(4):
                clock.now += 5.0
                assert gov.plan(F0) is not None and gov.kind == "embedded"
                gov.plan(B0)
                gov.reset_iteration()
        finally:
            gov.close()
    assert len(attempts) == (5 if retried else 1)  # the first, then one per 5 s
    assert len(caplog.records) == 1 and details in caplog.records[0].getMessage()
    assert ("for good" in caplog.text) != retried


def test_a_plan_over_a_daemon_limit_is_planned_in_process(model_doc, monkeypatch) -> None:
    """RESOURCE_EXHAUSTED on one Plan (e.g. its plan time): the embedded planner answers that
    call, the session stays with the daemon."""
    gov = Governor("none")
    gov.register(model_doc, CAPACITY, 0)

    class Remote:
        session_id = "s-1"

        def plan(self, point):
            raise FakeRpcError("RESOURCE_EXHAUSTED", "plan: took longer than 200 ms")

        def close(self):
            pass

    try:
        gov.remote, gov.kind = Remote(), "remote"
        plan = gov.plan(F0)
        assert plan is not None and plan["predicted_bytes"] > 0
        assert gov.kind == "remote" and isinstance(gov.remote, Remote)
    finally:
        gov.remote = None
        gov.close()


def test_strategy_and_phase_names_come_from_the_proto(tmp_path, monkeypatch) -> None:
    """One vocabulary: the package's strategy names are the proto's enum names, and the
    remote client reads every enum through the generated module (nothing retyped)."""
    pytest.importorskip("grpc_tools")
    from bagualu.planning import remote
    from bagualu.vocabulary import STRATEGIES
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path))
    pb, _ = remote.load_stubs()
    names = {v.number: v.name for v in pb.Strategy.DESCRIPTOR.values}
    assert {remote.enum_name(pb.Strategy, n, "?") for n in names} == set(STRATEGIES)
    for n in names:
        assert STRATEGIES[n] == remote.enum_name(pb.Strategy, n, "?")  # same numbering
    assert remote.enum_name(pb.Strategy, 99, "keep") == "keep"
    assert remote.enum_value(pb.Phase, "PHASE", "cooldown") == pb.PHASE_COOLDOWN
    assert remote.enum_value(pb.Phase, "PHASE", "nonsense") == 0
    assert remote.enum_name(pb.Chain, pb.CHAIN_RECOVER, "?")[:1].upper() == "R"


def test_the_register_request_carries_the_host_costs(tmp_path, monkeypatch) -> None:
    """Issue 42: a calibration's copy_host_us and rerun_host_us reach the RegisterRequest (the
    daemon's session planner charges them: registration_test.cc
    HostCostsReachTheSessionAndItsPlansAreChargedThem); absent, they stay unset (the daemon's
    calibration file's or the profile's apply)."""
    pytest.importorskip("grpc_tools")
    from bagualu.planning import remote
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path))
    pb, _ = remote.load_stubs()
    req = pb.RegisterRequest()
    remote.fill_calibration(req.calibration, {"gpu": "host", "copy_overlap": 0,
                                              "copy_host_us": 120.5, "rerun_host_us": 0}, pb)
    assert req.calibration.copy_host_us == 120.5
    assert req.calibration.HasField("rerun_host_us") and req.calibration.rerun_host_us == 0
    bare = pb.RegisterRequest()
    remote.fill_calibration(bare.calibration, {"gpu": "host"}, pb)
    assert not bare.calibration.HasField("copy_host_us")
    assert not bare.calibration.HasField("rerun_host_us")


def test_fallback_keeps_the_nodes_last_grant(tmp_path, monkeypatch, caplog) -> None:
    """Issue 14: the daemon grants the node's pinned host budget (1 MiB, one session: all of
    it); the enforcer's pinned pool follows; once the daemon is gone, the embedded planner
    plans within the last grant and bandwidth share, and the process says so once."""
    require_libs()
    pytest.importorskip("grpc_tools")
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    d = Daemon(tmp_path, ["--host-budget-bytes=1048576", "--host-floor-bytes=65536",
                          "--node-max-sessions=8"])
    d.start()
    points: List[Dict[str, Any]] = []
    real_plan = EmbeddedPlanner.plan
    monkeypatch.setattr(EmbeddedPlanner, "plan",
                        lambda planner, point: points.append(point) or real_plan(planner, point))
    try:
        with caplog.at_level(logging.INFO, logger="bagualu"):
            t = Trainer(d.address, monkeypatch)
            t.gov.clock = StepClock()
            t.run(4)
            assert t.gov.kind == "remote" and t.gov.grant == 1 << 20
            assert bagualu.stats()["enforcer"]["pinned_capacity"] == 1 << 20
            # The reports carry the process's allocator figures, not just its pinned use (a
            # report's stats are the process's state to the daemon: a missing field reads 0).
            remote = t.gov.remote
            frame = next(iter(remote.stub.Watch(remote.pb.WatchRequest(max_samples=1),
                                                timeout=10)))
            row = frame.gpus[0].processes[0]
            assert row.in_use_bytes > 0 and row.reserved_bytes >= row.in_use_bytes, row
            d.kill()
            t.run(4)
            assert t.gov.kind == "embedded"
    finally:
        d.stop()
    after = [p for kind, p, _ in t.plans if kind == "embedded"]
    assert after and all(p["host_bytes"] <= 1 << 20 for p in after)
    limited = [p for p in points if "host_limit_bytes" in p]
    assert limited and all(p["host_limit_bytes"] == 1 << 20 for p in limited)
    assert len(_messages(caplog, "keeping the node's last host grant")) == 1


def test_a_running_sessions_row_shows_the_plans_it_serves(daemon, tmp_path,  # noqa: F811
                                                          monkeypatch) -> None:
    """Issue 44: bgl-top's row of a running bagualu session is what the process serves its
    micro-batches in flight (InEffect: planned against actual bytes, on the device and on host,
    and the strategy mix), whichever planner made the plans and after the gate's revisions, not
    the daemon's latest plan (a later forward's, which at load 1.0 keeps everything). A 2.6x
    spike on a machine whose copies are cheap and whose recompute and FP8 casts are dear is
    revised to offload: each report's row, read back over Watch right after it, shows the
    offloads and their host bytes."""
    require_libs()
    pytest.importorskip("grpc_tools")
    import grpc
    from bagualu.planning.remote import load_stubs
    from moe_train import train
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    calibration = tmp_path / "cheap-copies.json"
    calibration.write_text(json.dumps({
        "gpu": "host", "peak_tflops": 0.001, "copy_overlap": 1.0,
        "rooflines": {"offload": {"peak_GBps": 1e4}, "reload": {"peak_GBps": 1e4},
                      "fp8_cast": {"peak_GBps": 1e-4}}}))
    monkeypatch.setenv("BGL_CALIBRATION", str(calibration))
    pb, pb_grpc = load_stubs()
    channel = grpc.insecure_channel(daemon)
    watch = pb_grpc.GovernorStub(channel)

    def row_of(session_id: str) -> Any:
        for frame in watch.Watch(pb.WatchRequest(interval_ms=10, max_samples=1), timeout=10):
            rows = [p for g in frame.gpus for p in g.processes
                    if p.session.session_id == session_id]
            assert len(rows) == 1, frame
            return rows[0]

    seen: List[Tuple[Dict[str, Any], Any]] = []
    real_report = RemoteGovernor.report

    def report_then_watch(self, mb: int, chunk: int, actual: int) -> None:
        sent = dict(self.in_effect or {})
        real_report(self, mb, chunk, actual)
        seen.append((sent, row_of(self.session_id)))

    monkeypatch.setattr(RemoteGovernor, "report", report_then_watch)
    try:
        r = train(small_config(), "bagualu", capacity="1.5MiB", iterations=2, micro_batches=4,
                  stages=2, spike_size=2.6, spike_every=6, governor=daemon,
                  log_iterations=False)
    finally:
        channel.close()
    assert r["oom"] is None and r["stats"]["governor"] == "remote", r.get("oom")
    assert seen, "no report reached the daemon"
    offloading = 0
    for sent, row in seen:
        assert sent, "a report without the plans in effect"
        assert row.HasField("in_effect")
        got = row.in_effect
        assert got.micro_batches == sent["micro_batches"] >= 1
        assert (got.planned_bytes, got.actual_bytes) == (sent["planned_bytes"],
                                                         sent["actual_bytes"])
        assert (got.planned_host_bytes, got.actual_host_bytes) == (
            sent["planned_host_bytes"], sent["actual_host_bytes"])
        assert dict(got.strategy_counts) == {k: v for k, v in sent["strategy_counts"].items()
                                             if v}
        if sent["strategy_counts"].get("offload"):
            offloading += 1
            assert got.strategy_counts["offload"] > 0 and got.planned_host_bytes > 0, got
    assert offloading > 0, [s["strategy_counts"] for s, _ in seen]
