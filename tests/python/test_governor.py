"""Bytes are real everywhere: the planners (embedded and daemon) get the installed capacity and
the captured tensor sizes, with a plan-cache budget step sized from the capacity instead."""
from __future__ import annotations

import gc
from typing import Any, Dict

import pytest

import bagualu
from bagualu.governor import Governor, budget_step_bytes
from conftest import require_libs, small_stage_forward
from test_torchrun import daemon  # noqa: F401  (the fixture)

CAPACITY = 8 << 20


@pytest.fixture(scope="module")
def model_doc() -> Dict[str, Any]:
    """The planner document of the small MoE stage, captured from one real micro-batch."""
    require_libs()
    loss = small_stage_forward()
    rt = bagualu.current()
    with bagualu.backward(0):
        loss.backward()
    bagualu.end_iteration()
    doc = rt.model_doc
    bagualu.uninstall()
    gc.collect()
    assert doc is not None, "the runtime did not describe the model"
    return doc


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
        captured = _graph_bytes(model_doc)
        assert 0.5 * captured <= plan["keep_all_bytes"] <= 2 * captured
        assert 0 < plan["predicted_bytes"] <= plan["keep_all_bytes"]
        assert plan["budget_bytes"] <= CAPACITY
        gov.report(0, 0, plan["predicted_bytes"])
    finally:
        gov.close()


def test_daemon_session_has_the_real_capacity(model_doc, daemon, tmp_path,  # noqa: F811
                                              monkeypatch) -> None:
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    pytest.importorskip("grpc_tools")
    gov = Governor(daemon, deadline_s=2.0)
    gov.register(model_doc, CAPACITY, 0)
    try:
        assert gov.kind == "remote", "the daemon refused or did not answer"
        sessions = gov.remote.list_sessions()
        assert [s.capacity_bytes for s in sessions] == [CAPACITY]  # what bgl-top shows
        remote = gov.plan({"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0,
                           "bytes_in_use": 0})
        assert gov.kind == "remote" and remote is not None
        captured = _graph_bytes(model_doc)
        assert 0.5 * captured <= remote["keep_all_bytes"] <= 2 * captured
        assert 0 < remote["predicted_bytes"] <= remote["keep_all_bytes"]
        assert remote["budget_bytes"] <= CAPACITY
    finally:
        gov.close()
