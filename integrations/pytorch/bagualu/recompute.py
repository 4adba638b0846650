"""Recompute callbacks: regenerating a dropped activation by rerunning the module call that
produced it, from that call's retained inputs, under the RNG state it first ran with.

Unlike a ``torch.utils.checkpoint`` region, a call marked for recompute stays visible to the
outer saved-tensor hooks: everything it saves still goes through the tracker, so offloaded,
FP8 and recomputed operators mix freely within one layer, on every supported torch.

A ``Call`` is made when an operator is entered (capture/calls.py: a module of an unmodified
model or a Step of an OpBlock layer) and its strategy for the micro-batch is recompute. Its tensor inputs are held through the tracker (so an input that is itself
offloaded, stored in FP8 or dropped stays so; a dropped input is regenerated first, which is
the planner's recompute closure). A storage the call produced is dropped at pack time and
remembered by where the rerun will produce it again: the k-th tensor saved during the call,
or the i-th tensor of its outputs. The first unpack of any of them reruns the call once (grad
enabled, a collecting saved-tensor hook, the saved RNG state restored, the caller's autocast
state) and fills every still-dropped record of that call.

Not thread-safe: calls are made and rerun on the training thread (the autograd engine runs
unpack hooks on the thread that called backward on CPU; on CUDA on its device thread, while
the training thread waits in backward()).
"""
from __future__ import annotations

import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import get_device_states, set_device_states

from .errors import BagualuError
from .vocabulary import Op

Key = Tuple[str, int]  # ("pack", index within the call) or ("out", index of the output leaf)


