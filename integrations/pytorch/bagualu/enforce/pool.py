"""The simulated device's activation pool: ctypes over libbgl_alloc.so (bgl/alloc.h).

On CPU every saved activation storage that stays "on the device" holds one block of the host
backend's pool, so the configured capacity, the peak and OOM behave as on a device of that
size. On CUDA the same library is PyTorch's allocator and the pool is only read (stats,
snapshot).
"""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TypeVar

from . import _lib
from .errors import BagualuError, LibraryNotFound, OutOfMemoryError

T = TypeVar("T")
EVICTION_ROUNDS = 12  # retries of a failed allocation, each after evicting twice as much


def retry_after_eviction(alloc: Callable[[], T], nbytes: int, evict: Callable[[int], int],
                         error: OutOfMemoryError) -> T:
    """``alloc()`` again after it failed with ``error``, each time after ``evict`` freed
    twice as much as the time before. The pool's own pressure call asks for the shortfall in
    bytes, but what it frees may lie in pages other blocks still use. Raises the last
    OutOfMemoryError once eviction frees nothing more."""
    for attempt in range(EVICTION_ROUNDS):
        if evict(nbytes << (attempt + 1)) == 0:
            break
        try:
            return alloc()
        except OutOfMemoryError as e:
            error = e
    raise error

PressureFn = Callable[[int], int]
_PRESSURE_CFUNC = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)


def _bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_bgl_alloc_bound", False):
        return
    c_void, c_size = ctypes.c_void_p, ctypes.c_size_t
    lib.bgl_alloc.argtypes = [c_size, ctypes.c_int, c_void]
    lib.bgl_alloc.restype = c_void
    lib.bgl_free.argtypes = [c_void, c_size, ctypes.c_int, c_void]
    lib.bgl_free.restype = None
    lib.bgl_alloc_configure.argtypes = [ctypes.c_char_p]
    lib.bgl_alloc_configure.restype = ctypes.c_int
    lib.bgl_alloc_last_error.argtypes = []
    lib.bgl_alloc_last_error.restype = ctypes.c_char_p
    for fn in ("bgl_alloc_stats_json",):
        getattr(lib, fn).argtypes = [ctypes.c_int, ctypes.c_char_p, c_size,
                                     ctypes.POINTER(c_size)]
        getattr(lib, fn).restype = ctypes.c_int
    lib.bgl_alloc_snapshot_json.argtypes = [ctypes.c_char_p, c_size, ctypes.POINTER(c_size)]
    lib.bgl_alloc_snapshot_json.restype = ctypes.c_int
    lib.bgl_alloc_record_history.argtypes = [ctypes.c_int, c_size]
    lib.bgl_alloc_record_history.restype = ctypes.c_int
    lib.bgl_alloc_reset_peak_stats.argtypes = [ctypes.c_int]
    lib.bgl_alloc_reset_peak_stats.restype = ctypes.c_int
    lib.bgl_alloc_add_pressure_callback.argtypes = [ctypes.c_int, _PRESSURE_CFUNC, c_void,
                                                    ctypes.POINTER(ctypes.c_int)]
    lib.bgl_alloc_add_pressure_callback.restype = ctypes.c_int
    lib.bgl_alloc_remove_pressure_callback.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.bgl_alloc_remove_pressure_callback.restype = ctypes.c_int
    lib._bgl_alloc_bound = True


def load() -> ctypes.CDLL:
    """libbgl_alloc.so with its signatures bound."""
    lib = _lib.load("libbgl_alloc.so")
    _bind(lib)
    return lib


_enforce_lib: Optional[ctypes.CDLL] = None


def load_enforce() -> ctypes.CDLL:
    """libbgl_enforce.so (bgl/enforce.h), the enforcer's C ABI; its signatures are the caller's
    to bind. Loaded after libbgl_alloc.so (load()) and from the same build, so it binds to that
    library's pool, streams and error slot (one pool per process): ``$BGL_ENFORCE_LIB`` if set,
    else ``enforcer/libbgl_enforce.so`` of the build tree libbgl_alloc.so came from, or the file
    beside it (a flat ``BGL_LIB_DIR``)."""
    global _enforce_lib
    if _enforce_lib is not None:
        return _enforce_lib
    alloc = Path(load()._name)
    env = os.environ.get("BGL_ENFORCE_LIB")
    name = "libbgl_enforce.so"
    candidates = [Path(env)] if env else [alloc.parent.parent / "enforcer" / name,
                                          alloc.parent / name]
    for path in candidates:
        if path.is_file():
            _enforce_lib = ctypes.CDLL(str(path))
            return _enforce_lib
    raise LibraryNotFound(f"{name} not found (tried {', '.join(map(str, candidates))}; it is "
                          f"built with {alloc.name}, or set BGL_ENFORCE_LIB)")


