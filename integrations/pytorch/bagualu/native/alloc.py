"""ctypes declarations of libbgl_alloc.so (bgl/alloc.h) and the loader of libbgl_enforce.so that
binds to the same pool. Only signatures, loading and the error slot; what the pool is for is
enforce/pool.py."""
from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from . import libs as _lib
from ..errors import BagualuError, LibraryNotFound

PressureFn = Callable[[int], int]
PRESSURE_CFUNC = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)


def bind(lib: ctypes.CDLL) -> None:
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
    lib.bgl_alloc_add_pressure_callback.argtypes = [ctypes.c_int, PRESSURE_CFUNC, c_void,
                                                    ctypes.POINTER(ctypes.c_int)]
    lib.bgl_alloc_add_pressure_callback.restype = ctypes.c_int
    lib.bgl_alloc_remove_pressure_callback.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.bgl_alloc_remove_pressure_callback.restype = ctypes.c_int
    lib.bgl_parse_bytes.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                    ctypes.POINTER(ctypes.c_int64)]
    lib.bgl_parse_bytes.restype = ctypes.c_int
    lib._bgl_alloc_bound = True


def load() -> ctypes.CDLL:
    """libbgl_alloc.so with its signatures bound."""
    lib = _lib.load("libbgl_alloc.so")
    bind(lib)
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
    if env and not Path(env).is_file():  # named by the user: not another build's silently
        raise LibraryNotFound(f"BGL_ENFORCE_LIB: '{env}' is not a file (a {name} built with "
                              f"{alloc})")
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


def read_json(call: Callable[[Optional[ctypes.Array], int, Any], int], lib: ctypes.CDLL) -> Any:
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


def parse_bytes(text: str, what: str = "size") -> int:
    """Bytes of a size as users write it, by the project's one parser (bgl::ParseBytes through
    bgl_parse_bytes); ValueError with the parser's message naming ``what``."""
    lib = load()
    out = ctypes.c_int64(0)
    if lib.bgl_parse_bytes(text.encode(), what.encode(), ctypes.byref(out)) != 0:
        raise ValueError(last_error(lib) or f"{what}: '{text}' is not a size")
    return int(out.value)
