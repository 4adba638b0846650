"""Calibration (issue 22 item 3): the rooflines bagualu plans with are this machine's, measured
once and cached, or a file the user gives; a missing or bad file is a clear error (exit 2 for
the tools); on the host backend copies are planned as what they are there (synchronous)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))

import bagualu  # noqa: E402
from bagualu.planning import calibration  # noqa: E402
from bagualu.planning.embedded import EmbeddedPlanner  # noqa: E402

MODEL = json.loads((ROOT / "models" / "tiny-moe.json").read_text())


def write(path: Path, doc: Any) -> str:
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return str(path)


# A host whose copies are fast against its compute, so that a plan offloads what it must move.
FAST_COPIES = {"gpu": "host", "peak_tflops": 0.05, "hbm_GBps": 5,
               "rooflines": {"offload": {"launch_floor_us": 1, "peak_GBps": 8},
                             "reload": {"launch_floor_us": 1, "peak_GBps": 8}}}


def plan_at(calibration_doc: Dict[str, Any], capacity: int) -> Dict[str, Any]:
    """A steady-state plan of tiny-moe's stage 0 with only offload allowed, with one and a half
    micro-batches' keep-all in use: the forward must move about half of its activations."""
    p = EmbeddedPlanner(MODEL, {"capacity_bytes": capacity, "allow_fp8": False,
                                "allow_recompute": False, "calibration": calibration_doc})
    try:
        in_use = p.description["keep_all_bytes"] * 3 // 2
        return p.plan({"phase": "steady", "forward_micro_batch": 3, "backward_micro_batch": 0,
                       "load_factor": 1.0, "bytes_in_use": in_use})
    finally:
        p.close()


def activation_capacity(capacity: int) -> Dict[str, int]:
    p = EmbeddedPlanner(MODEL, {"capacity_bytes": capacity, "calibration": FAST_COPIES})
    try:
        return p.description
    finally:
        p.close()


def tight_capacity() -> int:
    """Device bytes whose activation share (the planner's, affine in the capacity) is twice one
    micro-batch's keep-all: stage 0's four micro-batches in flight fit only mitigated."""
    c1, c2 = 1 << 40, 1 << 36
    d1, d2 = activation_capacity(c1), activation_capacity(c2)
    a1, a2 = d1["activation_capacity_bytes"], d2["activation_capacity_bytes"]
    slope = (a1 - a2) / (c1 - c2)
    target = 2 * d1["keep_all_bytes"]
    return int(c2 + (target - a2) / slope)


def test_the_host_backend_plans_copies_as_exposed() -> None:
    """The same plan (offload only) costs its copies in full under the host profile
    (copy_overlap 0: synchronous copies) and nothing where copies overlap compute: the exposed
    overhead is the offload and reload time of the bytes it moves, by the rooflines."""
    capacity = tight_capacity()
    hidden = plan_at(dict(FAST_COPIES, copy_overlap=1), capacity)
    exposed = plan_at(dict(FAST_COPIES, copy_overlap=0), capacity)
    assert hidden["host_bytes"] > 0 and exposed["host_bytes"] > 0, (hidden, exposed)
    assert hidden["overhead_s"] == 0.0
    # At least the copies' bandwidth time of the bytes moved, each way (launch floors extra).
    both_ways = 2 * exposed["host_bytes"] / 8e9
    assert exposed["overhead_s"] >= both_ways * 0.999, (exposed["overhead_s"], both_ways)
    assert calibration.resolve({"gpu": "host"}, "test")["copy_overlap"] == 0
    assert calibration.resolve({"gpu": "h200"}, "test")["copy_overlap"] == 1


def test_a_calibration_file_overrides_the_measurement(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """install(calibration=FILE) plans with the file and measures nothing; without one the
    machine is measured once and cached, and the cache answers the next install."""
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(calibration.ENV, raising=False)
    given = dict(FAST_COPIES, copy_overlap=1, source="test")
    path = write(tmp_path / "cal.json", given)
    rt = bagualu.install(capacity="8MiB", policy="bagualu", governor="none", calibration=path)
    try:
        assert rt.governor.calibration == given
        assert not (tmp_path / "cache").exists()  # nothing measured
    finally:
        bagualu.uninstall()

    rt = bagualu.install(capacity="8MiB", policy="bagualu", governor="none")
    try:
        measured = rt.governor.calibration
        cached = list((tmp_path / "cache").glob("calibration-cpu-*.json"))
        assert len(cached) == 1 and json.loads(cached[0].read_text()) == measured
        # The machine's own numbers, every one the planner takes (resolve checks them).
        assert measured["gpu"] == "host"
        assert measured["copy_overlap"] == 0 or 0.5 <= measured["copy_overlap"] <= 1
        for roof in ("offload", "reload", "fp8_cast"):
            assert measured["rooflines"][roof]["peak_GBps"] > 0
        assert measured["peak_tflops"] > 0 and measured["hbm_GBps"] > 0
        full = calibration.resolve(measured, "measured")
        assert full["rooflines"]["offload"]["peak_GBps"] == measured["rooflines"]["offload"][
            "peak_GBps"]
    finally:
        bagualu.uninstall()
    cached[0].write_text(json.dumps(dict(measured, source="the cache")))
    rt = bagualu.install(capacity="8MiB", policy="bagualu", governor="none")
    try:
        assert rt.governor.calibration["source"] == "the cache"  # read, not measured again
    finally:
        bagualu.uninstall()
    # The plans differ with the file: the embedded planner got it.
    capacity = tight_capacity()
    assert plan_at(given, capacity)["overhead_s"] != plan_at(
        dict(given, copy_overlap=0), capacity)["overhead_s"]


@pytest.mark.parametrize("doc, needle", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ({"gpu": "host", "bogus": 1}, "unknown key 'bogus'"),
    ({"rooflines": {"offload": {"peak_GBps": -5}}}, "rooflines.offload.peak_GBps"),
    ({"copy_overlap": 2}, "copy_overlap"),
    ({"gpu": "a100"}, "unknown hardware profile 'a100'"),
])
def test_a_missing_or_bad_calibration_file_is_a_clear_error(tmp_path: Path, doc: Any,
                                                           needle: str) -> None:
    path = str(tmp_path / "missing.json") if doc is None else write(tmp_path / "cal.json", doc)
    with pytest.raises(calibration.CalibrationError) as e:
        bagualu.install(capacity="8MiB", policy="bagualu", governor="none", calibration=path)
    assert needle in str(e.value) and path in str(e.value), str(e.value)
    with pytest.raises(bagualu.BagualuError):  # nothing stays installed
        bagualu.current()


