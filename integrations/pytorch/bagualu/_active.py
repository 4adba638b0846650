"""Process-wide state that several modules read: the installed runtime and whether
libbgl_alloc.so is PyTorch's CUDA allocator. Nothing here imports the rest of the package, so
ops.py, installer.py and runtime.py all depend on it and not on each other.

Set only by installer.py (install/uninstall) on the thread that installs; read anywhere."""
from __future__ import annotations

from typing import Any, Optional

runtime: Optional[Any] = None   # runtime.Runtime while installed
cuda_allocator_swapped = False  # PyTorch cannot change its allocator back once used
