"""Process-wide state: the installed runtime and whether libbgl_alloc.so is PyTorch's CUDA
allocator. It imports nothing of the package, so that OpBlock.forward (discovery/opblock.py)
and enforce/device.py can read it without importing the runtime.

Set only by installer.py (install/uninstall) on the thread that installs; read anywhere."""
from __future__ import annotations

from typing import Any, Optional

runtime: Optional[Any] = None   # the runtime.Runtime while installed (Any: no import of it)
cuda_allocator_swapped = False  # PyTorch cannot change its allocator back once used
