"""The build gives the package what it loads: CMake's target bgl_python depends on every
shared library of native/libs.py's LIBRARIES, and the demo, the test suite's CMake and
tests/gpu/bundle.sh build that target."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from conftest import ROOT


def test_the_demo_and_the_gpu_bundle_build_what_the_package_loads() -> None:
    for script in ("scripts/demo.sh", "tests/gpu/bundle.sh"):
        text = (ROOT / script).read_text()
        assert re.search(r"--target[^\n]*\bbgl_python\b|\bbgl_python\)", text), script


def test_bgl_python_builds_every_library_the_package_loads() -> None:
    from bagualu.native import libs
    build = ROOT / "build"
    if not (build / "build.ninja").is_file() or shutil.which("ninja") is None:
        pytest.fail("needs the ninja build in build/ (scripts/test.sh makes it)")
    out = subprocess.run(["ninja", "-C", str(build), "-t", "query", "bgl_python"],
                         capture_output=True, text=True, check=True).stdout
    inputs = out.split("outputs:")[0]
    names = {line.strip().rsplit("/", 1)[-1] for line in inputs.splitlines()}
    missing = [lib for lib in libs.LIBRARIES if lib not in names]
    assert not missing, f"bgl_python does not build {missing} (top-level CMakeLists.txt)"
    assert set(libs.LIBRARIES) <= set(libs._SUBDIRS), "native/libs.py cannot find them all"
    from bagualu.native import ext
    assert ext._file_name() in names, "bgl_python does not build bagualu._C (csrc/)"


def test_the_binding_configures_alone_against_the_running_torch(tmp_path) -> None:
    """integrations/pytorch/csrc as a project of its own (tests/gpu/device.sh builds it on a GPU
    machine whose torch is not the bundle's): it configures with no planner dependency and
    targets this Python's torch and extension suffix (the compile is the in-tree one's)."""
    import sys
    import sysconfig

    import torch
    if shutil.which("cmake") is None or shutil.which("ninja") is None:
        pytest.fail("needs cmake and ninja (scripts/setup.sh installs them)")
    out = subprocess.run(["cmake", "-S", str(ROOT / "integrations/pytorch/csrc"), "-B",
                          str(tmp_path), "-G", "Ninja", f"-DBGL_PYTHON={sys.executable}"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"building bagualu._C against torch {torch.__version__}" in out.stdout
    assert (tmp_path / "integrations/pytorch/_C.torch-version").read_text().strip() == \
        torch.__version__
    targets = subprocess.run(["ninja", "-C", str(tmp_path), "-t", "targets", "all"],
                             capture_output=True, text=True, check=True).stdout
    assert "_C" + sysconfig.get_config_var("EXT_SUFFIX") in targets
    # Alone: no target of the rest of the build (the planner, the allocator, the enforcer).
    assert "bgl_planner" not in targets and "bgl_alloc" not in targets
