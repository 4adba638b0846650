"""An emulated device link (issue 42 item 1; docs/planner.md, "An emulated device link"): a
calibration whose offload and reload rooflines are a GPU's link at this machine's compute, read
by the planner and by the enforcer's copies alike; bad profiles and inputs are clear errors
(exit 2 for the tool)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))

from bagualu.planning import calibration, emulation  # noqa: E402

MEASURED = {"gpu": "host", "peak_tflops": 0.05, "matmul_efficiency": 1, "hbm_GBps": 20,
            "rooflines": {"offload": {"launch_floor_us": 3, "peak_GBps": 9},
                          "reload": {"launch_floor_us": 4, "peak_GBps": 8},
                          "fp8_cast": {"launch_floor_us": 1, "peak_GBps": 0.5}},
            "copy_overlap": 0}


def test_the_link_runs_at_the_gpus_ratio_of_link_to_compute() -> None:
    doc = emulation.emulate(MEASURED, "h200-pcie5")
    gpu = calibration.resolve({"gpu": "h200"}, "h200")
    gpu_tflops = gpu["peak_tflops"] * gpu["matmul_efficiency"]
    scale = 0.05 / gpu_tflops
    link = doc["emulated_link"]
    assert link["stands_for"] == "H200 over PCIe Gen5 x16"
    assert link["compute_scale"] == pytest.approx(scale, rel=1e-5)
    for d, floor in (("offload", 3), ("reload", 4)):
        roof = doc["rooflines"][d]
        # copy seconds per byte over matmul seconds per FLOP: the H200's, here
        assert roof["peak_GBps"] / 0.05 == pytest.approx(54.9 / gpu_tflops, rel=1e-5)
        assert roof["launch_floor_us"] == floor  # this machine's own floor
    assert doc["rooflines"]["fp8_cast"] == MEASURED["rooflines"]["fp8_cast"]  # casts cost theirs
    assert doc["copy_overlap"] == 1 and doc["peak_tflops"] == 0.05
    resolved = calibration.resolve(doc, "emulated", gpu="host")  # the planner reads it as is
    assert resolved["emulated_link"]["stands_for"] == link["stands_for"]
    assert resolved["rooflines"]["offload"]["peak_GBps"] == pytest.approx(
        doc["rooflines"]["offload"]["peak_GBps"])
    faster = emulation.emulate(MEASURED, "gh200-c2c")
    assert faster["rooflines"]["offload"]["peak_GBps"] > 7 * roof["peak_GBps"]


@pytest.mark.parametrize("measured, profile, says", [
    (MEASURED, "h100-pcie", "emulation profile 'h100-pcie' unknown (known: gh200-c2c, h200-pcie5)"),
    ({**MEASURED, "gpu": "h200"}, "h200-pcie5", "of gpu 'h200'"),
    ({**MEASURED, "emulated_link": {"stands_for": "x", "compute_scale": 1e-4}}, "h200-pcie5",
     "an emulated one already"),
    ({**MEASURED, "peak_tflops": -1}, "h200-pcie5", "peak_tflops"),
])
def test_what_cannot_be_emulated_is_named(measured, profile, says) -> None:
    with pytest.raises(calibration.CalibrationError, match=says.replace("(", r"\(").replace(
            ")", r"\)")):
        emulation.emulate(measured, profile)


@pytest.mark.parametrize("section, says", [
    ({"stands_for": "x"}, "lacks 'compute_scale'"),
    ({"compute_scale": 1e-4}, "lacks 'stands_for'"),
    ({"stands_for": "x", "compute_scale": 1e-4, "rate": 3}, "unknown key 'emulated_link.rate'"),
    ({"stands_for": "", "compute_scale": 1e-4}, "emulated_link.stands_for"),
    ({"stands_for": "x", "compute_scale": 5}, "emulated_link.compute_scale"),
    ("fast", "'emulated_link' must be an object"),
])
def test_a_bad_emulated_link_section_is_named_by_the_planner(section, says) -> None:
    with pytest.raises(calibration.CalibrationError, match=says):
        calibration.resolve({**MEASURED, "emulated_link": section}, "calibration", gpu="host")


def test_the_tool_writes_the_calibration_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    src = tmp_path / "measured.json"
    src.write_text(json.dumps(MEASURED))
    out = tmp_path / "h200.json"
    tool = [sys.executable, "-m", "bagualu.planning.emulation"]
    ok = subprocess.run(tool + ["--profile", "h200-pcie5", "--calibration", str(src), "-o",
                                str(out)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "H200 over PCIe Gen5 x16" in ok.stdout and str(out) in ok.stdout
    assert json.loads(out.read_text()) == emulation.emulate(MEASURED, "h200-pcie5")
    calibration.load_file(str(out))  # what BGL_CALIBRATION=out reads
    for args, says in ((["--profile", "tpu"], "unknown"),
                       (["--profile", "h200-pcie5", "--calibration", str(tmp_path / "no")],
                        "not found")):
        bad = subprocess.run(tool + args + ["--calibration", str(src), "-o", str(out)]
                             if "--calibration" not in args else tool + args + ["-o", str(out)],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2, (args, bad.stderr)
        assert says in bad.stderr, bad.stderr


def test_training_with_an_emulated_link_moves_through_it_and_keeps_gradients(
        tmp_path: Path) -> None:
    """install(calibration=an emulated one): the enforcer's copies go over the emulated link
    (stats name it; the copy threads, not the training thread), and an offload changes no
    gradient."""
    import torch
    from torch import nn
    import bagualu

    doc = emulation.emulate(MEASURED, "h200-pcie5")
    for d in ("offload", "reload"):  # fast enough for a test: 50 MB/s
        doc["rooflines"][d]["peak_GBps"] = 0.05
    path = tmp_path / "emulated.json"
    path.write_text(json.dumps(doc))

    class Block(bagualu.OpBlock):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

        def build_steps(self):
            S = bagualu.Step
            return [S("up_proj", "linear", lambda x: torch.relu(self.a(x)), ("x",), ("h",)),
                    S("down_proj", "linear", lambda h: self.b(h), ("h",), ("out",))]

    def grad(strategy: str, calibration_path):
        torch.manual_seed(0)
        m, x = Block(), torch.randn(256, 64)
        bagualu.install(capacity="16MiB", policy="keep-all", governor="none",
                        log_iterations=False, calibration=calibration_path)
        try:
            bagualu.instrument(m)
            bagualu.force_strategies({"up_proj": strategy, "down_proj": strategy})
            with bagualu.forward(0):
                y = m(x).square().sum()
            with bagualu.backward(0):
                y.backward()
            stats = bagualu.stats()
        finally:
            bagualu.uninstall()
        return m.a.weight.grad, stats

    kept, plain_stats = grad("keep", None)
    assert plain_stats["emulated_link"] is None
    moved, stats = grad("offload", str(path))
    assert stats["emulated_link"] == "H200 over PCIe Gen5 x16", stats["emulated_link"]
    assert stats["enforcer"]["offloads"] > 0 and stats["enforcer"]["reloads"] > 0
    assert torch.equal(kept, moved)
