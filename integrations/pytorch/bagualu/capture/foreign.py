"""A model that checkpoints its own blocks: what its checkpointing hides from bagualu.

Hugging Face's ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable`` in
transformers 5), torch's ``checkpoint_wrapper`` (torchtitan's activation checkpointing) and a
forward that calls ``torch.utils.checkpoint.checkpoint`` itself all run a block's forward under
saved-tensor hooks of their own (non-reentrant checkpoint) or without grad (reentrant): the
tensors saved there never reach bagualu's pack hook, so bagualu plans only what is left (the
layer inputs) and the model's checkpointing recomputes the rest as it always did. Training stays
correct; bagualu only sees less.

``own_checkpointing`` finds the usual forms at instrument (one warning). During the capture
micro-batch, ``Hidden`` counts what the model's checkpointing takes: when an operator is entered
under another saved-tensors hook, a counting hook is pushed on top that hands every tensor on to
that hook unchanged (so the checkpoint works as before) and counts it and its storage's bytes;
an operator entered without grad is noted (its saved tensors cannot be counted). After the
capture the runtime says, once, how many saved tensors were hidden and what bagualu would plan
without the model's checkpointing.

Not thread-safe: the training thread.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..discovery.sharding import is_parameter
from ..vocabulary import Op

log = logging.getLogger("bagualu")
# The innermost saved-tensor hooks; torch 2.6 has none of this call, and there the capture cannot
# count what the model's own checkpointing hides (own_checkpointing says so).
_top_hooks: Optional[Callable[..., Any]] = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def own_checkpointing(blocks: Sequence[nn.Module]) -> Optional[str]:
    """How the model checkpoints the planned ``blocks`` itself (for the instrument warning), or
    None when no known form is on: HF gradient checkpointing (a block's
    ``gradient_checkpointing``) or torch's checkpoint_wrapper (CheckpointWrapper modules)."""
    hf = sum(1 for b in blocks if getattr(b, "gradient_checkpointing", False) is True)
    wrapped = sum(1 for b in blocks
                  if any(type(m).__name__ == "CheckpointWrapper" for m in b.modules()))
    parts = []
    if hf:
        parts.append(f"Hugging Face gradient checkpointing on {hf} of {len(blocks)} planned "
                     "blocks")
    if wrapped:
        parts.append(f"torch's checkpoint_wrapper in {wrapped} of {len(blocks)} planned blocks")
    if parts and _top_hooks is None:
        log.warning("bagualu: torch %s has no torch._C._autograd._top_saved_tensors_default_hooks"
                    ": the capture cannot count the tensors the model's own checkpointing hides "
                    "and will not report them (a newer torch does; or switch the model's "
                    "checkpointing off)", torch.__version__)
    return "; ".join(parts) or None


class Hidden:
    """What saved-tensor hooks other than bagualu's took during the capture (see the module
    docstring): ``count`` saved tensors of the planned layers, ``bytes`` of their distinct
    storages, ``no_grad`` operators that ran without grad inside the layers."""

    def __init__(self, pack: Callable[[torch.Tensor], Any], param_keys: Callable[[], Set[int]]
                 ) -> None:
        self.pack = pack              # bagualu's pack hook (the tracker's)
        self.param_keys = param_keys  # the model's parameter storages
        self.count = 0
        self.total = 0                # bytes of the distinct storages counted
        self.storages: Dict[int, Tuple[Any, int]] = {}  # pointer -> (weakref, bytes)
        self.no_grad: Set[str] = set()
        self.ops: Set[str] = set()
        self._open: List[Tuple[Op, Any]] = []
        self.reported = False

    @property
    def bytes(self) -> int:
        return self.total

    def holds(self, ptr: int, st: Any) -> bool:
        """Whether storage ``st`` (at ``ptr``) is one of those counted."""
        seen = self.storages.get(ptr)
        return seen is not None and seen[0]() is st

    def enter(self, op: Op) -> None:
        """``op`` is entered in the capture's forward."""
        if op.layer < 0 or _top_hooks is None:
            return
        if not torch.is_grad_enabled():
            self.no_grad.add(op.name)  # reentrant checkpoint: nothing is saved here
            return
        top = _top_hooks(False)
        if top is None:
            return
        pack, unpack = top
        if pack == self.pack:
            return
        self.ops.add(op.name)
        if getattr(pack, "_bagualu_counting", False):  # inside a region counted already
            return
        ctx = torch.autograd.graph.saved_tensors_hooks(self._counting(pack, op), unpack)
        ctx.__enter__()
        self._open.append((op, ctx))

    def _counting(self, pack: Callable[[torch.Tensor], Any], op: Op) -> Callable[..., Any]:
        def counted(t: torch.Tensor) -> Any:
            if t.numel() > 0 and not is_parameter(t) and not t.is_sparse:
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in self.param_keys():
                    self.count += 1
                    # Distinct storages: the checkpoint frees what it does not keep at once,
                    # so a pointer seen before may be another storage now.
                    seen = self.storages.get(key)
                    if seen is None or seen[0]() is not st:
                        self.storages[key] = (weakref.ref(st), st.nbytes())
                        self.total += st.nbytes()
            return pack(t)
        counted._bagualu_counting = True  # type: ignore[attr-defined]
        return counted

    def leave(self, op: Op) -> None:
        """``op`` returned: the counting hook it pushed (if any) goes."""
        if self._open and self._open[-1][0] is op:
            self._open.pop()[1].__exit__(None, None, None)

    def close(self) -> None:
        """The forward ended (or failed): every counting hook still pushed goes."""
        while self._open:
            self._open.pop()[1].__exit__(None, None, None)

    @property
    def found(self) -> bool:
        return self.count > 0 or bool(self.no_grad)


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def report(hidden: Hidden, visible: int, in_flight: int, capacity: int) -> str:
    """The capture's one warning: what the model's own checkpointing hid, and what bagualu
    would plan without it (``visible``: the layers' bytes bagualu saw in the capture)."""
    parts = []
    if hidden.count:
        ops = ", ".join(sorted(hidden.ops)[:4]) + (", ..." if len(hidden.ops) > 4 else "")
        total = visible + hidden.bytes
        parts.append(
            f"the model's own checkpointing hides {hidden.count} of the tensors its planned "
            f"layers save ({_mib(hidden.bytes)} per micro-batch; operators {ops}) from "
            f"bagualu, which plans only the {_mib(visible)} it sees and leaves the rest to "
            f"the model's recompute. Without it bagualu would plan {_mib(total)} per "
            f"micro-batch, {_mib(total * in_flight)} for the {in_flight} "
            f"forward{'s' if in_flight != 1 else ''} in flight "
            f"against the {_mib(capacity)} capacity, choosing keep, offload, FP8 or recompute "
            "per operator")
    if hidden.no_grad:
        parts.append(f"{len(hidden.no_grad)} operators of the planned layers ran without grad "
                     "(reentrant torch.utils.checkpoint?): what their recompute saves in the "
                     "backward is hidden from bagualu")
    return ("bagualu: " + "; ".join(parts) + ". Switch the model's checkpointing off (e.g. "
            "model.gradient_checkpointing_disable()) to let bagualu plan those activations")
