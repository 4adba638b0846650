"""ctypes declarations of libbgl_planner.so (governor/planner/include/bgl/planner.h) and its
loader. Only signatures; the embedded planner is planning/embedded.py."""
from __future__ import annotations

import ctypes

from . import libs


def bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_bgl_bound", False):
        return
    c_str, c_void = ctypes.c_char_p, ctypes.c_void_p
    lib.bgl_planner_create.argtypes = [c_str, c_str]
    lib.bgl_planner_create.restype = c_void
    lib.bgl_planner_destroy.argtypes = [c_void]
    lib.bgl_planner_destroy.restype = None
    lib.bgl_planner_calibrated_profile.argtypes = [c_str, c_str]
    lib.bgl_planner_calibrated_profile.restype = c_void
    for fn in ("bgl_planner_describe", "bgl_planner_stats"):
        getattr(lib, fn).argtypes = [c_void]
        getattr(lib, fn).restype = c_void
    lib.bgl_planner_schedule.argtypes = [ctypes.c_int] * 4
    lib.bgl_planner_schedule.restype = c_void
    lib.bgl_planner_plan.argtypes = [c_void, c_str]
    lib.bgl_planner_plan.restype = c_void
    lib.bgl_planner_plan_after_gate.argtypes = [c_void, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_double]
    lib.bgl_planner_plan_after_gate.restype = c_void
    lib.bgl_planner_report.argtypes = [c_void, ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    lib.bgl_planner_report.restype = ctypes.c_int
    lib.bgl_planner_warm_up.argtypes = [c_void, ctypes.c_int64, ctypes.c_double]
    lib.bgl_planner_warm_up.restype = ctypes.c_int
    lib.bgl_planner_reset_iteration.argtypes = [c_void]
    lib.bgl_planner_reset_iteration.restype = None
    lib.bgl_planner_last_error.argtypes = []
    lib.bgl_planner_last_error.restype = c_str
    lib.bgl_planner_free_string.argtypes = [c_void]
    lib.bgl_planner_free_string.restype = None
    lib._bgl_bound = True


def load() -> ctypes.CDLL:
    """libbgl_planner.so with its signatures bound."""
    lib = libs.load("libbgl_planner.so")
    bind(lib)
    return lib
