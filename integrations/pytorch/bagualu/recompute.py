"""Recompute callbacks: regenerating a dropped activation by rerunning the module call that
produced it, from that call's retained inputs, under the RNG state it first ran with.

Unlike a ``torch.utils.checkpoint`` region, a call marked for recompute stays visible to the
outer saved-tensor hooks: everything it saves still goes through the tracker, so offloaded,
FP8 and recomputed operators mix freely within one layer, on every supported torch.

A ``Call`` is made by the operator's forward pre-hook when its strategy for the micro-batch is
recompute. Its tensor inputs are held through the tracker (so an input that is itself
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

import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from .errors import BagualuError
from .strategy import Op

Key = Tuple[str, int]  # ("pack", index within the call) or ("out", index of the output leaf)


class Call:
    """One forward call of an operator module whose activations are recomputed on demand."""

    __slots__ = ("op", "module", "spec", "leaves", "rng", "cuda_rng", "autocast", "start",
                 "open", "outputs", "pending", "done", "__weakref__")

    def __init__(self, op: Op, module: torch.nn.Module, args: Tuple[Any, ...],
                 kwargs: Dict[str, Any], hold: Callable[[torch.Tensor], Any], start: int,
                 device: torch.device) -> None:
        self.op = op
        self.module = module
        leaves, self.spec = pytree.tree_flatten((args, kwargs))
        # Tensors are held through the tracker (a Packed handle and requires_grad); the rest
        # (None, ints, a Cache object) as they are.
        self.leaves: List[Any] = [
            ("t", hold(v), v.requires_grad) if isinstance(v, torch.Tensor) else ("v", v, False)
            for v in leaves]
        self.rng = torch.get_rng_state()
        self.cuda_rng = (torch.cuda.get_rng_state(device)
                         if device.type == "cuda" and torch.cuda.is_initialized() else None)
        self.autocast = _autocast_state(device)
        self.start = start            # the tracker's pack count when the call began
        self.open = True              # the forward is still inside the call
        self.outputs: Dict[int, int] = {}  # storage pointer -> index of the output leaf
        self.pending: List[Tuple[Key, Any]] = []  # (key, weakref to a dropped record)
        self.done = False

    def close(self, out: Any) -> None:
        """The call returned ``out``: remember where its output storages are."""
        self.open = False
        for i, v in enumerate(pytree.tree_leaves(out)):
            if isinstance(v, torch.Tensor) and v.numel() > 0:
                self.outputs.setdefault(v.untyped_storage().data_ptr(), i)

    def key_for(self, storage_ptr: int, pack_index: int) -> Optional[Key]:
        """Where the rerun produces the storage being packed now, or None if it cannot."""
        if self.open:
            return ("pack", pack_index - self.start)
        i = self.outputs.get(storage_ptr)
        return ("out", i) if i is not None else None

    def add(self, key: Key, record: Any) -> None:
        self.pending.append((key, weakref.ref(record)))

    def rerun(self, device: torch.device) -> Dict[Key, torch.UntypedStorage]:
        """Runs the call again and returns the storages of its pending keys."""
        if self.done:
            raise BagualuError(f"recompute of {self.op.qualname}: the call was rerun already "
                               "and a record it dropped was not regenerated")
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

        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, enabled=True):
            torch.set_rng_state(self.rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, device)
            with torch.enable_grad(), _autocast(device, self.autocast), \
                    torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
                out = self.module(*a, **kw)
        leaves = pytree.tree_leaves(out)
        result: Dict[Key, torch.UntypedStorage] = {}
        for key, _ in self.pending:
            kind, i = key
            src = saved if kind == "pack" else leaves
            if i >= len(src) or not isinstance(src[i], torch.Tensor):
                raise BagualuError(
                    f"recompute of {self.op.qualname} ({type(self.module).__name__}): the rerun "
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


def _autocast_state(device: torch.device) -> Optional[Tuple[bool, Any]]:
    try:
        dt = device.type
        return (torch.is_autocast_enabled(dt), torch.get_autocast_dtype(dt))
    except (AttributeError, TypeError, RuntimeError):  # torch without per-device autocast API
        return None


class _autocast:
    """Re-enters the autocast state of the original call (nothing when it was off)."""

    def __init__(self, device: torch.device, state: Optional[Tuple[bool, Any]]) -> None:
        self.ctx = (torch.autocast(device.type, dtype=state[1])
                    if state is not None and state[0] else None)

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
