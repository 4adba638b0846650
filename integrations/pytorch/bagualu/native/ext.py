"""Locates and loads bagualu._C, the package's compiled binding for PyTorch
(integrations/pytorch/csrc, CMake target bgl_torch_ext, built with bgl_python): the hot path's
calls into libbgl_alloc.so and libbgl_enforce.so without ctypes, and the enforcer's blocks as
torch storages.

The binding is built against one torch (the one of the build's Python): a binding built for
another torch is refused by name (both versions) before it is loaded. Search order as for the
libraries (native/libs.py): ``BGL_LIB_DIR``, then the checkout's ``build*/`` folders; a binding
built for the running torch is taken over one that is not.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Tuple

import torch

from ..errors import LibraryNotFound
from .libs import _candidate_dirs

ABI_VERSION = 6  # csrc/module.cc kAbiVersion: the calls this package makes
_SUBDIR = "integrations/pytorch"
_module: Optional[ModuleType] = None


def _file_name() -> str:
    return "_C" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def _candidates() -> List[Tuple[Path, str]]:
    """Each binding found, with the torch version it was built for (its sidecar file)."""
    name, out = _file_name(), []
    for d in _candidate_dirs():
        for sub in ("", _SUBDIR):
            path = (d / sub / name) if sub else d / name
            if path.is_file():
                stamp = path.with_name("_C.torch-version")
                built_for = stamp.read_text().strip() if stamp.is_file() else "unknown"
                out.append((path, built_for))
    return out


def load() -> ModuleType:
    """bagualu._C (loaded once); LibraryNotFound when none was built for this torch."""
    global _module
    if _module is not None:
        return _module
    found = _candidates()
    ours = [p for p, v in found if v == torch.__version__]
    if not ours:
        if found:
            others = "; ".join(f"{p} (torch {v})" for p, v in found)
            raise LibraryNotFound(
                f"bagualu._C was built for another torch than this process's torch "
                f"{torch.__version__}: {others}. Rebuild it against this Python's torch "
                f"(cmake -S . -B build -DBGL_PYTHON={sys.executable} && cmake --build build "
                "--target bgl_python), or point BGL_LIB_DIR at a build made for it")
        tried = ", ".join(str(d) for d in _candidate_dirs())
        raise LibraryNotFound(
            f"bagualu._C ({_file_name()}) not found: build the target bgl_python (it builds "
            f"the binding where the build's Python has torch; tried {tried})")
    path = ours[0]
    loader = importlib.machinery.ExtensionFileLoader("bagualu._C", str(path))
    spec = importlib.util.spec_from_file_location("bagualu._C", str(path), loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    if getattr(module, "abi_version", None) != ABI_VERSION:
        raise LibraryNotFound(
            f"{path} speaks version {getattr(module, 'abi_version', None)} of the binding's "
            f"calls, this package version {ABI_VERSION}: rebuild the target bgl_python")
    sys.modules["bagualu._C"] = module
    _module = module
    return module