def test_the_tools_refuse_a_bad_calibration_file_with_exit_2(tmp_path: Path) -> None:
    """bgl-governord and bgl-plan stop at start with exit 2 and a message naming the file and
    the field (a missing file: that it cannot be opened)."""
    build = Path(os.environ.get("BGL_LIB_DIR", ROOT / "build"))
    daemon = Path(os.environ.get("BGL_GOVERNORD", build / "governor" / "daemon" / "bgl-governord"))
    plan = build / "tools" / "bgl-plan" / "bgl-plan"
    bad = write(tmp_path / "bad.json", {"rooflines": {"reload": {"peak_GBps": -1}}})
    sock = f"unix://{tmp_path}/g.sock"
    for argv in ([str(daemon), "--listen", sock, "--metrics-port", "0", "--calibration", bad],
                 [str(plan), "--model", str(ROOT / "models" / "tiny-moe.json"), "--capacity",
                  "1GiB", "--load", "1", "--calibration", bad]):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (argv, r.returncode, r.stderr)
        assert "rooflines.reload.peak_GBps" in r.stderr and "bad.json" in r.stderr, r.stderr
    r = subprocess.run([str(daemon), "--listen", sock, "--metrics-port", "0", "--calibration",
                        str(tmp_path / "none.json")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "cannot open" in r.stderr, r.stderr


def test_the_daemon_plans_with_the_same_calibration(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's calibration reaches bgl-governord (RegisterRequest.calibration, copy_overlap
    included) and its plan is the embedded planner's for the same point; a daemon started with
    --calibration plans every session with the file's rooflines."""
    from test_governor import Daemon
    from bagualu.planning.governor import Governor
    monkeypatch.setenv("BGL_CACHE_DIR", str(tmp_path / "cache"))
    capacity = tight_capacity()
    point = {"phase": "steady", "forward_micro_batch": 3, "backward_micro_batch": 0,
             "load_factor": 1.0}
    doc = dict(FAST_COPIES, copy_overlap=0, kernel_launch_us=3, memory_efficiency=1)
    node_file = write(tmp_path / "node.json", dict(FAST_COPIES, copy_overlap=0))
    for flags, session_doc in (((), doc), (("--calibration", node_file), None)):
        d = Daemon(tmp_path, flags)
        d.start()
        try:
            gov = Governor(d.address, deadline_s=2.0, calibration=session_doc)
            gov.register(MODEL, capacity, 0)
            assert gov.kind == "remote", gov.kind
            in_use = gov.description["keep_all_bytes"] * 3 // 2
            planned = gov.plan(dict(point, bytes_in_use=in_use))
            local = EmbeddedPlanner(MODEL, dict(gov._options, calibration=session_doc or
                                                json.loads(Path(node_file).read_text())))
            try:
                ref = local.plan(dict(point, bytes_in_use=in_use))
            finally:
                local.close()
            assert planned["host_bytes"] == ref["host_bytes"]
            assert planned["overhead_s"] == pytest.approx(ref["overhead_s"], rel=1e-9)
            assert [o["strategy"] for o in planned["operators"]] == [
                o["strategy"] for o in ref["operators"]]
            gov.close()
        finally:
            d.stop()


def test_the_copy_overlap_is_measured_through_the_hooks_against_synchronous_copies(
        monkeypatch) -> None:
    """copy_overlap on the host backend is what the copy threads save where training pays for
    copies: the saved-tensor hooks' own path (Tracker.pack with strategy offload, then the
    unpacks that reload), with the threaded enforcer and with one copying on the calling
    thread (sync_copies), alternating; a result is 0 (planned synchronous) or at least the
    threshold, never more than 1."""
    import torch
    from bagualu.capture.tracker import Tracker
    from bagualu.enforce.enforcer import Enforcer
    from bagualu.enforce.pool import DevicePool

    packs = {True: 0, False: 0}
    init = Tracker.__init__

    def counting_init(self, *args, **kwargs):  # the pack hook is the binding's, per tracker
        init(self, *args, **kwargs)
        pack = self.pack

        def counting(t):
            packs[self.sync_offloads] += 1
            return pack(t)
        self.pack = counting

    monkeypatch.setattr(Tracker, "__init__", counting_init)
    made = []

    def make(sync_copies: bool = False) -> Enforcer:
        made.append(sync_copies)
        return Enforcer(torch.device("cpu"), 64 << 20, borrowed_free_is_safe=False,
                        sync_copies=sync_copies)

    DevicePool(8 << 20)
    enf = make()
    try:
        overlap = calibration._host_overlap(enf, make, 8 << 20)
    finally:
        enf.close()
    assert made == [False, True]
    assert packs[True] == 48 * 6 and packs[False] == 48 * 3  # alone 3 times, then 3 rounds each
    assert overlap == 0 or calibration.OVERLAP_THRESHOLD <= overlap <= 1
