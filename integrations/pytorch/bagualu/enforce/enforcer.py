"""The enforcer of libbgl_enforce.so (bgl/enforce.h): the one place where a saved
activation changes placement. Every captured storage that moves is registered with it (its
producer, the operators that saved it, the plan's strategy; a kept one when it first moves); it
offloads to its pinned host pool on its D2H stream and reloads on its H2D stream into a block of
the allocator's pool, casts to FP8 and back with the kernels of kernels/ (the CUDA kernels on a
GPU, their bit-identical host twin on CPU), and drops data for recompute, calling back into the
package (recompute.py) when the data is needed again.

The hot calls (registration, moves, acquire and release, retire, prefetch) go through the compiled
binding (native/ext.py: bagualu._C, no ctypes); the rest through ctypes (native/enforce.py). The
handle's creation, errors and whole-enforcer calls are enforce/handle.py's; the issue order's
calls are its stream scheduler's (enforce/scheduler.py); what to move and when is the Mover's
(enforce/mover.py).

PyTorch keeps owning the memory it allocated (registrations are borrowed); the enforcer owns the
pinned copies, the FP8 copies and the blocks it reloads or uncasts into, which PyTorch sees as a
tensor whose storage tells the enforcer when it dies.

Not thread-safe on the Python side: used from the training thread (and the autograd thread that
runs unpack hooks while the training thread waits in backward()).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple

import torch

from ..errors import BagualuError, OutOfMemoryError
from ..native import ext
from .handle import EnforcerHandle
from .pool import retry_after_eviction
from .scheduler import StreamScheduler

log = logging.getLogger("bagualu")

FP8_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # bgl_dtype's element types


def fp8_supported(dtype: torch.dtype) -> bool:
    """Whether the enforcer can store a tensor of ``dtype`` in FP8."""
    return dtype in FP8_DTYPES


class Enforcer(EnforcerHandle):
    """The calls on saved tensors of one enforcer (enforce/handle.py: the handle itself), and
    its end. Handles are the enforcer's tensor handles (ints, never 0). Not thread-safe: the
    training thread (and autograd's while the training thread waits in backward())."""

    def __init__(self, device: torch.device, pinned_capacity: int, borrowed_free_is_safe: bool,
                 evict: Optional[Callable[[int], int]] = None, fp8_block: int = 128,
                 sync_copies: bool = False, emulated_link: Optional[str] = None) -> None:
        super().__init__(device, pinned_capacity, fp8_block, sync_copies, emulated_link)
        # With libbgl_alloc.so as PyTorch's allocator, the enforcer marks borrowed blocks used on
        # its copy stream, so PyTorch may free them before the copy ends; other memory must
        # outlive the copy (foreign memory rule in bgl/enforce.h).
        self.borrowed_free_is_safe = borrowed_free_is_safe
        self.evict = evict  # frees device bytes when a reload finds no room (may be None)
        self.scheduler = StreamScheduler(self)  # the plan's issue order
        self._block_storage = ext.load().block_storage
        self._block_done = ext.load().block_done
        self._device_type = 1 if self.cuda else 0
        self._device_index = (device.index or 0) if self.cuda else 0
        self._dtypes = dict(self.vocab.dtype)
        self._dtype_bytes = self.vocab.dtype_bytes
        self._store_fp8 = self.lib.bgl_enf_store_fp8

    # -- registration -----------------------------------------------------------------------
    def register(self, storage: torch.UntypedStorage, dtype: torch.dtype, producer_op: int,
                 micro_batch: int, need_order: Optional[int] = None, consumer: int = -1,
                 graph_tensor: int = -1, stream: Optional[int] = None, ptr: int = 0,
                 nbytes: int = -1) -> int:
        """Tracks a saved storage (borrowed: PyTorch keeps its memory) with its reload order
        key (``need_order``; None: the library's default, by producer; the package's key is
        the Mover's) and the operator that saved it (``consumer``, -1: none yet), in one call
        of the C ABI; returns the handle, or 0 when another record tracks the storage already
        (one storage saved by two micro-batches, e.g. a chunk's output that the next chunk of
        this rank saves too: it stays where it is). ``stream``: the CUDA stream that produced
        it (None: the current one). ``ptr`` and ``nbytes``: the storage's, where the caller
        read them already (the hot path reads each once)."""
        if need_order is None:  # bgl_enf_set_need_order's default
            need_order = (micro_batch << 32) + (1 << 31) - 1 - producer_op
        rc, h = self.fast.register_saved(
            ptr or storage.data_ptr(), nbytes if nbytes >= 0 else storage.nbytes(),
            self._dtypes.get(dtype, self._dtype_bytes), producer_op, micro_batch, need_order,
            consumer, self._stream(stream))
        if rc != 0:
            if rc == self.vocab.duplicate:
                return 0
            self.check(rc, "register")
        self.fast.tracked += 1
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
            self.check(self.fast.wait(h), "offload")
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
            self.fast.tracked += 1
        if rc == 0:
            return h, None
        if not h:
            if rc == self.vocab.duplicate:
                return 0, None
            self.check(rc, "register")
        try:
            self.check(rc, what)
        except BagualuError as e:
            return h, e
        return h, None

    def add_consumer(self, handle: int, op: int) -> None:
        """Operator ``op`` saved the tensor too."""
        rc = self.fast.add_consumer(handle, op)
        if rc != 0 and rc != self.vocab.duplicate:  # already a consumer
            self.check(rc, "add_consumer")

    def set_strategy(self, handle: int, strategy: str) -> None:
        """Records the plan's strategy (keep, recompute, offload, fp8) for the tensor."""
        self.check(self.lib.bgl_enf_set_strategy(self.handle, handle,
                                                 self.enum_value("strategy", strategy)),
                   "set_strategy")

    def set_graph_index(self, handle: int, producer_op: int, graph_tensor: int) -> None:
        """Where the tensor is in the planner's stage graph (the issue order names those)."""
        self.check(self.lib.bgl_enf_set_graph_index(self.handle, handle, producer_op,
                                                    graph_tensor), "set_graph_index")

    def retire(self, handle: int) -> None:
        """The record is gone and no block of it is alive: forget the tensor and free what the
        enforcer holds for it (pinned copy, FP8 copy)."""
        self.regenerators.pop(handle, None)
        life = self.fast  # the binding's Enforcer holds the lifetime (enforce/handle.py)
        if life.destroyed:
            return
        life.unregister(handle)
        life.tracked -= 1
        if life.closing:
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
            self.check(rc, "offload")

    def offloaded(self, handle: int) -> bool:
        """Whether the tensor is in the pinned pool (its copy complete, or PyTorch may free the
        source before it ends)."""
        rc, placement, _, _ = self.fast.state(handle)
        self.check(rc, "query")
        if placement != self.vocab.place_host:
            return False
        if not self.borrowed_free_is_safe:
            self.check(self.fast.wait(handle), "offload")
        return True

    def copy_done(self, handle: int) -> bool:
        """Whether no copy or cast of the tensor may still run (never blocks)."""
        rc, _, pending, _ = self.fast.state(handle)
        self.check(rc, "query")
        return not pending

    def wait(self, handle: int) -> None:
        """Blocks until the tensor's queued copies and casts completed (bounded:
        BGL_WAIT_TIMEOUT_MS, then a BagualuError naming what did not complete)."""
        self.check(self.fast.wait(handle), "wait")

    def wait_until_copied(self, handle: int) -> None:
        """As wait, for however long the copies take: before memory a copy still reads is given
        back (no caller to stop: a record's release). Each bound that passes is logged."""
        while True:
            try:
                self.check(self.fast.wait(handle), "wait")
                return
            except OutOfMemoryError:
                raise
            except BagualuError as e:
                log.error("bagualu: %s; still waiting: the copy reads memory not yet given back",
                          e)

    def store_fp8(self, handle: int) -> int:
        """Casts the tensor to e4m3 with per-block scales on its producer's stream (PyTorch
        frees the original in that stream's order); returns the bytes of the FP8 copy."""
        self.check(self._store_fp8(self.handle, handle), "store_fp8")
        rc, _, _, fp8_bytes = self.fast.state(handle)
        self.check(rc, "query")
        return fp8_bytes

    def drop(self, handle: int, regenerate: Callable[[], int]) -> None:
        """Gives up the tensor's data; ``regenerate`` makes it again and returns its pointer
        when the enforcer next needs it."""
        self.check(self.lib.bgl_enf_drop(self.handle, handle), "drop")
        self.regenerators[handle] = regenerate

    def prefetch(self, micro_batch: int) -> None:
        """Reloads the micro-batch's offloaded tensors in need order, a bounded number ahead
        of the backward (each acquire makes room for the next)."""
        if self.fast.destroyed:
            return
        rc = self.fast.prefetch(micro_batch)
        if rc == self.vocab.out_of_memory:  # no room yet: each acquire reloads what it needs
            return
        if rc == self.vocab.backend:  # a failed reload ahead: the acquire reloads it again
            log.warning("bagualu: reload ahead failed; the backward reloads on demand: %s",
                        self.last_error())
            return
        self.check(rc, "prefetch")

    # -- the data back on the device --------------------------------------------------------
    def acquire(self, handle: int, nbytes: int, rec: Any = None) -> torch.UntypedStorage:
        """The full-precision data of an offloaded or FP8 tensor as a storage on the device
        (reloaded or uncast into a block of the enforcer); the current stream waits for it.
        When the storage dies the block ends as the binding's own reloads end (csrc/packed.cc
        BlockDoneCall, made by ``_C.block_done``): it goes back to the enforcer (on CUDA after
        the pool learns PyTorch's stream), or, where ``rec`` (the record whose block it is;
        None: the caller retires ``handle``) was released meanwhile, the record is retired
        (on the host backend, whose memory no stream order guards, that frees the block in the
        same call)."""
        done = self._block_done(self, handle, rec)
        ptr = self._acquire(handle, nbytes)
        self.fast.live_blocks += 1
        return self._block_storage(ptr, nbytes, self._device_type, self._device_index, done)

    def recompute(self, handle: int) -> None:
        """Brings a dropped tensor back through its regenerator (borrowed again: the package
        holds the new storage)."""
        self._acquire(handle, 0)
        self.fast.release(handle, self._stream(None))

    def _acquire(self, handle: int, nbytes: int) -> int:
        if self.fast.destroyed:
            raise BagualuError("enforcer acquire: the enforcer was destroyed")
        rc, ptr = self.fast.acquire(handle, self._stream(None))
        if rc == 0:
            return ptr
        got = [0]

        def attempt() -> None:
            rc, got[0] = self.fast.acquire(handle, self._stream(None))
            self.check(rc, "acquire")
        try:
            self.check(rc, "acquire")
        except OutOfMemoryError as e:  # no room for the reload or uncast: evict, try again
            if self.evict is None:
                raise
            retry_after_eviction(attempt, nbytes, self.evict, e)
        return got[0]

    # -- its end ----------------------------------------------------------------------------
    def close(self) -> None:
        """Destroys the enforcer once nothing it holds is still needed: graphs built before
        uninstall may still need their moved activations, and blocks stay valid while PyTorch
        holds them."""
        self.fast.closing = True
        self._destroy_if_done()

    def _destroy_if_done(self) -> None:
        life = self.fast
        if life.closing and not life.destroyed and life.live_blocks == 0 and life.tracked == 0:
            life.destroyed = True
            self.regenerators.clear()
            self.lib.bgl_enf_destroy(self.handle)
