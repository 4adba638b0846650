"""Shared fixtures of the bagualu tests: library paths, a small MoE config, one CPU thread."""
from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

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
