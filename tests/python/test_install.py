"""`pip install` gives a working bagualu (issue 44 item 1): the root pyproject.toml builds the
libraries and the binding into the package with scikit-build-core, non-editable, into a fresh
venv outside the checkout that sees the project venv's torch through a .pth file (no second torch
download, no network: scikit-build-core comes from .venv too). The installed package then loads
its own libraries with no BGL_LIB_DIR and no checkout on its paths, and an unmodified
transformers model trains at half of keep-all's peak, where keep-all runs out of memory.

This build is a Release build (CMAKE_BUILD_TYPE from pyproject.toml): the one CI makes."""
from __future__ import annotations

import os
import site
import subprocess
import sys
import venv
from pathlib import Path

from conftest import ROOT


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BGL_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(extra)
    return env


def _fresh_venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    mine = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # A plain path line: .venv's packages (torch, numpy, pip, scikit-build-core) importable, its
    # own .pth files (the checkout's editable bagualu) not processed.
    base = site.getsitepackages()[0] if sys.prefix != sys.base_prefix else None
    assert base, "run the suite with the project venv's Python (.venv/bin/python)"
    (Path(mine) / "bagualu-test-base.pth").write_text(str(Path(base).resolve()) + "\n")
    return py


def test_pip_install_builds_a_package_that_trains_with_no_checkout(tmp_path: Path) -> None:
    py = _fresh_venv(tmp_path / "venv")
    jobs = str(os.cpu_count() or 2)
    build = subprocess.run(
        [str(py), "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
         "--disable-pip-version-check", "-q", str(ROOT)],
        cwd=tmp_path, capture_output=True, text=True, timeout=1500,
        env=_clean_env(CMAKE_BUILD_PARALLEL_LEVEL=jobs, TMPDIR=str(tmp_path)))
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]

    where = subprocess.run(
        [str(py), "-c", "import bagualu, bagualu.native.libs as l, bagualu.native.ext as e\n"
         "print(bagualu.__file__)\n"
         "for n in l.LIBRARIES: l.load(n); print(l.find_file(n))\n"
         "print(e.load().__file__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_clean_env())
    assert where.returncode == 0, where.stderr[-4000:]
    paths = [Path(line) for line in where.stdout.split()]
    assert len(paths) == 2 + len(("planner", "alloc", "enforce"))
    for p in paths:
        assert p.resolve().is_relative_to((tmp_path / "venv").resolve()), (p, where.stdout)
        assert not p.resolve().is_relative_to(ROOT.resolve()), p

    # The example is a script: run by path, it imports the installed package (its own folder
    # has no bagualu), keep-all first to find the peak, then both policies at half of it.
    train = subprocess.run(
        [str(py), str(ROOT / "integrations/pytorch/examples/unmodified.py"), "--model",
         "qwen3_moe", "--policy", "all", "--iterations", "1", "--micro-batches", "4"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env=_clean_env())
    assert train.returncode == 0, train.stdout[-4000:] + train.stderr[-4000:]
    lines = {ln.split()[0]: ln for ln in train.stdout.splitlines() if ln.startswith("  ")}
    assert "OOM" in lines["keep-all"], train.stdout
    assert "finished" in lines["bagualu"], train.stdout


def test_pip_install_with_build_isolation_is_refused_naming_the_flag(tmp_path: Path) -> None:
    """pip's isolated build environment has no torch: the binding cannot be built against the
    environment's torch, and the build says what to do instead of building a package without
    it (or downloading a second torch)."""
    env = _clean_env(TMPDIR=str(tmp_path))
    cmake = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / "b"), "-DSKBUILD=2",
         "-DBGL_WITH_GRPC=OFF", "-DBGL_BUILD_TESTS=OFF", "-DBGL_BUILD_BENCH=OFF",
         f"-DPython_EXECUTABLE={sys.base_prefix}/bin/python3"],
        capture_output=True, text=True, timeout=300, env=env)
    assert cmake.returncode != 0
    err = " ".join(cmake.stderr.split())
    assert "cannot import torch" in err and "--no-build-isolation" in err, cmake.stderr
