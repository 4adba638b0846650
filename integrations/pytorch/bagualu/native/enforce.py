"""ctypes declarations of libbgl_enforce.so (bgl/enforce.h): its structures, signatures, and the
values of its enums (statuses, placements, element types), read from the library by name
(bgl_enf_enum_value) rather than retyped. Only declarations and loading; the enforcer itself is
enforce/enforcer.py."""
from __future__ import annotations

import ctypes
from typing import Dict

import torch

from ..errors import BagualuError
from . import alloc

_c_void, _c_size, _c_int, _c_u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
# The consumer every registration gets first: the package's record itself. The enforcer retires
# a tensor when all its consumers released it; this one is released only when the record is
# gone, so a reloaded block is never freed while a consumer of the record may still need it.
HOLDER = (1 << 31) - 1


class Options(ctypes.Structure):
    _fields_ = [("device", _c_int), ("pinned_capacity", _c_size), ("fp8_block", _c_size),
                ("max_inflight", _c_int), ("d2h_stream", _c_void), ("h2d_stream", _c_void),
                ("pressure_eviction", _c_int), ("log", _c_int), ("sync_copies", _c_int),
                ("emulated_link", ctypes.c_char_p)]


class Desc(ctypes.Structure):
    _fields_ = [("ptr", _c_void), ("bytes", _c_size), ("dtype", _c_int), ("producer_op", _c_int),
                ("graph_tensor", _c_int), ("micro_batch", _c_int), ("stream", _c_void),
                ("flags", ctypes.c_uint32)]


class Info(ctypes.Structure):
    _fields_ = [("placement", _c_int), ("applied", _c_int), ("planned", _c_int),
                ("pending", _c_int), ("num_consumers", _c_int), ("num_released", _c_int),
                ("bytes", _c_size), ("device_ptr", _c_void), ("host_ptr", _c_void),
                ("fp8_ptr", _c_void), ("fp8_bytes", _c_size), ("need_order", ctypes.c_int64)]


STAT_FIELDS = ("tracked", "registered", "retired", "offloads", "reloads", "fp8_casts",
                "fp8_uncasts", "drops", "recomputes", "bytes_d2h", "bytes_h2d", "bytes_fp8_saved",
                "evictions", "evicted_bytes", "pressure_calls", "unreloads", "scheduled_issued",
                "scheduled_max_inflight", "device_bytes", "host_bytes", "fp8_bytes",
                "pinned_in_use", "pinned_cached", "pinned_peak", "pinned_capacity",
                "pinned_allocs", "pinned_hits", "pinned_failures", "copy_wait_ns")


class Stats(ctypes.Structure):
    _fields_ = [(name, _c_u64) for name in STAT_FIELDS]


RECOMPUTE_FN = ctypes.CFUNCTYPE(_c_int, _c_u64, _c_int, _c_int, _c_void,
                                 ctypes.POINTER(_c_void))


def bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_bgl_enf_bound", False):
        return
    handle_p = ctypes.POINTER(_c_void)
    h = [_c_void, _c_u64]
    sigs = {
        "bgl_enf_default_options": ([ctypes.POINTER(Options)], None),
        "bgl_enf_create": ([ctypes.POINTER(Options), handle_p], _c_int),
        "bgl_enf_destroy": ([_c_void], _c_int),
        "bgl_enf_register": ([_c_void, ctypes.POINTER(Desc), ctypes.POINTER(_c_u64)], _c_int),
        "bgl_enf_register_saved": ([_c_void, ctypes.POINTER(Desc), ctypes.c_int64,
                                    ctypes.POINTER(_c_int), _c_size, ctypes.POINTER(_c_u64)],
                                   _c_int),
        "bgl_enf_offload_saved": ([_c_void, ctypes.POINTER(Desc), ctypes.c_int64,
                                   ctypes.POINTER(_c_int), _c_size, ctypes.POINTER(_c_u64)],
                                  _c_int),
        "bgl_enf_store_fp8_saved": ([_c_void, ctypes.POINTER(Desc), ctypes.c_int64,
                                     ctypes.POINTER(_c_int), _c_size, ctypes.POINTER(_c_u64),
                                     ctypes.POINTER(_c_size)], _c_int),
        "bgl_enf_add_consumer": (h + [_c_int], _c_int),
        "bgl_enf_set_strategy": (h + [_c_int], _c_int),
        "bgl_enf_query": (h + [ctypes.POINTER(Info)], _c_int),
        "bgl_enf_offload": (h, _c_int),
        "bgl_enf_store_fp8": (h, _c_int),
        "bgl_enf_drop": (h, _c_int),
        "bgl_enf_set_recompute_callback": ([_c_void, RECOMPUTE_FN, _c_void], _c_int),
        "bgl_enf_acquire": (h + [_c_int, _c_void, handle_p], _c_int),
        "bgl_enf_release": (h + [_c_int, _c_void], _c_int),
        "bgl_enf_unregister": (h, _c_int),
        "bgl_enf_wait_tensor": (h, _c_int),
        "bgl_enf_synchronize": ([_c_void], _c_int),
        "bgl_enf_get_stats": ([_c_void, ctypes.POINTER(Stats)], _c_int),
        "bgl_enf_enum_value": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_c_int)],
                               _c_int),
        "bgl_enf_set_graph_index": (h + [_c_int, _c_int], _c_int),
        "bgl_enf_set_need_order": (h + [ctypes.c_int64], _c_int),
        "bgl_enf_schedule_poll": ([_c_void, ctypes.POINTER(_c_size)], _c_int),
        "bgl_enf_schedule_finish": ([_c_void], _c_int),
        "bgl_enf_take_offloaded": ([_c_void, ctypes.POINTER(_c_u64), _c_size,
                                    ctypes.POINTER(_c_size)], _c_int),
        "bgl_enf_prefetch": ([_c_void, _c_int, ctypes.POINTER(_c_size)], _c_int),
        "bgl_enf_evict": ([_c_void, _c_size, ctypes.POINTER(_c_size)], _c_int),
        "bgl_enf_set_pinned_capacity": ([_c_void, _c_size], _c_int),
        "bgl_enf_last_error": ([], ctypes.c_char_p),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    lib._bgl_enf_bound = True


def load() -> ctypes.CDLL:
    """libbgl_enforce.so with its signatures bound (libbgl_alloc.so first: it binds to its pool)."""
    alloc.load()
    lib = alloc.load_enforce()
    bind(lib)
    return lib


class Vocabulary:
    """The enum values of the loaded library, by the names bgl/enforce.h gives them."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        def value(kind: str, name: str) -> int:
            out = ctypes.c_int(0)
            if lib.bgl_enf_enum_value(kind.encode(), name.encode(), ctypes.byref(out)) != 0:
                msg = lib.bgl_enf_last_error()
                raise BagualuError(f"libbgl_enforce.so: {msg.decode() if msg else kind}")
            return out.value

        self.value = value
        self.ok = value("status", "ok")
        self.out_of_memory = value("status", "out_of_memory")
        self.duplicate = value("status", "duplicate")
        self.callback = value("status", "callback")
        self.backend = value("status", "backend")
        # Statuses of a piece the stream scheduler skipped: out of memory, invalid state,
        # conflict, pinned pool exhausted.
        self.skipped_piece = frozenset(value("status", n) for n in (
            "out_of_memory", "invalid_state", "conflict", "pinned_exhausted"))
        self.placement: Dict[int, str] = {value("placement", n): n
                                          for n in ("device", "host", "fp8", "dropped")}
        self.place_host = value("placement", "host")
        # The element types the FP8 cast accepts; anything else is moved as bytes.
        self.dtype = {torch.float32: value("dtype", "f32"), torch.float16: value("dtype", "f16"),
                      torch.bfloat16: value("dtype", "bf16")}
        self.dtype_bytes = value("dtype", "bytes")


_vocabulary: Dict[int, Vocabulary] = {}


def vocabulary(lib: ctypes.CDLL) -> Vocabulary:
    """The enum values of ``lib`` (read once)."""
    v = _vocabulary.get(id(lib))
    if v is None:
        v = _vocabulary[id(lib)] = Vocabulary(lib)
    return v