class Call:
    """One forward call of an operator module whose activations are recomputed on demand."""

    __slots__ = ("op", "module", "spec", "leaves", "rng", "devices", "device_rng", "autocast",
                 "start", "packs", "open", "outputs", "pending", "done", "owner", "__weakref__")

    def __init__(self, op: Op, module: torch.nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any], hold: Callable[[torch.Tensor], Any], start: int,
                 device: torch.device, owner: Any = None) -> None:
        self.op = op
        self.module = module
        # The runtime whose module hooks act while ``owner.forwarding``: a rerun is not a
        # forward (the plan's R chain may rerun a call while another micro-batch's forward
        # runs), so they stand aside during it.
        self.owner = owner
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        # Tensors are held through the tracker (a Packed handle and requires_grad); the rest
        # (None, ints, a Cache object) as they are.
        self.leaves: List[Any] = [
            ("t", hold(v), v.requires_grad) if isinstance(v, torch.Tensor) else ("v", v, False)
            for v in leaves]
        # The RNG states torch.utils.checkpoint saves: the CPU's and those of the inputs'
        # devices; the autocast state of the call.
        self.rng = torch.get_rng_state()
        # torch.utils.checkpoint's helper walks the arguments again (about 10 us); where every
        # tensor is on the CPU it finds no device state to save.
        if any(isinstance(v, torch.Tensor) and v.device.type not in ("cpu", "meta")
               for v in leaves):
            self.devices, self.device_rng = get_device_states(*leaves)
        else:
            self.devices, self.device_rng = [], []
        self.autocast = (device.type, torch.is_autocast_enabled(device.type),
                         torch.get_autocast_dtype(device.type))
        self.start = start            # the tracker's pack count when the call began
        self.packs = 0                # tensors saved during the call (counted at close)
        self.open = True              # the forward is still inside the call
        self.outputs: Dict[int, int] = {}  # storage pointer -> index of the output leaf
        self.pending: List[Tuple[Key, Any]] = []  # (key, weakref to a dropped record)
        self.done = False

    def close(self, out: Any, packs_seen: int) -> None:
        """The call returned ``out`` (the tracker had seen ``packs_seen`` packs): remember
        where its output storages are."""
        self.open = False
        self.packs = packs_seen - self.start
        for i, v in enumerate(pytree.tree_leaves(out)):
            if isinstance(v, torch.Tensor) and v.numel() > 0:
                self.outputs.setdefault(v.untyped_storage().data_ptr(), i)

    def key_for(self, storage_ptr: int, pack_index: Optional[int]) -> Optional[Key]:
        """Where the rerun produces a storage this call made: the pack being made now
        (``pack_index``, while the call runs), else an output; None if it cannot."""
        if self.open:
            return None if pack_index is None else ("pack", pack_index - self.start)
        i = self.outputs.get(storage_ptr)
        return ("out", i) if i is not None else None

    def add(self, key: Key, record: Any) -> None:
        self.pending.append((key, weakref.ref(record)))

    def regenerate(self) -> None:
        """Reruns the call once and hands every record it dropped (still alive) its data."""
        t0 = time.perf_counter()
        storages = self._rerun()
        if self.owner is not None:
            self.owner.note_recompute((time.perf_counter() - t0) * 1e3, 1)
        pending, self.pending = self.pending, []
        for key, ref in pending:
            rec = ref()
            if rec is not None and rec.regen is self:  # not released meanwhile
                rec.regenerated(storages[key])

    def _rerun(self) -> Dict[Key, torch.UntypedStorage]:
        """Runs the call again and returns the storages of its pending keys."""
        if self.done:
            raise BagualuError(f"recompute of {self.op.qualname}: the call was rerun already "
                               "and a record it dropped was not regenerated")
        if self.owner is not None:
            self.owner.before_rerun(self.op, self.module)  # NotReady: not yet (FSDP2)
        args: List[Any] = []
        for tag, v, rg in self.leaves:
            if tag == "t":
                t = v.unpack().detach()
                if rg and t.is_floating_point():
                    t.requires_grad_(True)
                args.append(t)
            else:
                args.append(v)
        a, kw = pytree.tree_unflatten(args, self.spec)
        saved: List[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            # Only the data is wanted (this graph never runs backward). Keeping the tensor
            # itself in the graph would make a node -> output -> node cycle through autograd's
            # C++ objects, which the collector cannot see, and leak everything it holds.
            saved.append(t.detach())
            return None

        device_type, autocast, dtype = self.autocast
        owner = self.owner
        forwarding = owner is not None and owner.forwarding
        if forwarding:
            owner.forwarding = False
        try:
            with torch.random.fork_rng(devices=self.devices, device_type=device_type):
                torch.set_rng_state(self.rng)
                set_device_states(self.devices, self.device_rng, device_type=device_type)
                with torch.enable_grad(), torch.autocast(device_type, dtype, enabled=autocast), \
                        torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
                    out = self.module(*a, **kw)
        finally:
            if forwarding:
                owner.forwarding = True
        leaves = pytree.tree_leaves(out)
        if len(saved) != self.packs:
            raise BagualuError(
                f"recompute of {self.op.qualname} ({_label(self.module)}): the rerun "
                f"saved {len(saved)} tensors where the forward saved {self.packs}: the call does "
                "not repeat itself (state it changes, such as a KV cache?); keep this operator "
                "with ops= or train with use_cache=False")
        result: Dict[Key, torch.UntypedStorage] = {}
        for key, _ in self.pending:
            kind, i = key
            src = saved if kind == "pack" else leaves
            if i >= len(src) or not isinstance(src[i], torch.Tensor):
                raise BagualuError(
                    f"recompute of {self.op.qualname} ({_label(self.module)}): the rerun "
                    f"did not produce {kind} #{i} ({len(saved)} saved tensors, {len(leaves)} "
                    "outputs): its forward is not deterministic in structure; keep this "
                    "operator with ops= or force_strategies")
            result[key] = src[i].untyped_storage()
        saved.clear()
        del out, leaves
        self.done = True
        self.leaves = []  # the inputs are no longer needed
        return result


def _never_unpacked(_: Any) -> Any:
    raise BagualuError("a recompute rerun's graph was used for backward")


def _label(fn: Any) -> str:
    """What a rerun error names the call by: an OpBlock step's label, else the module's class."""
    return getattr(fn, "label", None) or type(fn).__name__
