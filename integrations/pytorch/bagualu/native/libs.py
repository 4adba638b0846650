"""Locates and loads the project's shared libraries (libbgl_planner.so, libbgl_alloc.so,
libbgl_enforce.so).

Search order: the directory in ``BGL_LIB_DIR`` (the file itself or the build tree's
subdirectories), then the package's own ``lib/`` (where ``pip install`` puts them: the root
pyproject.toml), then the repository's ``build*/`` directories relative to this package.
"""
from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path
from typing import Dict, List, Optional

from ..errors import LibraryNotFound

# The shared libraries the package loads: CMake's target bgl_python builds exactly these.
LIBRARIES = ("libbgl_planner.so", "libbgl_alloc.so", "libbgl_enforce.so")
_SUBDIRS = {
    "libbgl_planner.so": ["", "governor/planner"],
    "libbgl_alloc.so": ["", "allocator"],
    "libbgl_enforce.so": ["", "enforcer"],
    "bgl-governord": ["", "governor/daemon"],
    "bgl-top": ["", "tools/bgl-top"],
}
_loaded: Dict[str, ctypes.CDLL] = {}


def repo_root() -> Path:
    """The repository root (integrations/pytorch/bagualu/native/../../../..)."""
    return Path(__file__).resolve().parents[4]


def _candidate_dirs() -> List[Path]:
    dirs: List[Path] = []
    env = os.environ.get("BGL_LIB_DIR")
    if env:
        for p in env.split(os.pathsep):
            # A path that is not there would leave the search to the checkout's build folders:
            # another build than the one named, loaded without a word.
            if p and not Path(p).exists():
                raise LibraryNotFound(f"BGL_LIB_DIR: '{p}' does not exist (a CMake build "
                                      "directory, or the folder or file of the libraries)")
        dirs.extend(Path(p) for p in env.split(os.pathsep) if p)
    installed = Path(__file__).resolve().parents[1] / "lib"
    if installed.is_dir():
        dirs.append(installed)
    root = repo_root()
    if not (root / "CMakeLists.txt").is_file():  # installed: no checkout around the package
        return dirs
    preferred = [root / "build", root / "build-py"]
    others = sorted(Path(p) for p in glob.glob(str(root / "build*")) if Path(p) not in preferred)
    # Sanitizer builds cannot be loaded into an uninstrumented Python.
    others = [p for p in others if not any(s in p.name for s in ("asan", "tsan", "ubsan"))]
    dirs.extend(preferred + others)
    return dirs


def find_file(name: str) -> Optional[Path]:
    """Returns the first existing path of a library or binary ``name``, or None."""
    for d in _candidate_dirs():
        for sub in _SUBDIRS.get(name, [""]):
            p = d / sub / name if sub else d / name
            if p.is_file():
                return p
    return None


def load(name: str) -> ctypes.CDLL:
    """Loads (once) the shared library ``name``; raises LibraryNotFound with the places tried."""
    if name in _loaded:
        return _loaded[name]
    path = find_file(name)
    if path is None:
        tried = ", ".join(str(d) for d in _candidate_dirs())
        raise LibraryNotFound(
            f"{name} not found (set BGL_LIB_DIR to the CMake build directory; tried {tried})")
    lib = ctypes.CDLL(str(path))
    _loaded[name] = lib
    return lib
