"""The enforcer of libbgl_enforce.so (bgl/enforce.h): the one place where a saved
activation changes placement. Every captured storage that moves is registered with it (its
producer, the operators that saved it, the plan's strategy; a kept one when it first moves); it
offloads to its pinned host pool on its D2H stream and reloads on its H2D stream into a block of
the allocator's pool, casts to FP8 and back with the kernels of kernels/ (the CUDA kernels on a
GPU, their bit-identical host twin on CPU), and drops data for recompute, calling back into the
package (recompute.py) when the data is needed again.

The hot calls (registration, moves, acquire and release, retire, prefetch) go through the compiled
binding (native/ext.py: bagualu._C, no ctypes); the rest through ctypes (native/enforce.py).

PyTorch keeps owning the memory it allocated (registrations are borrowed); the enforcer owns the
pinned copies, the FP8 copies and the blocks it reloads or uncasts into, which PyTorch sees as a
tensor whose storage tells the enforcer when it dies.

Not thread-safe on the Python side: used from the training thread (and the autograd thread that
runs unpack hooks while the training thread waits in backward()).
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..native import enforce as native
from ..native import ext
from ..native.enforce import HOLDER
from ..errors import BagualuError, NotReady, OutOfMemoryError
from .pool import retry_after_eviction

log = logging.getLogger("bagualu")

FP8_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # bgl_dtype's element types


def fp8_supported(dtype: torch.dtype) -> bool:
    """Whether the enforcer can store a tensor of ``dtype`` in FP8."""
    return dtype in FP8_DTYPES


class Enforcer:
    """One enforcer over the allocator's pool of one device (CUDA device index, or the host
    backend's device 0 on CPU). Handles are the enforcer's tensor handles (ints, never 0)."""

    def __init__(self, device: torch.device, pinned_capacity: int, borrowed_free_is_safe: bool,
                 evict: Optional[Callable[[int], int]] = None, fp8_block: int = 128,
                 sync_copies: bool = False) -> None:
        self.lib = native.load()
        self.vocab = native.vocabulary(self.lib)
        self.device = device
        self.cuda = device.type == "cuda"
        # With libbgl_alloc.so as PyTorch's allocator, the enforcer marks borrowed blocks used on
        # its copy stream, so PyTorch may free them before the copy ends; other memory must
        # outlive the copy (foreign memory rule in bgl/enforce.h).
        self.borrowed_free_is_safe = borrowed_free_is_safe
        self.evict = evict  # frees device bytes when a reload finds no room (may be None)
        opts = native.Options()
        self.lib.bgl_enf_default_options(ctypes.byref(opts))
        opts.device = (device.index or 0) if self.cuda else 0
        opts.pinned_capacity = int(pinned_capacity)
        opts.fp8_block = int(fp8_block)
        opts.pressure_eviction = 0  # the runtime's pressure callback decides what moves
        # The host backend's copies on the calling thread (no copy threads): where they would
        # not overlap compute anyway (the calibration's copy_overlap 0), each offload and
        # reload the training thread waits for costs no hand-off to a copy thread.
        opts.sync_copies = int(bool(sync_copies) and not self.cuda)
        self.sync_copies = bool(opts.sync_copies)
        # Reloads prefetch keeps waiting for their first consumer (the library's default).
        self.max_inflight = int(opts.max_inflight)
        handle = ctypes.c_void_p()
        self._check(self.lib.bgl_enf_create(ctypes.byref(opts), ctypes.byref(handle)), "create")
        self.handle = handle.value
        # handle -> function regenerating a dropped tensor; returns its data pointer
        self.regenerators: Dict[int, Callable[[], int]] = {}
        self._callback_error: Optional[BaseException] = None
        self._enums: Dict[Tuple[str, str], int] = {}
        self._callback = native.RECOMPUTE_FN(self._recompute)  # kept alive as long as the enforcer
        self._check(self.lib.bgl_enf_set_recompute_callback(self.handle, self._callback, None),
                    "set_recompute_callback")
        self.skipped_pieces = 0  # scheduled pieces that could not be carried out
        self.live_blocks = 0  # blocks PyTorch still holds
        self.tracked = 0      # registered tensors not yet retired
        self.closing = False  # close() was called: destroy once nothing is outstanding
        self.destroyed = False
        # The hot path's calls, through the compiled binding (each returns the status with its
        # outputs): registration and the register-and-move calls, moves, acquire and release.
        binding = ext.load()
        self.fast = binding.Enforcer(self.lib._handle, self.handle, HOLDER)
        self._block_storage = binding.block_storage
        self._device_type = 1 if self.cuda else 0
        self._device_index = (device.index or 0) if self.cuda else 0
        self._dtypes = dict(self.vocab.dtype)
        self._dtype_bytes = self.vocab.dtype_bytes
        self._store_fp8 = self.lib.bgl_enf_store_fp8

    # -- helpers ----------------------------------------------------------------------------
    def _error(self) -> str:
        msg = self.lib.bgl_enf_last_error()
        return msg.decode() if msg else "unknown error"

    def _check(self, rc: int, what: str) -> None:
        if rc == 0:
            return
        if rc == self.vocab.callback and self._callback_error is not None:
            err, self._callback_error = self._callback_error, None
            raise err
        text = f"enforcer {what}: {self._error()}"
        if rc == self.vocab.out_of_memory:
            raise OutOfMemoryError(text)
        raise BagualuError(text)

    def current_stream(self) -> Optional[int]:
        """The current CUDA stream's handle (None on the host backend)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def _recompute(self, handle: int, producer_op: int, micro_batch: int, user: Any,
                   out: Any) -> int:
        """The enforcer needs a dropped tensor: the package reruns its producer."""
        try:
            regen = self.regenerators.pop(handle, None)
            if regen is None:
                raise BagualuError(f"enforcer: tensor {handle} was dropped without a way to "
                                   "regenerate it")
            try:
                out[0] = regen()
            except NotReady:  # not now: the tensor stays dropped, its rerun comes on demand
                self.regenerators[handle] = regen
                raise
            return 0
        except BaseException as e:  # raised again by the call that needed the data
            self._callback_error = e
            return 1

    # -- tracker ----------------------------------------------------------------------------
    def register(self, storage: torch.UntypedStorage, dtype: torch.dtype, producer_op: int,
                 micro_batch: int, need_order: Optional[int] = None, consumer: int = -1,
                 graph_tensor: int = -1, stream: Optional[int] = None, ptr: int = 0,
                 nbytes: int = -1) -> int:
        """Tracks a saved storage (borrowed: PyTorch keeps its memory) with its reload order
        key (``need_order``; None: the enforcer's default) and the operator that saved it
        (``consumer``, -1: none yet), in one call of the C ABI; returns the handle, or 0 when
        another record tracks the storage already (one storage saved by two micro-batches,
        e.g. a chunk's output that the next chunk of this rank saves too: it stays where it
        is). ``stream``: the CUDA stream that produced it (None: the current one). ``ptr`` and
        ``nbytes``: the storage's, where the caller read them already (the hot path reads each
        once)."""
        if need_order is None:  # bgl_enf_set_need_order's default
            need_order = (micro_batch << 32) + (1 << 31) - 1 - producer_op
        rc, h = self.fast.register_saved(
            ptr or storage.data_ptr(), nbytes if nbytes >= 0 else storage.nbytes(),
            self._dtypes.get(dtype, self._dtype_bytes), producer_op, micro_batch, need_order,
            consumer, self._stream(stream))
        if rc != 0:
            if rc == self.vocab.duplicate:
                return 0
            self._check(rc, "register")
        self.tracked += 1
        if graph_tensor >= 0:
            self.set_graph_index(h, producer_op, graph_tensor)
        return h

    def offload_saved(self, storage: torch.UntypedStorage, dtype: torch.dtype,
                      producer_op: int, micro_batch: int, need_order: int,
                      consumer: int = -1, ptr: int = 0,
                      nbytes: int = -1) -> Tuple[int, Optional[BagualuError]]:
        """register() and offload() in one call of the C ABI (a pack whose strategy is
        offload, carried out at once on synchronous copies): the handle (0 as register's) and
        None, or the handle of a tensor left on the device and why its offload failed."""
        h, error = self._move_saved(self.fast.offload_saved, "offload", storage, dtype,
                                    producer_op, micro_batch, need_order, consumer, ptr, nbytes)
        if h and error is None and not self.borrowed_free_is_safe and not self.sync_copies:
            self._check(self.fast.wait(h), "offload")
        return h, error

    def store_fp8_saved(self, storage: torch.UntypedStorage, dtype: torch.dtype,
                        producer_op: int, micro_batch: int, need_order: int,
                        consumer: int = -1, ptr: int = 0,
                        nbytes: int = -1) -> Tuple[int, Optional[BagualuError], int]:
        """register() and store_fp8() in one call of the C ABI (a pack whose strategy is fp8,
        carried out at once on the host backend): as offload_saved, and the bytes of the FP8
        copy (0 where none was made)."""
        h, error, fp8_bytes = self._move_saved(self.fast.store_fp8_saved, "store_fp8", storage,
                                               dtype, producer_op, micro_batch, need_order,
                                               consumer, ptr, nbytes)
        return h, error, fp8_bytes if h and error is None else 0

    def _move_saved(self, fn: Any, what: str, storage: torch.UntypedStorage,
                    dtype: torch.dtype, producer_op: int, micro_batch: int, need_order: int,
                    consumer: int, ptr: int, nbytes: int) -> Tuple[Any, ...]:
        """One of the binding's register-and-move calls (``fn``, the move named ``what``): the
        handle (0 where another record tracks the storage) and None, or the handle of a tensor
        left registered on the device and why the move failed; then ``fn``'s extra outputs."""
        rc, h, *out = fn(ptr or storage.data_ptr(), nbytes if nbytes >= 0 else storage.nbytes(),
                         self._dtypes.get(dtype, self._dtype_bytes), producer_op, micro_batch,
                         need_order, consumer, self._stream(None))
        return (*self.saved_outcome(rc, h, what), *out)

    def saved_outcome(self, rc: int, h: int, what: str) -> Tuple[int, Optional[BagualuError]]:
        """A register-and-move call answered ``rc`` with ``h``: the handle (0 where another
        record tracks the storage) and None, or the handle of a tensor left registered on the
        device and why the move (named ``what``) failed; a failed registration raises."""
        if rc == 0 or h:
            self.tracked += 1
        if rc == 0:
            return h, None
        if not h:
            if rc == self.vocab.duplicate:
                return 0, None
            self._check(rc, "register")
        try:
            self._check(rc, what)
        except BagualuError as e:
            return h, e
        return h, None

    def _stream(self, stream: Optional[int]) -> int:
        """The stream a call names: ``stream``, else the current CUDA stream (0 on the host
        backend: its calls run on the calling thread or its copy threads)."""
        if not self.cuda:
            return 0
        return stream if stream is not None else (self.current_stream() or 0)

    def add_consumer(self, handle: int, op: int) -> None:
        """Operator ``op`` saved the tensor too."""
        rc = self.fast.add_consumer(handle, op)
        if rc != 0 and rc != self.vocab.duplicate:  # already a consumer
            self._check(rc, "add_consumer")

    def enum_value(self, kind: str, name: str) -> int:
        """The number of ``name`` of an enum of the ABI (``kind``: strategy, chain, resource,
        placement, dtype, status): the library is the one vocabulary, nothing is retyped."""
        key = (kind, name)
        v = self._enums.get(key)
        if v is None:
            v = self._enums[key] = self.vocab.value(kind, name)
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
        rc, placement, _, _ = self.fast.state(handle)
        self._check(rc, "query")
        if placement != self.vocab.place_host:
            return False
        if not self.borrowed_free_is_safe:
            self._check(self.fast.wait(handle), "offload")
        return True

    def take_offloaded(self) -> List[int]:
        """Handles whose offload, issued by the stream scheduler, completed since the last
        call (retires finished pieces and issues more first)."""
        self._piece(self.lib.bgl_enf_schedule_poll(self.handle, None), "schedule_poll")
        out: List[int] = []
        buf = (ctypes.c_uint64 * 256)()
        n = ctypes.c_size_t(0)
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
        items = (native.Item * max(len(order), 1))()
        for i, it in enumerate(order):
            items[i] = native.Item(self.enum_value("chain", it["chain"]), int(it["stage"]),
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
        declined = rc == self.vocab.callback and isinstance(self._callback_error, NotReady)
        if declined:  # a recompute that must wait for its parameters (FSDP2)
            self._callback_error = None
        if declined or rc in self.vocab.skipped_piece:
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
        rc = self.fast.prefetch(micro_batch)
        if rc == self.vocab.out_of_memory:  # no room yet: each acquire reloads what it needs
            return
        self._check(rc, "prefetch")

    def query(self, handle: int) -> native.Info:
        info = native.Info()
        self._check(self.lib.bgl_enf_query(self.handle, handle, ctypes.byref(info)), "query")
        return info

    def retire(self, handle: int) -> None:
        """The record is gone and no block of it is alive: forget the tensor and free what the
        enforcer holds for it (pinned copy, FP8 copy)."""
        self.regenerators.pop(handle, None)
        if self.destroyed:
            return
        self.fast.unregister(handle)
        self.tracked -= 1
        self._destroy_if_done()

    # -- moves ------------------------------------------------------------------------------
    def offload(self, handle: int, wait: bool = True) -> None:
        """Copies the tensor to the pinned pool on the D2H stream (after its producer's
        stream); waits for the copy unless PyTorch may free the source before it ends (or
        ``wait`` is False: the caller keeps the source until wait())."""
        rc = self.fast.offload(handle)
        # Synchronous copies (the host backend's, on the training thread) are done already.
        if rc == 0 and wait and not self.borrowed_free_is_safe and not self.sync_copies:
            rc = self.fast.wait(handle)
        if rc != 0:
            self._check(rc, "offload")

    def copy_done(self, handle: int) -> bool:
        """Whether no copy or cast of the tensor may still run (never blocks)."""
        rc, _, pending, _ = self.fast.state(handle)
        self._check(rc, "query")
        return not pending

    def wait(self, handle: int) -> None:
        """Blocks until the tensor's queued copies and casts completed."""
        self._check(self.fast.wait(handle), "wait")

    def store_fp8(self, handle: int) -> int:
        """Casts the tensor to e4m3 with per-block scales on its producer's stream (PyTorch
        frees the original in that stream's order); returns the bytes of the FP8 copy."""
        self._check(self._store_fp8(self.handle, handle), "store_fp8")
        rc, _, _, fp8_bytes = self.fast.state(handle)
        self._check(rc, "query")
        return fp8_bytes

    def drop(self, handle: int, regenerate: Callable[[], int]) -> None:
        """Gives up the tensor's data; ``regenerate`` makes it again and returns its pointer
        when the enforcer next needs it."""
        self._check(self.lib.bgl_enf_drop(self.handle, handle), "drop")
        self.regenerators[handle] = regenerate

    def acquire(self, handle: int, nbytes: int,
                on_done: Callable[[], bool]) -> torch.UntypedStorage:
        """The full-precision data of an offloaded or FP8 tensor as a storage on the device
        (reloaded or uncast into a block of the enforcer); the current stream waits for it.
        ``on_done`` runs when the storage dies and says whether it retired the tensor (on
        the host backend, whose memory no stream order guards, the retirement frees the block
        in the same call; on CUDA the release first tells the pool PyTorch's stream)."""
        ptr = self._acquire(handle, nbytes)
        self.live_blocks += 1
        return self._block_storage(ptr, nbytes, self._device_type, self._device_index,
                                   functools.partial(self.block_done, handle, on_done))

    def block_done(self, handle: int, on_done: Callable[[], bool]) -> None:
        """PyTorch let go of the block acquire() made for ``handle`` (the binding's reloads
        call this too); ``on_done`` says whether that retired the tensor."""
        self.live_blocks -= 1
        if self.destroyed:
            on_done()
        elif self.cuda:  # the pool learns PyTorch's stream before the block goes
            self.fast.release(handle, self.current_stream() or 0)
            on_done()
        elif not on_done():  # not retired yet: the record still holds the tensor
            self.fast.release(handle, 0)
        self._destroy_if_done()

    def recompute(self, handle: int) -> None:
        """Brings a dropped tensor back through its regenerator (borrowed again: the package
        holds the new storage)."""
        self._acquire(handle, 0)
        self.fast.release(handle, self._stream(None))

    def _acquire(self, handle: int, nbytes: int) -> int:
        if self.destroyed:
            raise BagualuError("enforcer acquire: the enforcer was destroyed")
        rc, ptr = self.fast.acquire(handle, self._stream(None))
        if rc == 0:
            return ptr
        got = [0]

        def attempt() -> None:
            rc, got[0] = self.fast.acquire(handle, self._stream(None))
            self._check(rc, "acquire")
        try:
            self._check(rc, "acquire")
        except OutOfMemoryError as e:  # no room for the reload or uncast: evict, try again
            if self.evict is None:
                raise
            retry_after_eviction(attempt, nbytes, self.evict, e)
        return got[0]

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
        freed = ctypes.c_size_t(0)
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
        s = native.Stats()
        self._check(self.lib.bgl_enf_get_stats(self.handle, ctypes.byref(s)), "stats")
        return {name: int(getattr(s, name)) for name in native.STAT_FIELDS}

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
