"""The enforcer of libbgl_alloc.so (allocator/include/bgl/enforce.h) through ctypes: offload to
its pinned host pool on its D2H stream, reload on its H2D stream into a block of the allocator's
pool, and hand the reloaded block to PyTorch without a copy.

PyTorch keeps owning the memory it allocated (the enforcer borrows it for the copy); the
enforcer owns the pinned copy and the reloaded block, which PyTorch sees as a tensor whose
storage releases the enforcer's handle when it dies.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Dict, Optional

import torch

from . import pool as poolmod
from .errors import BagualuError, OutOfMemoryError

log = logging.getLogger("bagualu")

_c_void, _c_size, _c_int, _c_u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
_BYTES = 3
_ERR_OUT_OF_MEMORY = 2


class _Options(ctypes.Structure):
    _fields_ = [("device", _c_int), ("pinned_capacity", _c_size), ("fp8_block", _c_size),
                ("max_inflight", _c_int), ("d2h_stream", _c_void), ("h2d_stream", _c_void),
                ("pressure_eviction", _c_int), ("log", _c_int)]


class _Desc(ctypes.Structure):
    _fields_ = [("ptr", _c_void), ("bytes", _c_size), ("dtype", _c_int), ("producer_op", _c_int),
                ("graph_tensor", _c_int), ("micro_batch", _c_int), ("stream", _c_void),
                ("flags", ctypes.c_uint32)]


_STAT_FIELDS = ("tracked", "registered", "retired", "offloads", "reloads", "fp8_casts",
                "fp8_uncasts", "drops", "recomputes", "bytes_d2h", "bytes_h2d", "bytes_fp8_saved",
                "evictions", "evicted_bytes", "pressure_calls", "scheduled_issued",
                "scheduled_max_inflight", "device_bytes", "host_bytes", "fp8_bytes",
                "pinned_in_use", "pinned_cached", "pinned_peak", "pinned_capacity",
                "pinned_allocs", "pinned_hits", "pinned_failures")


class _Stats(ctypes.Structure):
    _fields_ = [(name, _c_u64) for name in _STAT_FIELDS]


def _bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_bgl_enf_bound", False):
        return
    handle_p = ctypes.POINTER(_c_void)
    sigs = {
        "bgl_enf_default_options": ([ctypes.POINTER(_Options)], None),
        "bgl_enf_create": ([ctypes.POINTER(_Options), handle_p], _c_int),
        "bgl_enf_destroy": ([_c_void], _c_int),
        "bgl_enf_register": ([_c_void, ctypes.POINTER(_Desc), ctypes.POINTER(_c_u64)], _c_int),
        "bgl_enf_offload": ([_c_void, _c_u64], _c_int),
        "bgl_enf_reload": ([_c_void, _c_u64], _c_int),
        "bgl_enf_acquire": ([_c_void, _c_u64, _c_int, _c_void, handle_p], _c_int),
        "bgl_enf_release": ([_c_void, _c_u64, _c_int, _c_void], _c_int),
        "bgl_enf_unregister": ([_c_void, _c_u64], _c_int),
        "bgl_enf_wait_tensor": ([_c_void, _c_u64], _c_int),
        "bgl_enf_synchronize": ([_c_void], _c_int),
        "bgl_enf_get_stats": ([_c_void, ctypes.POINTER(_Stats)], _c_int),
        "bgl_enf_last_error": ([], ctypes.c_char_p),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    lib._bgl_enf_bound = True


class _Block:
    """A reloaded block of the enforcer as the owner of a tensor's memory (NumPy's array
    interface on the host backend, ``__cuda_array_interface__`` on CUDA); ``done`` releases it
    when PyTorch lets go of the memory."""

    __slots__ = ("interface", "cuda", "done", "__weakref__")

    def __init__(self, ptr: int, nbytes: int, cuda: bool, done: Any) -> None:
        self.interface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                          "version": 2 if cuda else 3}
        self.cuda = cuda
        self.done = done

    @property
    def __array_interface__(self) -> Dict[str, Any]:
        if self.cuda:
            raise AttributeError("__array_interface__")
        return self.interface

    @property
    def __cuda_array_interface__(self) -> Dict[str, Any]:
        if not self.cuda:
            raise AttributeError("__cuda_array_interface__")
        return self.interface

    def __del__(self) -> None:
        self.done()


class Enforcer:
    """One enforcer over the allocator's pool of one device (CUDA device index, or the host
    backend's device 0 on CPU)."""

    def __init__(self, device: torch.device, pinned_capacity: int, borrowed_free_is_safe: bool,
                 evict: Optional[Callable[[int], int]] = None) -> None:
        self.lib = poolmod.load()
        _bind(self.lib)
        self.device = device
        self.cuda = device.type == "cuda"
        # With libbgl_alloc.so as PyTorch's allocator, the enforcer marks borrowed blocks used on
        # its copy stream, so PyTorch may free them before the copy ends; other memory must
        # outlive the copy (foreign memory rule in bgl/enforce.h).
        self.borrowed_free_is_safe = borrowed_free_is_safe
        self.evict = evict  # frees device bytes when a reload finds no room (may be None)
        opts = _Options()
        self.lib.bgl_enf_default_options(ctypes.byref(opts))
        opts.device = (device.index or 0) if self.cuda else 0
        opts.pinned_capacity = int(pinned_capacity)
        opts.pressure_eviction = 0  # the runtime's pressure callback decides what moves
        handle = _c_void()
        self._check(self.lib.bgl_enf_create(ctypes.byref(opts), ctypes.byref(handle)), "create")
        self.handle = handle.value
        self.live_blocks = 0  # reloaded blocks PyTorch still holds
        self.pending = 0      # offloaded tensors not yet acquired or released
        self.closing = False  # close() was called: destroy once nothing is outstanding
        self.destroyed = False

    # -- helpers ----------------------------------------------------------------------------
    def _error(self) -> str:
        msg = self.lib.bgl_enf_last_error()
        return msg.decode() if msg else "unknown error"

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        text = f"enforcer {what}: {self._error()}"
        if rc == _ERR_OUT_OF_MEMORY:
            raise OutOfMemoryError(text)
        raise BagualuError(text)

    def _stream(self) -> Optional[int]:
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    # -- moves ------------------------------------------------------------------------------
    def offload(self, ptr: int, nbytes: int, micro_batch: int, producer_op: int = 0) -> int:
        """Copies ``nbytes`` at ``ptr`` to the pinned pool on the D2H stream (after the current
        stream's work); returns the handle. Waits for the copy unless PyTorch may free the
        source before it ends."""
        desc = _Desc(ptr=ptr, bytes=nbytes, dtype=_BYTES, producer_op=producer_op,
                     graph_tensor=-1, micro_batch=micro_batch, stream=self._stream(), flags=0)
        h = _c_u64(0)
        self._check(self.lib.bgl_enf_register(self.handle, ctypes.byref(desc), ctypes.byref(h)),
                    "register")
        rc = self.lib.bgl_enf_offload(self.handle, h)
        if rc == 0 and not self.borrowed_free_is_safe:
            rc = self.lib.bgl_enf_wait_tensor(self.handle, h)
        if rc != 0:
            msg = self._error()
            self.lib.bgl_enf_unregister(self.handle, h)
            raise BagualuError(f"enforcer offload: {msg}")
        self.pending += 1
        return h.value

    def prefetch(self, handle: int) -> None:
        """Starts the reload on the H2D stream (a no-op when already issued)."""
        self._check(self.lib.bgl_enf_reload(self.handle, handle), "reload")

    def acquire(self, handle: int, nbytes: int) -> torch.UntypedStorage:
        """The reloaded data as a storage on the device; the current stream waits for it. The
        handle is released when the storage dies."""
        if self.destroyed:
            raise BagualuError("enforcer acquire: the enforcer was destroyed")
        ptr = _c_void()

        def attempt() -> None:
            self._check(self.lib.bgl_enf_acquire(self.handle, handle, -1, self._stream(),
                                                 ctypes.byref(ptr)), "acquire")
        try:
            attempt()
        except OutOfMemoryError as e:  # no room for the reload: evict, then try again
            if self.evict is None:
                raise
            poolmod.retry_after_eviction(attempt, nbytes, self.evict, e)
        self.pending -= 1
        self.live_blocks += 1

        def done(h: int = handle) -> None:
            self.live_blocks -= 1
            self.lib.bgl_enf_release(self.handle, h, -1, self._stream())
            self._destroy_if_done()

        block = _Block(ptr.value, nbytes, self.cuda, done)
        if self.cuda:
            t = torch.as_tensor(block, device=self.device)
        else:
            import numpy as np
            t = torch.from_numpy(np.asarray(block))
        return t.untyped_storage()

    def release(self, handle: int) -> None:
        """Forgets a tensor that was offloaded and never acquired (frees its pinned copy)."""
        if self.destroyed:
            return
        self.lib.bgl_enf_release(self.handle, handle, -1, self._stream())
        self.pending -= 1
        self._destroy_if_done()

    def synchronize(self) -> None:
        """Waits for every queued copy (and so for the pinned memory they free)."""
        if self.destroyed:
            return
        self._check(self.lib.bgl_enf_synchronize(self.handle), "synchronize")

    def stats(self) -> Dict[str, int]:
        if self.destroyed:
            return {}
        s = _Stats()
        self._check(self.lib.bgl_enf_get_stats(self.handle, ctypes.byref(s)), "stats")
        return {name: int(getattr(s, name)) for name in _STAT_FIELDS}

    def close(self) -> None:
        """Destroys the enforcer once nothing it holds is still needed: graphs built before
        uninstall may still reload their offloaded activations, and reloaded blocks stay valid
        while PyTorch holds them."""
        self.closing = True
        self._destroy_if_done()

    def _destroy_if_done(self) -> None:
        if self.closing and not self.destroyed and self.live_blocks == 0 and self.pending == 0:
            self.destroyed = True
            self.lib.bgl_enf_destroy(self.handle)
