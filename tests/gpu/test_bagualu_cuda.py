"""bagualu on CUDA (tests/gpu/run.sh runs this with pytest on a GPU machine; it skips without
one). Each scenario runs in its own process: see bagualu_cuda.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - the GPU machine has torch
    HAVE_CUDA = False

pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device")


def run(scenario: str, *extra: str, timeout: int = 240) -> dict:
    out = subprocess.run([sys.executable, str(HERE / "bagualu_cuda.py"), scenario, *extra],
                         capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, text[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    print(scenario, json.dumps(_brief(result)))
    return result


def _brief(value):
    """The result without loss lists and zero counters, for the log."""
    if isinstance(value, dict):
        return {k: _brief(v) for k, v in value.items() if k != "losses" and v not in (0, None)}
    return value


def test_install_swaps_the_allocator() -> None:
    r = run("swap")
    assert r["swapped"] and r["math"]
    # 16 MiB input and 16 MiB output came from libbgl_alloc.so's pool.
    assert r["allocator"]["allocated_bytes_current"] >= 32 << 20, r["allocator"]
    assert r["segments"] >= 1


def test_install_after_cuda_init() -> None:
    r = run("late")
    assert "before the first CUDA allocation" in r["strict_message"]
    assert not r["swapped"]
    assert r["finished"] == 2 and r["oom"] is None


def test_enforcement_matches_keep_all_on_the_gpu() -> None:
    r = run("correctness", timeout=400)
    assert r["swapped"]
    for name in ("offload", "recompute", "static-over"):
        assert r[name]["finished"] == 3 and r[name]["oom"] is None, name
        # Bitwise when the kernels are deterministic; never further than float noise.
        assert r[name]["max_rel_loss"] <= 1e-5, (name, r[name])
    assert r["offload"]["tracker"]["offloads"] > 0 and r["offload"]["tracker"]["reloads"] > 0
    # Through the enforcer's pinned pool and copy streams, as on CPU.
    assert r["offload"]["enforcer"]["offloads"] == r["offload"]["tracker"]["offloads"]
    assert r["offload"]["enforcer"]["bytes_h2d"] == r["offload"]["tracker"]["bytes_h2d"]
    assert r["fp8"]["tracker"]["fp8_casts"] > 0
    assert r["fp8"]["max_rel_loss"] <= 0.01, r["fp8"]


def test_unmodified_models_on_the_gpu() -> None:
    """transformers' Mixtral, Qwen3-MoE, DeepSeek-V3 and a plain fused MoE, unchanged."""
    r = run("unmodified", timeout=900)
    assert r["swapped"]
    for name, m in r["models"].items():
        assert m["memory_model"]["mean_error"] < 0.015, (name, m["memory_model"])
        assert m["keep_all_oom_at_half"], name
        assert m["bagualu_oom_at_half"] is None and m["bagualu_same_losses"], (name, m)
        assert m["bagualu_moved"] > 0, name
        assert m["mixed_moved"]["offloads"] > 0 and m["mixed_moved"]["drops"] > 0, name
        # Bitwise when the kernels are deterministic; never further than float noise.
        assert m["mixed_bitwise"] or m["mixed_max_rel_loss"] <= 1e-5, (name, m)
        assert m["fp8_casts"] > 0 and m["fp8_max_rel_loss"] <= 0.01, (name, m)
