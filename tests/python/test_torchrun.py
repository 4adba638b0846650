"""The multi-process pipeline example under torchrun (gloo, 2 stages) against a real
bgl-governord on a temporary socket."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, require_libs
from bagualu import _lib


def daemon_binary() -> Path:
    env = os.environ.get("BGL_GOVERNORD")
    if env and Path(env).is_file():
        return Path(env)
    found = _lib.find_file("bgl-governord")
    if found is None:
        pytest.skip("bgl-governord is not built (build target bgl-governord; BGL_GOVERNORD "
                    "names the binary)")
    return found


@pytest.fixture
def daemon(tmp_path):
    binary = daemon_binary()
    sock = tmp_path / "governor.sock"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([str(binary), "--listen", f"unix://{sock}", "--metrics-port", "0"],
                            stdout=log, stderr=subprocess.STDOUT)
    for _ in range(400):
        if sock.exists() or proc.poll() is not None:
            break
        time.sleep(0.025)
    if proc.poll() is not None or not sock.exists():
        pytest.fail(f"bgl-governord did not start: {(tmp_path / 'daemon.log').read_text()}")
    yield f"unix://{sock}"
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_two_stage_pipeline_against_the_daemon(daemon, tmp_path) -> None:
    require_libs()
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "integrations" / "pytorch" / "examples" / "moe_train.py"),
           "--governor", daemon, "--iterations", "2", "--layers", "2", "--micro-batches", "4",
           "--hidden", "64", "--seq-len", "32", "--capacity", "16MiB", "--spike-every", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} finished 2 iterations governor=remote ooms=0" in text, text[-4000:]
    assert "pipeline ranks [0, 1]" in text, text[-4000:]
