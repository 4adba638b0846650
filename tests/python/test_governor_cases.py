"""The Python package's Governor against the failure table both governor clients follow
(docs/operations.md, "Failed calls"): every case of tests/governor_client_cases.json, on a fake
daemon client that fails one call with the case's status. The C++ RemoteGovernor runs the same
cases (tests/integration/governor_client_cases_test.cc). Retries follow a clock only the test
moves, so they happen at plan points, never by the speed of the machine."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from bagualu.planning import governor as governormod
from bagualu.planning.governor import RETRY_MAX_S, Governor
from bagualu.planning.remote import error_kind
from conftest import FakeRpcError as RpcError

CASES = json.loads((Path(__file__).resolve().parents[1] / "governor_client_cases.json")
                   .read_text())
CAPACITY = 8 << 20
F0 = {"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0, "bytes_in_use": 0}
B0 = {"phase": "cooldown", "backward_micro_batch": 0, "load_factor": 1.0, "bytes_in_use": 0}
FROM_DAEMON = {"from_daemon": True}  # what the fake daemon's plans are


def _name(case: Dict[str, str]) -> str:
    return f"{case['code']}:{case['details'][:24]}"


class FakeDaemon:
    """What the daemon saw: registrations, plans, ended sessions; the next failures to give."""

    def __init__(self) -> None:
        self.registers = 0
        self.plans = 0
        self.ended: List[str] = []
        self.events: List[str] = []  # "register s-N" / "end s-N", in the order they came
        self.fail_plan: Optional[RpcError] = None
        self.fail_register: Optional[RpcError] = None


class FakeRemote:
    """Stands for bagualu.planning.remote.RemoteGovernor (one channel, one session)."""

    daemon = FakeDaemon()

    def __init__(self, address: str, deadline_s: float = 0.5) -> None:
        self.session_id = ""
        self.host_grant = None
        self.stats: Dict[str, Any] = {}

    def wait_ready(self, timeout_s: float) -> None:
        pass

    def probe(self, timeout_s: float) -> None:
        pass

    def register(self, *args: Any, **kw: Any) -> None:
        d = self.daemon
        d.registers += 1
        if d.fail_register is not None:
            error, d.fail_register = d.fail_register, None
            raise error
        self.session_id = f"s-{d.registers}"
        replaces = kw.get("replaces_session_id", "")
        d.events.append(f"register {self.session_id}" + (f" for {replaces}" if replaces else ""))

    def plan(self, point: Dict[str, Any]) -> Dict[str, Any]:
        d = self.daemon
        d.plans += 1
        if d.fail_plan is not None:
            error, d.fail_plan = d.fail_plan, None
            raise error
        return dict(FROM_DAEMON)

    def report(self, mb: int, chunk: int, actual: int) -> None:
        pass

    def reset_iteration(self) -> None:
        pass

    def end_session(self, session_id: str) -> None:
        self.daemon.ended.append(session_id)
        self.daemon.events.append(f"end {session_id}")

    def unregister(self) -> None:
        if self.session_id:
            self.end_session(self.session_id)
            self.session_id = ""

    def close(self) -> None:
        pass


class StepClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now




@pytest.fixture
def fake(monkeypatch) -> FakeDaemon:
    daemon = FakeDaemon()
    monkeypatch.setattr(FakeRemote, "daemon", daemon)
    monkeypatch.setattr(governormod, "RemoteGovernor", FakeRemote)
    return daemon


def test_every_case_is_classified_as_in_the_table() -> None:
    cases = CASES["calls"] + CASES["registrations"]
    assert len(cases) >= 10
    for case in cases:
        assert error_kind(RpcError(case["code"], case["details"])) == \
            (case["kind"], case["details"]), case


@pytest.mark.parametrize("case", CASES["calls"], ids=_name)
def test_failed_planning_call(case, model_doc, fake) -> None:
    clock = StepClock()
    gov = Governor("unix:///fake.sock", clock=clock)
    gov.register(model_doc, CAPACITY, 0)
    try:
        assert gov.kind == "remote" and gov.remote.session_id == "s-1"
        assert gov.plan(F0) == FROM_DAEMON
        gov.plan(B0)
        gov.reset_iteration()

        fake.fail_plan = RpcError(case["code"], case["details"])
        plans = fake.plans + 1
        answer = gov.plan(F0)
        assert fake.plans == plans
        if case["answer"] == "embedded":
            assert answer is not None and answer != FROM_DAEMON  # the embedded planner's
        else:
            assert case["answer"] == "error"
            assert answer is None  # PlannerError: the plan point keeps the previous strategies

        nxt = gov.plan(B0)  # the next call, at the same time
        if case["daemon"] == "kept":
            assert nxt == FROM_DAEMON and fake.plans == plans + 1
            assert gov.remote.session_id == "s-1" and fake.registers == 1
        elif case["daemon"] == "register_again":
            # Registered again at once (no backoff), and the daemon plans that call.
            assert nxt == FROM_DAEMON and fake.registers == 2
            assert gov.remote.session_id == "s-2" and fake.ended == []
        else:
            assert case["daemon"] == "down"
            assert nxt is not None and nxt != FROM_DAEMON
            assert fake.plans == plans and fake.registers == 1  # nothing reached the daemon
            gov.reset_iteration()
            clock.now += RETRY_MAX_S  # past any backoff delay
            assert gov.plan(F0) == FROM_DAEMON
            assert fake.registers == 2 and gov.remote.session_id == "s-2"
            assert fake.ended == ["s-1"]  # the session held before the outage is ended
    finally:
        gov.close()


@pytest.mark.parametrize("case", CASES["registrations"], ids=_name)
def test_failed_registration(case, model_doc, fake) -> None:
    clock = StepClock()
    gov = Governor("unix:///fake.sock", clock=clock)
    fake.fail_register = RpcError(case["code"], case["details"])
    gov.register(model_doc, CAPACITY, 0)
    try:
        assert gov.kind == "embedded" and fake.registers == 1
        for _ in range(3):
            clock.now += RETRY_MAX_S
            plan = gov.plan(F0)
            gov.plan(B0)
            gov.reset_iteration()
        if case["retry"] == "backoff":
            assert fake.registers == 2 and gov.kind == "remote" and plan == FROM_DAEMON
        else:
            assert case["retry"] == "never"
            assert fake.registers == 1 and gov.kind == "embedded"
            assert plan is not None and plan != FROM_DAEMON
    finally:
        gov.close()


def test_registering_again_names_the_session_it_replaces(model_doc, fake) -> None:
    """plans.py's register_backward registers the stage again: the new session names the old
    one, which the daemon swaps out in the node's arbitration at once (the other processes'
    host grants would grow for a moment between an end and a registration); the old one is
    ended after, for a daemon that did not know the field (NOT_FOUND from one that did)."""
    gov = Governor("unix:///fake.sock", clock=StepClock())
    gov.register(model_doc, CAPACITY, 0)
    try:
        gov.register(model_doc, CAPACITY, 0)
        assert fake.events == ["register s-1", "register s-2 for s-1", "end s-1"]
        assert gov.kind == "remote" and gov.remote.session_id == "s-2"
        assert gov.plan(F0) == FROM_DAEMON
    finally:
        gov.close()
    assert fake.events[-1] == "end s-2"
