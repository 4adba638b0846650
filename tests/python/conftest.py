"""Shared fixtures of the bagualu tests: library paths, a small MoE config, one CPU thread."""
from __future__ import annotations

import gc
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))
torch.set_num_threads(1)

import bagualu  # noqa: E402
from bagualu.native import libs as _lib  # noqa: E402
from moe_model import MoEConfig  # noqa: E402


def small_config() -> MoEConfig:
    """Two layers, 16 experts (4 local), top-4: expert activations dominate, as in the paper."""
    return MoEConfig(layers=2, hidden=64, heads=2, experts=16, top_k=4, moe_hidden=64,
                     shared_hidden=32, vocab=128, seq_len=32, micro_batch_size=2, ep=4)


@pytest.fixture
def cfg() -> MoEConfig:
    return small_config()


@pytest.fixture(autouse=True)
def _clean_install():
    yield
    bagualu.uninstall()
    gc.collect()


def require_libs() -> None:
    for name in ("libbgl_planner.so", "libbgl_alloc.so", "libbgl_enforce.so"):
        if _lib.find_file(name) is None:
            pytest.skip(f"{name} is not built (set BGL_LIB_DIR or build the CMake targets)")


def small_stage_forward() -> torch.Tensor:
    """Installs bagualu (16 MiB, embedded planner) on the small MoE stage and runs the forward
    of micro-batch 0 of an iteration; returns its loss (backward and end_iteration are the
    caller's)."""
    from moe_model import MoEStage
    torch.manual_seed(0)
    cfg = small_config()
    model = MoEStage(cfg)
    bagualu.install(capacity="16MiB", policy="bagualu", governor="none", pipeline_stages=1,
                    micro_batches=1, log_iterations=False)
    bagualu.instrument(model, cfg.info())
    x = torch.randint(0, cfg.vocab, (cfg.micro_batch_size, cfg.seq_len))
    bagualu.begin_iteration()
    bagualu.step_point("steady", 0, None)
    with bagualu.forward(0):
        return model(x).float().mean()


# -- Checks against plain PyTorch (issue 24) -----------------------------------------------

def assert_grads(ref: dict, got: dict, count: int, rel_l2: float = 0.0, what: str = "") -> float:
    """The gradients of a bagualu run against plain PyTorch's (same seeds and data): the same
    ``count`` parameters in both, and bit for bit (``rel_l2`` 0) or within ``rel_l2`` relative
    L2 over all of them together. Returns the relative L2 error."""
    assert len(ref) == count, f"{what}: plain PyTorch has {len(ref)} gradients, not {count}"
    assert sorted(got) == sorted(ref), f"{what}: gradients of other parameters"
    names = sorted(ref)
    a = torch.cat([ref[n].detach().flatten().double() for n in names])
    b = torch.cat([got[n].detach().flatten().double() for n in names])
    assert bool(a.abs().sum() > 0), f"{what}: plain PyTorch's gradients are all zero"
    err = float((a - b).norm() / a.norm())
    if rel_l2 == 0.0:
        for n in names:
            assert torch.equal(ref[n], got[n]), f"{what}: {n} differs (relative L2 {err:.3g})"
    else:
        assert err <= rel_l2, f"{what}: gradients {err:.4%} from plain PyTorch's (> {rel_l2:.0%})"
    return err


def calibration_file(tmp_path, overlap: float) -> str:
    """A calibration file of the host backend whose copies overlap compute (``overlap`` 1,
    the copy threads) or not (0: synchronous copies); its path."""
    import json
    doc = {"gpu": "host", "copy_overlap": overlap, "source": "test",
           "rooflines": {"offload": {"launch_floor_us": 1, "peak_GBps": 8},
                         "reload": {"launch_floor_us": 1, "peak_GBps": 8}}}
    path = tmp_path / f"overlap{overlap}.json"
    path.write_text(json.dumps(doc))
    return str(path)


class PlannerSpy:
    """Records the model document and options of every planner the package creates, so a
    test can ask the planner's own C API (through the package's binding) what it predicts."""

    def __init__(self, monkeypatch) -> None:
        from bagualu.planning import embedded
        self.made: list = []
        self._cls = embedded.EmbeddedPlanner
        real = embedded.EmbeddedPlanner.__init__

        def init(planner, model, options=None):
            self.made.append((model, options))
            real(planner, model, options)

        monkeypatch.setattr(embedded.EmbeddedPlanner, "__init__", init)

    def memory_model_errors(self, accuracy: list, forwards: int) -> list:
        """Relative errors of the planner's keep-all bytes (bgl_planner_plan's keep_all_bytes at
        each micro-batch's observed load) against the bytes PyTorch saved in its layers at that
        load, per (load, predicted, captured) sample of an unmitigated run of ``forwards``
        micro-batch forwards. The capture's own sample (the description was made from it) is
        left out: the first, when every forward gave one (the OpBlock path describes the stage
        after the capture's forward, so the capture gives none there)."""
        assert self.made, "no planner was created"
        assert len(accuracy) in (forwards, forwards - 1), (len(accuracy), forwards)
        samples = accuracy[1:] if len(accuracy) == forwards else accuracy
        model, options = self.made[-1]
        planner = self._cls(model, options)
        errors = []
        try:
            for load, _, captured in samples:
                planner.reset_iteration()
                plan = planner.plan({"phase": "steady", "forward_micro_batch": 0,
                                     "load_factor": float(load)})
                errors.append(abs(plan["keep_all_bytes"] - captured) / captured)
        finally:
            planner.close()
        return errors


class FakeRpcError(Exception):
    """What grpc raises: code() and details()."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self._code = getattr(pytest.importorskip("grpc").StatusCode, code)
        self._details = details

    def code(self) -> Any:
        return self._code

    def details(self) -> str:
        return self._details


def check_torchrun(returncode: int, text: str, ranks: int = 2) -> None:
    """Fails a torchrun run that did not exit 0, showing each rank's own lines: the rank that
    failed first is not always the last to print."""
    if returncode == 0:
        return
    parts = [f"exit status {returncode}"]
    for r in range(ranks):
        own = [ln for ln in text.splitlines() if f"[rank{r}]" in ln]
        # the exceptions a rank raised, the first cause included (a chained traceback's last
        # lines show only the outermost one)
        raised = [ln for ln in own if re.search(r"\w+(Error|Exception):", ln)]
        lines = "\n".join(own)
        parts.append(f"--- rank {r} raised:\n" + "\n".join(raised[:8]))
        parts.append(f"--- rank {r}:\n{lines[-2500:]}")
    parts.append(f"--- tail:\n{text[-2000:]}")
    raise AssertionError("\n".join(parts))


@pytest.fixture(scope="module")
def model_doc() -> Any:
    """The planner document of the small MoE stage, captured from one real micro-batch."""
    require_libs()
    loss = small_stage_forward()
    with bagualu.backward(0):
        loss.backward()
    bagualu.end_iteration()
    doc = bagualu.model_document()
    bagualu.uninstall()
    gc.collect()
    assert doc is not None, "the runtime did not describe the model"
    return doc
