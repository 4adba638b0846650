"""The enforcer of libbgl_enforce.so (bgl/enforce.h) through ctypes: the one place where a saved
activation changes placement. Every captured storage is registered with it (its producer, the
operators that saved it, the plan's strategy); it offloads to its pinned host pool on its D2H
stream and reloads on its H2D stream into a block of the allocator's pool, casts to FP8 and back
with the kernels of kernels/ (the CUDA kernels on a GPU, their bit-identical host twin on CPU),
and drops data for recompute, calling back into the package (recompute.py) when the data is
needed again.

PyTorch keeps owning the memory it allocated (registrations are borrowed); the enforcer owns the
pinned copies, the FP8 copies and the blocks it reloads or uncasts into, which PyTorch sees as a
tensor whose storage tells the enforcer when it dies.

Not thread-safe on the Python side: used from the training thread (and the autograd thread that
runs unpack hooks while the training thread waits in backward()).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import pool as poolmod
from .errors import BagualuError, OutOfMemoryError

log = logging.getLogger("bagualu")

_c_void, _c_size, _c_int, _c_u64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint64
_ERR_OUT_OF_MEMORY = 2
_ERR_DUPLICATE = 12
_ERR_CALLBACK = 16
# bgl_status values of a piece the scheduler skipped: out of memory, invalid state, conflict,
# pinned pool exhausted.
_SKIPPED_PIECE = (_ERR_OUT_OF_MEMORY, 13, 14, 15)
# bgl_dtype: the element types the FP8 cast accepts; anything else is moved as bytes.
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_BYTES = 3
# bgl_placement
PLACE_DEVICE, PLACE_HOST, PLACE_FP8, PLACE_DROPPED = 0, 1, 2, 3
# The consumer every registration gets first: the package's record itself. The enforcer retires
# a tensor when all its consumers released it; this one is released only when the record is
# gone, so a reloaded block is never freed while a consumer of the record may still need it.
HOLDER = (1 << 31) - 1


def fp8_supported(dtype: torch.dtype) -> bool:
    """Whether the enforcer can store a tensor of ``dtype`` in FP8."""
    return dtype in _DTYPE_CODES


class _Options(ctypes.Structure):
    _fields_ = [("device", _c_int), ("pinned_capacity", _c_size), ("fp8_block", _c_size),
                ("max_inflight", _c_int), ("d2h_stream", _c_void), ("h2d_stream", _c_void),
                ("pressure_eviction", _c_int), ("log", _c_int)]


class _Desc(ctypes.Structure):
    _fields_ = [("ptr", _c_void), ("bytes", _c_size), ("dtype", _c_int), ("producer_op", _c_int),
                ("graph_tensor", _c_int), ("micro_batch", _c_int), ("stream", _c_void),
                ("flags", ctypes.c_uint32)]


class _Info(ctypes.Structure):
    _fields_ = [("placement", _c_int), ("applied", _c_int), ("planned", _c_int),
                ("pending", _c_int), ("num_consumers", _c_int), ("num_released", _c_int),
                ("bytes", _c_size), ("device_ptr", _c_void), ("host_ptr", _c_void),
                ("fp8_ptr", _c_void), ("fp8_bytes", _c_size), ("need_order", ctypes.c_int64)]


_STAT_FIELDS = ("tracked", "registered", "retired", "offloads", "reloads", "fp8_casts",
                "fp8_uncasts", "drops", "recomputes", "bytes_d2h", "bytes_h2d", "bytes_fp8_saved",
                "evictions", "evicted_bytes", "pressure_calls", "unreloads", "scheduled_issued",
                "scheduled_max_inflight", "device_bytes", "host_bytes", "fp8_bytes",
                "pinned_in_use", "pinned_cached", "pinned_peak", "pinned_capacity",
                "pinned_allocs", "pinned_hits", "pinned_failures")


class _Item(ctypes.Structure):
    _fields_ = [("chain", _c_int), ("stage", _c_int), ("round", _c_int), ("resource", _c_int),
                ("first", _c_int), ("last", _c_int)]


class _Stats(ctypes.Structure):
    _fields_ = [(name, _c_u64) for name in _STAT_FIELDS]


_RECOMPUTE_FN = ctypes.CFUNCTYPE(_c_int, _c_u64, _c_int, _c_int, _c_void,
                                 ctypes.POINTER(_c_void))


def _bind(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_bgl_enf_bound", False):
        return
    handle_p = ctypes.POINTER(_c_void)
    h = [_c_void, _c_u64]
    sigs = {
        "bgl_enf_default_options": ([ctypes.POINTER(_Options)], None),
        "bgl_enf_create": ([ctypes.POINTER(_Options), handle_p], _c_int),
        "bgl_enf_destroy": ([_c_void], _c_int),
        "bgl_enf_register": ([_c_void, ctypes.POINTER(_Desc), ctypes.POINTER(_c_u64)], _c_int),
        "bgl_enf_add_consumer": (h + [_c_int], _c_int),
        "bgl_enf_set_strategy": (h + [_c_int], _c_int),
        "bgl_enf_query": (h + [ctypes.POINTER(_Info)], _c_int),
        "bgl_enf_offload": (h, _c_int),
        "bgl_enf_store_fp8": (h, _c_int),
        "bgl_enf_drop": (h, _c_int),
        "bgl_enf_set_recompute_callback": ([_c_void, _RECOMPUTE_FN, _c_void], _c_int),
        "bgl_enf_acquire": (h + [_c_int, _c_void, handle_p], _c_int),
        "bgl_enf_release": (h + [_c_int, _c_void], _c_int),
        "bgl_enf_unregister": (h, _c_int),
        "bgl_enf_wait_tensor": (h, _c_int),
        "bgl_enf_synchronize": ([_c_void], _c_int),
        "bgl_enf_get_stats": ([_c_void, ctypes.POINTER(_Stats)], _c_int),
        "bgl_enf_enum_value": ([ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_c_int)],
                               _c_int),
        "bgl_enf_set_graph_index": (h + [_c_int, _c_int], _c_int),
        "bgl_enf_set_need_order": (h + [ctypes.c_int64], _c_int),
        "bgl_enf_schedule_begin": ([_c_void, ctypes.POINTER(_Item), _c_size, _c_int, _c_int],
                                   _c_int),
        "bgl_enf_schedule_reached": ([_c_void, _c_int, _c_int], _c_int),
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


class _Block:
    """A block the enforcer made (a reload or an uncast) as the owner of a tensor's memory
    (NumPy's array interface on the host backend, ``__cuda_array_interface__`` on CUDA);
    ``done`` tells the enforcer when PyTorch lets go of the memory."""

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
    backend's device 0 on CPU). Handles are the enforcer's tensor handles (ints, never 0)."""

    def __init__(self, device: torch.device, pinned_capacity: int, borrowed_free_is_safe: bool,
                 evict: Optional[Callable[[int], int]] = None, fp8_block: int = 128) -> None:
        poolmod.load()  # the allocator first: the enforcer binds to its pool
        self.lib = poolmod.load_enforce()
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
        opts.fp8_block = int(fp8_block)
        opts.pressure_eviction = 0  # the runtime's pressure callback decides what moves
        handle = _c_void()
        self._check(self.lib.bgl_enf_create(ctypes.byref(opts), ctypes.byref(handle)), "create")
        self.handle = handle.value
        # handle -> function regenerating a dropped tensor; returns its data pointer
        self.regenerators: Dict[int, Callable[[], int]] = {}
        self._callback_error: Optional[BaseException] = None
        self._enums: Dict[Tuple[str, str], int] = {}
        self._callback = _RECOMPUTE_FN(self._recompute)  # kept alive as long as the enforcer
        self._check(self.lib.bgl_enf_set_recompute_callback(self.handle, self._callback, None),
                    "set_recompute_callback")
        self.skipped_pieces = 0  # scheduled pieces that could not be carried out
        self.live_blocks = 0  # blocks PyTorch still holds
        self.tracked = 0      # registered tensors not yet retired
        self.closing = False  # close() was called: destroy once nothing is outstanding
        self.destroyed = False

    # -- helpers ----------------------------------------------------------------------------
    def _error(self) -> str:
        msg = self.lib.bgl_enf_last_error()
        return msg.decode() if msg else "unknown error"

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        if rc == _ERR_CALLBACK and self._callback_error is not None:
            err, self._callback_error = self._callback_error, None
            raise err
        text = f"enforcer {what}: {self._error()}"
        if rc == _ERR_OUT_OF_MEMORY:
            raise OutOfMemoryError(text)
        raise BagualuError(text)

    def _stream(self) -> Optional[int]:
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def _recompute(self, handle: int, producer_op: int, micro_batch: int, user: Any,
                   out: Any) -> int:
        """The enforcer needs a dropped tensor: the package reruns its producer."""
        try:
            regen = self.regenerators.pop(handle, None)
            if regen is None:
                raise BagualuError(f"enforcer: tensor {handle} was dropped without a way to "
                                   "regenerate it")
            out[0] = regen()
            return 0
        except BaseException as e:  # raised again by the call that needed the data
            self._callback_error = e
            return 1

    # -- tracker ----------------------------------------------------------------------------
    def register(self, storage: torch.UntypedStorage, dtype: torch.dtype, producer_op: int,
                 micro_batch: int, graph_tensor: int = -1) -> int:
        """Tracks a saved storage (borrowed: PyTorch keeps its memory); returns the handle, or 0
        when another record tracks the storage already (one storage saved by two micro-batches,
        e.g. a chunk's output that the next chunk of this rank saves too: it stays where it
        is)."""
        desc = _Desc(ptr=storage.data_ptr(), bytes=storage.nbytes(),
                     dtype=_DTYPE_CODES.get(dtype, _BYTES), producer_op=producer_op,
                     graph_tensor=graph_tensor, micro_batch=micro_batch, stream=self._stream(),
                     flags=0)
        h = _c_u64(0)
        rc = self.lib.bgl_enf_register(self.handle, ctypes.byref(desc), ctypes.byref(h))
        if rc == _ERR_DUPLICATE:
            return 0
        self._check(rc, "register")
        self.tracked += 1
        self._check(self.lib.bgl_enf_add_consumer(self.handle, h, HOLDER), "add_consumer")
        return h.value

    def add_consumer(self, handle: int, op: int) -> None:
        """Operator ``op`` saved the tensor too."""
        rc = self.lib.bgl_enf_add_consumer(self.handle, handle, op)
        if rc != 0 and rc != _ERR_DUPLICATE:  # already a consumer
            self._check(rc, "add_consumer")

    def enum_value(self, kind: str, name: str) -> int:
        """The number of the planner's ``name`` of a strategy, chain or resource (``kind``):
        the planner is the one vocabulary, nothing is retyped here."""
        key = (kind, name)
        v = self._enums.get(key)
        if v is None:
            out = _c_int(0)
            self._check(self.lib.bgl_enf_enum_value(kind.encode(), name.encode(),
                                                    ctypes.byref(out)), "enum_value")
            v = self._enums[key] = out.value
        return v

    def set_strategy(self, handle: int, strategy: str) -> None:
        """Records the plan's strategy (keep, recompute, offload, fp8) for the tensor."""
        self._check(self.lib.bgl_enf_set_strategy(self.handle, handle,
                                                  self.enum_value("strategy", strategy)),
                    "set_strategy")

    def set_graph_index(self, handle: int, producer_op: int, graph_tensor: int) -> None:
        """Where the tensor is in the planner's stage graph (the issue order names those)."""
        self._check(self.lib.bgl_enf_set_graph_index(self.handle, handle, producer_op,
                                                     graph_tensor), "set_graph_index")

    def set_need_order(self, handle: int, order: int) -> None:
        """Reload order key: smaller is needed sooner (and evicted later)."""
        self._check(self.lib.bgl_enf_set_need_order(self.handle, handle, order),
                    "set_need_order")

    def offloaded(self, handle: int) -> bool:
        """Whether the tensor is in the pinned pool (its copy complete, or PyTorch may free the
        source before it ends)."""
        if self.query(handle).placement != PLACE_HOST:
            return False
        if not self.borrowed_free_is_safe:
            self._check(self.lib.bgl_enf_wait_tensor(self.handle, handle), "offload")
        return True

    def take_offloaded(self) -> List[int]:
        """Handles whose offload, issued by the stream scheduler, completed since the last
        call (retires finished pieces and issues more first)."""
        self._piece(self.lib.bgl_enf_schedule_poll(self.handle, None), "schedule_poll")
        out: List[int] = []
        buf = (_c_u64 * 256)()
        n = _c_size(0)
        while True:
            self._check(self.lib.bgl_enf_take_offloaded(self.handle, buf, 256, ctypes.byref(n)),
                        "take_offloaded")
            out.extend(buf[i] for i in range(n.value))
            if n.value < 256:
                return out

    # -- stream scheduler -------------------------------------------------------------------
    def schedule_begin(self, order: Sequence[Dict[str, Any]], offload_micro_batch: int,
                       recover_micro_batch: int) -> None:
        """Loads a point's issue order (the plan's items: chain, stage, round, resource, first,
        last); O pieces move tensors of ``offload_micro_batch``, R pieces bring back those of
        ``recover_micro_batch`` (-1: none)."""
        items = (_Item * max(len(order), 1))()
        for i, it in enumerate(order):
            items[i] = _Item(self.enum_value("chain", it["chain"]), int(it["stage"]),
                             int(it["round"]), self.enum_value("resource", it["resource"]),
                             int(it.get("first", -1)), int(it.get("last", -1)))
        self._check(self.lib.bgl_enf_schedule_begin(self.handle, items, len(order),
                                                    offload_micro_batch, recover_micro_batch),
                    "schedule_begin")

    def schedule_reached(self, chain: str, stage: int) -> None:
        """Compute reached the start of ``stage`` of chain F or B."""
        self._piece(self.lib.bgl_enf_schedule_reached(self.handle,
                                                      self.enum_value("chain", chain), stage),
                    "schedule_reached")

    def schedule_finish(self) -> None:
        """Issues what is left of the order and waits for it."""
        self._piece(self.lib.bgl_enf_schedule_finish(self.handle), "schedule_finish")

    def _piece(self, rc: int, what: str) -> None:
        """A piece the scheduler could not carry out (no room for a reload, the pinned pool
        full, a tensor that moved meanwhile) is skipped: its tensors stay where they are and
        the backward's acquire brings them back. Counted, said once; anything else raises."""
        if rc in _SKIPPED_PIECE:
            self.skipped_pieces += 1
            if self.skipped_pieces == 1:
                log.info("bagualu: a scheduled piece was skipped (%s); its tensors stay where "
                         "they are", self._error())
            return
        self._check(rc, what)

    def prefetch(self, micro_batch: int) -> None:
        """Reloads the micro-batch's offloaded tensors in need order, a bounded number ahead
        of the backward (each acquire makes room for the next)."""
        if self.destroyed:
            return
        rc = self.lib.bgl_enf_prefetch(self.handle, micro_batch, None)
        if rc == _ERR_OUT_OF_MEMORY:  # no room yet: each acquire reloads what it needs
            return
        self._check(rc, "prefetch")

    def query(self, handle: int) -> _Info:
        info = _Info()
        self._check(self.lib.bgl_enf_query(self.handle, handle, ctypes.byref(info)), "query")
        return info

    def retire(self, handle: int) -> None:
        """The record is gone and no block of it is alive: forget the tensor and free what the
        enforcer holds for it (pinned copy, FP8 copy)."""
        self.regenerators.pop(handle, None)
        if self.destroyed:
            return
        self.lib.bgl_enf_unregister(self.handle, handle)
        self.tracked -= 1
        self._destroy_if_done()

    # -- moves ------------------------------------------------------------------------------
    def offload(self, handle: int) -> None:
        """Copies the tensor to the pinned pool on the D2H stream (after its producer's
        stream); waits for the copy unless PyTorch may free the source before it ends."""
        self._check(self.lib.bgl_enf_offload(self.handle, handle), "offload")
        if not self.borrowed_free_is_safe:
            self._check(self.lib.bgl_enf_wait_tensor(self.handle, handle), "offload")

    def store_fp8(self, handle: int) -> int:
        """Casts the tensor to e4m3 with per-block scales on its producer's stream (PyTorch
        frees the original in that stream's order); returns the bytes of the FP8 copy."""
        self._check(self.lib.bgl_enf_store_fp8(self.handle, handle), "store_fp8")
        return int(self.query(handle).fp8_bytes)

    def drop(self, handle: int, regenerate: Callable[[], int]) -> None:
        """Gives up the tensor's data; ``regenerate`` makes it again and returns its pointer
        when the enforcer next needs it."""
        self._check(self.lib.bgl_enf_drop(self.handle, handle), "drop")
        self.regenerators[handle] = regenerate

    def acquire(self, handle: int, nbytes: int,
                on_done: Callable[[], None]) -> torch.UntypedStorage:
        """The full-precision data of an offloaded or FP8 tensor as a storage on the device
        (reloaded or uncast into a block of the enforcer); the current stream waits for it.
        ``on_done`` runs when the storage dies."""
        ptr = self._acquire(handle, nbytes)
        self.live_blocks += 1

        def done(h: int = handle) -> None:
            self.live_blocks -= 1
            if not self.destroyed:
                self.lib.bgl_enf_release(self.handle, h, -1, self._stream())
            on_done()
            self._destroy_if_done()

        block = _Block(ptr, nbytes, self.cuda, done)
        if self.cuda:
            t = torch.as_tensor(block, device=self.device)
        else:
            import numpy as np
            t = torch.from_numpy(np.asarray(block))
        return t.untyped_storage()

    def recompute(self, handle: int) -> None:
        """Brings a dropped tensor back through its regenerator (borrowed again: the package
        holds the new storage)."""
        self._acquire(handle, 0)
        self.lib.bgl_enf_release(self.handle, handle, -1, self._stream())

    def _acquire(self, handle: int, nbytes: int) -> int:
        if self.destroyed:
            raise BagualuError("enforcer acquire: the enforcer was destroyed")
        ptr = _c_void()

        def attempt() -> None:
            self._check(self.lib.bgl_enf_acquire(self.handle, handle, -1, self._stream(),
                                                 ctypes.byref(ptr)), "acquire")
        try:
            attempt()
        except OutOfMemoryError as e:  # no room for the reload or uncast: evict, try again
            if self.evict is None:
                raise
            poolmod.retry_after_eviction(attempt, nbytes, self.evict, e)
        return int(ptr.value or 0)

    def set_pinned_capacity(self, nbytes: int) -> None:
        """Resizes the pinned host pool (the node's grant changed); offloads that do not fit
        fail and leave their activations on the device until copies come back."""
        if not self.destroyed:
            self._check(self.lib.bgl_enf_set_pinned_capacity(self.handle, int(nbytes)),
                        "set_pinned_capacity")

    def give_back(self, needed: int) -> int:
        """Gives back device memory the enforcer owns (reloads no consumer took yet; the data
        stays on the host) until ``needed`` bytes; returns the bytes freed."""
        if self.destroyed:
            return 0
        freed = _c_size(0)
        self._check(self.lib.bgl_enf_evict(self.handle, needed, ctypes.byref(freed)), "evict")
        return int(freed.value)

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
        uninstall may still need their moved activations, and blocks stay valid while PyTorch
        holds them."""
        self.closing = True
        self._destroy_if_done()

    def _destroy_if_done(self) -> None:
        if self.closing and not self.destroyed and self.live_blocks == 0 and self.tracked == 0:
            self.destroyed = True
            self.regenerators.clear()
            self.lib.bgl_enf_destroy(self.handle)