def last_error(lib: ctypes.CDLL) -> str:
    msg = lib.bgl_alloc_last_error()
    return msg.decode() if msg else ""


def _read_json(call: Callable[[Optional[ctypes.Array], int, Any], int], lib: ctypes.CDLL) -> Any:
    needed = ctypes.c_size_t(0)
    cap = 1 << 16
    for _ in range(8):
        buf = ctypes.create_string_buffer(cap)
        rc = call(buf, cap, ctypes.byref(needed))
        if rc == 0:
            return json.loads(buf.value.decode())
        if rc != 9:  # BGL_ERR_BUFFER_TOO_SMALL
            raise BagualuError(f"libbgl_alloc: {last_error(lib)}")
        cap = int(needed.value) + 1024
    raise BagualuError("libbgl_alloc: JSON kept growing")


class DevicePool:
    """Blocks of the simulated device, one per saved activation storage kept on it."""

    def __init__(self, capacity_bytes: int, device: int = 0, history: int = 0,
                 configure: bool = True) -> None:
        self.lib = load()
        self.device = device
        self.capacity_bytes = int(capacity_bytes)
        if configure:
            page = 64 << 10
            self.capacity_bytes = (self.capacity_bytes + page - 1) // page * page
            conf = f"backend:host,capacity:{self.capacity_bytes},page_size:{page},log:false"
            if history:
                conf += f",history:{int(history)}"
            rc = self.lib.bgl_alloc_configure(conf.encode())
            if rc == 10:
                raise BagualuError(
                    "cannot reconfigure the host backend while activations of a previous "
                    "install are alive (free their graphs first)")
            if rc != 0:
                raise BagualuError(f"cannot configure the host backend ({conf}): "
                                   f"{last_error(self.lib)}")
        self._callbacks: List[Any] = []
        self._handles: List[int] = []

    def alloc(self, nbytes: int) -> int:
        """A block of ``nbytes``; raises OutOfMemoryError with the allocator's message."""
        ptr = self.lib.bgl_alloc(max(int(nbytes), 1), self.device, None)
        if not ptr:
            raise OutOfMemoryError(f"activation memory: {last_error(self.lib)}")
        return int(ptr)

    def free(self, ptr: int, nbytes: int) -> None:
        self.lib.bgl_free(ctypes.c_void_p(ptr), max(int(nbytes), 1), self.device, None)

    def stats(self) -> Dict[str, Any]:
        return _read_json(lambda b, c, n: self.lib.bgl_alloc_stats_json(self.device, b, c, n),
                          self.lib)

    def snapshot(self) -> Dict[str, Any]:
        return _read_json(self.lib.bgl_alloc_snapshot_json, self.lib)

    def reset_peak(self) -> None:
        self.lib.bgl_alloc_reset_peak_stats(self.device)

    def add_pressure_callback(self, fn: PressureFn) -> None:
        """fn(bytes_needed) -> bytes freed; called before an allocation would fail."""
        def trampoline(device: int, needed: int, user: Any) -> int:
            try:
                return int(fn(int(needed)))
            except Exception:  # never let an exception cross the C boundary
                return 0
        cb = _PRESSURE_CFUNC(trampoline)
        handle = ctypes.c_int(0)
        rc = self.lib.bgl_alloc_add_pressure_callback(self.device, cb, None, ctypes.byref(handle))
        if rc != 0:
            raise BagualuError(f"pressure callback: {last_error(self.lib)}")
        self._callbacks.append(cb)
        self._handles.append(handle.value)

    def close(self) -> None:
        for h in self._handles:
            self.lib.bgl_alloc_remove_pressure_callback(self.device, h)
        self._handles.clear()
        self._callbacks.clear()
