"""The multi-process pipeline example under torchrun (gloo, 2 stages) against a real
bgl-governord on a temporary socket."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT, check_torchrun, require_libs
from bagualu.native import libs as _lib


def daemon_binary() -> Path:
    env = os.environ.get("BGL_GOVERNORD")
    if env and Path(env).is_file():
        return Path(env)
    found = _lib.find_file("bgl-governord")
    if found is None:
        pytest.skip("bgl-governord is not built (build target bgl-governord; BGL_GOVERNORD "
                    "names the binary)")
    return found


def _accepts(sock: Path) -> bool:
    """Whether the Unix socket accepts a connection now (a socket file alone may be stale)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _start_daemon(tmp_path, *flags: str):
    """bgl-governord on a temporary socket (its log in tmp_path/daemon.log), once the socket
    accepts connections. The 60 s bound only ends a daemon that never comes up."""
    binary = daemon_binary()
    sock = tmp_path / "governor.sock"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen([str(binary), "--listen", f"unix://{sock}", "--metrics-port", "0",
                             *flags], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while proc.poll() is None and not _accepts(sock) and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is not None or not _accepts(sock):
        proc.kill()
        pytest.fail(f"bgl-governord did not start: {(tmp_path / 'daemon.log').read_text()}")
    return proc, f"unix://{sock}", log


# Put on the ranks' PYTHONPATH: each rank holds its session at bagualu.uninstall() (before it
# ends it) until the test has taken its bgl-top frame, so the frame with every session is
# there to take, not caught by luck while the run lasts. The bound only ends a failed test.
_HOLD = """
import os, time
if os.environ.get("BGL_TEST_HOLD_FILE"):
    import bagualu
    _real = bagualu.uninstall
    def _held(*args, **kwargs):
        path = os.environ["BGL_TEST_HOLD_FILE"]
        for _ in range(12000):
            if os.path.exists(path):
                break
            time.sleep(0.01)
        return _real(*args, **kwargs)
    bagualu.uninstall = bagualu.api.uninstall = _held
"""


def _stop_daemon(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture
def daemon(tmp_path):
    proc, address, log = _start_daemon(tmp_path)
    yield address
    _stop_daemon(proc, log)


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
    check_torchrun(out.returncode, text)
    for rank in (0, 1):
        assert f"rank {rank} finished 2 iterations governor=remote ooms=0" in text, text[-4000:]
    assert "pipeline ranks [0, 1]" in text, text[-4000:]


def test_four_ranks_share_a_small_node_budget(tmp_path) -> None:
    """Issue 14: four CPU ranks under torchrun against one daemon whose node budget for pinned
    host memory is small. Every rank gets a quarter (fair share, nothing requested), sizes its
    pinned pool to it and never holds more; the run finishes; bgl-top shows the grants."""
    require_libs()
    budget, floor = 4 << 20, 256 << 10
    proc, address, log = _start_daemon(tmp_path, f"--host-budget-bytes={budget}",
                                       f"--host-floor-bytes={floor}", "--node-max-sessions=8")
    top = _lib.find_file("bgl-top")
    assert top is not None, "bgl-top is not built (target bgl-top)"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HOLD)
    release = tmp_path / "frame-taken"
    frames: List[str] = []
    run_done = threading.Event()

    def watch() -> None:  # a bgl-top frame with the four sessions, then let the ranks end
        try:
            while not run_done.is_set():
                r = subprocess.run([str(top), "--governor", address, "--once", "--width",
                                    "160"], capture_output=True, text=True, timeout=20)
                if r.returncode == 0 and r.stdout.count("torchrun-") >= 4:
                    frames.append(r.stdout)
                    return
                time.sleep(0.1)
        finally:
            release.touch()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp_path / "cache"),
                   PYTHONPATH=os.pathsep.join([str(hook), str(ROOT / "integrations" / "pytorch")]),
                   BGL_TEST_HOLD_FILE=str(release))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "4",
               str(ROOT / "integrations" / "pytorch" / "examples" / "moe_train.py"),
               "--governor", address, "--iterations", "3", "--layers", "4",
               "--micro-batches", "8", "--hidden", "64", "--seq-len", "32",
               "--capacity", "4MiB", "--spike-every", "3"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally:
        run_done.set()
        watcher.join(timeout=30)
        _stop_daemon(proc, log)
    text = out.stdout + out.stderr
    check_torchrun(out.returncode, text)
    found = re.findall(r"rank (\d) host grant (\d+) pinned capacity (\d+) pinned peak (\d+) "
                       r"offloads (\d+)", text)
    assert sorted(int(r[0]) for r in found) == [0, 1, 2, 3], text[-4000:]
    for rank, grant, capacity, peak, _ in found:
        assert int(grant) == budget // 4, (rank, grant)   # fair share of the node's budget
        assert int(capacity) == int(grant)                 # the pinned pool follows it
        assert int(peak) <= int(grant)                     # and no rank held more
    assert sum(int(r[4]) for r in found) > 0, "the run must offload something"
    for rank in range(4):
        assert f"rank {rank} finished 3 iterations governor=remote ooms=0" in text, text[-4000:]
    assert frames, "bgl-top never showed the four sessions"
    (tmp_path / "bgl-top-frame.txt").write_text(frames[0])
    assert "grant" in frames[0].lower(), frames[0]
