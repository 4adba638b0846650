"""One enforcer of libbgl_enforce.so (bgl/enforce.h) as a handle: its creation and options, the
library's errors as the package's exceptions, the recompute callback into the package (the
regenerator of each dropped tensor), the values of its enums, and the calls on the enforcer as a
whole (statistics, the pinned pool's size, reloads given back). enforce/enforcer.py's Enforcer
adds the calls on saved tensors and destroys the handle once nothing it holds is still needed.

Not thread-safe on the Python side: used from the training thread (and the autograd thread that
runs unpack hooks while the training thread waits in backward()).
"""
from __future__ import annotations

import ctypes
import json
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..errors import BagualuError, NotReady, OutOfMemoryError
from ..native import enforce as native
from ..native import ext
from ..native.enforce import HOLDER


def _life(name: str, doc: str) -> property:
    """An attribute of the enforcer's lifetime, held by the binding's Enforcer (``fast``), which
    the hot path's registrations and releases update without a Python call."""
    return property(lambda self: getattr(self.fast, name),
                    lambda self, value: setattr(self.fast, name, value), doc=doc)


class EnforcerHandle:
    """One enforcer over the allocator's pool of one device (CUDA device index, or the host
    backend's device 0 on CPU): what every call on it shares. Not thread-safe: the training
    thread (and autograd's while the training thread waits in backward())."""

    # Its lifetime (enforce/enforcer.py destroys it once nothing is outstanding).
    live_blocks = _life("live_blocks", "blocks PyTorch still holds")
    tracked = _life("tracked", "registered tensors the package has not retired")
    closing = _life("closing", "close() was called: destroy once nothing is outstanding")
    destroyed = _life("destroyed", "the library's enforcer is destroyed")

    def __init__(self, device: torch.device, pinned_capacity: int, fp8_block: int = 128,
                 sync_copies: bool = False, emulated_link: Optional[str] = None) -> None:
        self.lib = native.load()
        self.vocab = native.vocabulary(self.lib)
        self.device = device
        self.cuda = device.type == "cuda"
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
        # A calibration with an "emulated_link" section: the host backend's copies take that
        # link's time (enforcer/emulated_link_ops.h); what it stands for, for the stats.
        self.emulated_link: Optional[str] = None
        if emulated_link is not None:
            opts.emulated_link = emulated_link.encode()
            self.emulated_link = json.loads(emulated_link)["emulated_link"]["stands_for"]
        # Reloads prefetch keeps waiting for their first consumer (the library's default).
        self.max_inflight = int(opts.max_inflight)
        handle = ctypes.c_void_p()
        self.check(self.lib.bgl_enf_create(ctypes.byref(opts), ctypes.byref(handle)), "create")
        self.handle = handle.value
        # handle -> function regenerating a dropped tensor; returns its data pointer
        self.regenerators: Dict[int, Callable[[], int]] = {}
        self._callback_error: Optional[BaseException] = None
        self._enums: Dict[Tuple[str, str], int] = {}
        self._callback = native.RECOMPUTE_FN(self._recompute)  # kept alive as long as the enforcer
        self.check(self.lib.bgl_enf_set_recompute_callback(self.handle, self._callback, None),
                   "set_recompute_callback")
        # The hot path's calls, through the compiled binding (each returns the status with its
        # outputs): registration and the register-and-move calls, moves, acquire and release.
        # It holds the enforcer's lifetime too (the properties below).
        self.fast = ext.load().Enforcer(self.lib._handle, self.handle, HOLDER)

    # -- errors -----------------------------------------------------------------------------
    def last_error(self) -> str:
        """The message of the library's last failed call."""
        msg = self.lib.bgl_enf_last_error()
        return msg.decode() if msg else "unknown error"

    def check(self, rc: int, what: str) -> None:
        """Raises for a status other than ok: the recompute callback's own error, else
        OutOfMemoryError or BagualuError naming the call ``what``."""
        if rc == 0:
            return
        if rc == self.vocab.callback and self._callback_error is not None:
            err, self._callback_error = self._callback_error, None
            raise err
        text = f"enforcer {what}: {self.last_error()}"
        if rc == self.vocab.out_of_memory:
            raise OutOfMemoryError(text)
        raise BagualuError(text)

    def declined(self, rc: int) -> bool:
        """Whether status ``rc`` is a recompute the callback declined for now (NotReady: it
        must wait for its parameters, FSDP2); the callback's error is consumed then."""
        if rc == self.vocab.callback and isinstance(self._callback_error, NotReady):
            self._callback_error = None
            return True
        return False

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

    # -- streams and enums ------------------------------------------------------------------
    def current_stream(self) -> Optional[int]:
        """The current CUDA stream's handle (None on the host backend)."""
        return torch.cuda.current_stream(self.device).cuda_stream if self.cuda else None

    def _stream(self, stream: Optional[int]) -> int:
        """The stream a call names: ``stream``, else the current CUDA stream (0 on the host
        backend: its calls run on the calling thread or its copy threads)."""
        if not self.cuda:
            return 0
        return stream if stream is not None else (self.current_stream() or 0)

    def enum_value(self, kind: str, name: str) -> int:
        """The number of ``name`` of an enum of the ABI (``kind``: strategy, chain, resource,
        placement, dtype, status): the library is the one vocabulary, nothing is retyped."""
        key = (kind, name)
        v = self._enums.get(key)
        if v is None:
            v = self._enums[key] = self.vocab.value(kind, name)
        return v

    # -- the enforcer as a whole ------------------------------------------------------------
    def query(self, handle: int) -> native.Info:
        info = native.Info()
        self.check(self.lib.bgl_enf_query(self.handle, handle, ctypes.byref(info)), "query")
        return info

    def set_pinned_capacity(self, nbytes: int) -> None:
        """Resizes the pinned host pool (the node's grant changed); offloads that do not fit
        fail and leave their activations on the device until copies come back."""
        if not self.fast.destroyed:
            self.check(self.lib.bgl_enf_set_pinned_capacity(self.handle, int(nbytes)),
                       "set_pinned_capacity")

    def synchronize(self) -> None:
        """Waits for every queued copy (and so for the pinned memory they free)."""
        if self.fast.destroyed:
            return
        self.check(self.lib.bgl_enf_synchronize(self.handle), "synchronize")

    def stats(self) -> Dict[str, int]:
        if self.fast.destroyed:
            return {}
        s = native.Stats()
        self.check(self.lib.bgl_enf_get_stats(self.handle, ctypes.byref(s)), "stats")
        return {name: int(getattr(s, name)) for name in native.STAT_FIELDS}

    def give_back(self, needed: int) -> int:
        """Gives back device memory the enforcer owns (reloads no consumer took yet; the data
        stays on the host) until ``needed`` bytes; returns the bytes freed."""
        if self.fast.destroyed:
            return 0
        freed = ctypes.c_size_t(0)
        self.check(self.lib.bgl_enf_evict(self.handle, needed, ctypes.byref(freed)), "evict")
        return int(freed.value)
