"""Entering and leaving one operator's forward, for every kind of operator (a module of an
unmodified model, a Step of an OpBlock layer): its scope, the recompute call it opens when its
strategy is recompute (recompute.py: the one recompute mechanism), the producer of its
outputs, and what the capture learns (the order of first calls, which operators read which
storages, the forward time). Not thread-safe: the training thread."""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils import _pytree as pytree

from ..recompute import Call
from ..vocabulary import RECOMPUTE, SCALING_KINDS, Op
from .host import Host

log = logging.getLogger("bagualu")


def tensors(x: Any) -> List[torch.Tensor]:
    """The tensors among the leaves of ``x``."""
    return [v for v in pytree.tree_leaves(x) if isinstance(v, torch.Tensor)]


class OperatorCalls:
    """The operator calls of one instrumented model's forwards (``layers`` planned layers:
    the capture's times are per layer)."""

    def __init__(self, host: Host, layers: int) -> None:
        self.host = host
        self.layers = layers
        self.stack: List[Tuple[Op, Optional[Call], float]] = []
        self.order: Dict[str, int] = {}          # operator name -> first call (capture)
        self.readers: Dict[int, Set[str]] = {}   # storage ptr -> operators reading it (capture)
        self.warned: Set[str] = set()
        # Compiled blocks (capture/compiled.py): the first call of a compiled block compiles
        # it, so an operator's time is its fastest call in the capture (ms), not the mean.
        self.fastest: Optional[Dict[str, float]] = None
        # The capture's times per layer (ms), each layer's apart: every operator's
        # (per_layer: name -> layer -> ms), the layer's own forward (layer_forward: its
        # outermost operators'; an operator's time includes the operators it calls, what
        # rerunning it costs, so the operators' sum counts nested ones more than once:
        # planning/graph.py) and its own backward (layer_backward, likewise its outermost
        # operators': each call's backward runs from the gradient of its first output to the
        # gradient of its input, autograd hooks on those tensors set at the call's end). The
        # layers run the same code, so the fastest layer is the estimate (robust_op_ms,
        # layer_ms, backward_ms): a layer slowed by other work on the machine is left out.
        self.per_layer: Dict[str, Dict[int, float]] = {}
        self.layer_forward: Dict[int, float] = {}
        self.layer_backward: Dict[int, float] = {}
        # Whether the capture's forward recomputes an operator (its backward then reruns, so
        # its time is not the layer's own backward).
        self.rerun_in_capture = False
        self.no_replay: Set[str] = set()         # operators whose rerun would communicate
        self._inputs: List[torch.Tensor] = []    # the outermost call's inputs (capture)

    def enter(self, op: Op, fn: Callable[..., Any], args: Any, kwargs: Any,
              defer: bool = False) -> None:
        """``op`` starts running ``fn(*args, **kwargs)``: a recompute call is opened when its
        strategy is recompute (or, ``defer``, a router inside it may make it so)."""
        host = self.host
        t = host.tracker
        call = None
        if t.light is None:
            if host.capturing:
                host.hidden.enter(op)  # under the model's own checkpointing? (foreign.py)
                self.order.setdefault(op.name, len(self.order))
                if op.layer == 0:
                    for v in tensors((args, kwargs)):
                        if v.numel() > 0:
                            self.readers.setdefault(v.untyped_storage().data_ptr(),
                                                    set()).add(op.name)
            rerun = host.strategy_of(op, t.micro_batch) == RECOMPUTE
            if ((defer and host.may_defer) or rerun) and self._replayable(op, args, kwargs):
                call = Call(op, fn, args, kwargs, t.hold, t.packs_seen, host.device, host)
                t.calls.append(call)
                self.rerun_in_capture |= host.capturing and rerun  # not a router's deferral
        t.scope.append(op)
        issuer = t.issuer
        if issuer is not None and issuer.active:
            issuer.forward_op(t.micro_batch, op)
        self.stack.append((op, call, time.perf_counter() if host.capturing else 0.0))
        if host.capturing and len(self.stack) == 1 and self.fastest is None:
            self._inputs = [v for v in tensors((args, kwargs)) if v.requires_grad]

    def _replayable(self, op: Op, args: Any, kwargs: Any) -> bool:
        """A call that receives a KV cache changes it: rerunning it would not reproduce the
        forward (train with use_cache=False). Such calls keep their activations, as do the
        calls that run an expert dispatch (capture/dispatch.py: a rerun would repeat its
        all-to-all on this rank only)."""
        if op.name in self.no_replay:
            if op.name not in self.warned:
                self.warned.add(op.name)
                log.info("bagualu: %s runs the expert dispatch; it is never recomputed (its "
                         "all-to-all would run again on this rank only)", op.qualname)
            return False
        for v in pytree.tree_leaves((args, kwargs)):
            if v is not None and not isinstance(v, (torch.Tensor, int, float, bool, str)) \
                    and "cache" in type(v).__name__.lower():
                if op.name not in self.warned:
                    self.warned.add(op.name)
                    log.warning("bagualu: %s receives a %s; its activations are kept instead "
                                "of recomputed (train with use_cache=False)", op.qualname,
                                type(v).__name__)
                return False
        return True

    def leave(self, op: Op, out: Any) -> bool:
        """``op`` returned ``out``; False when it was not the innermost operator entered."""
        host = self.host
        t = host.tracker
        if not self.stack or self.stack[-1][0] is not op:
            return False
        _, call, t0 = self.stack.pop()
        if host.capturing:
            host.hidden.leave(op)
        if t.scope and t.scope[-1] is op:
            t.scope.pop()
        if call is not None:
            call.close(out, t.packs_seen)
            if t.calls and t.calls[-1] is call:
                t.calls.pop()
        if t.light is None:
            t.note_output(out, op, call=call)
        if host.capturing:
            ms = (time.perf_counter() - t0) * 1e3
            fastest = self.fastest
            if fastest is None:
                host.op_time(op.name, ms / max(self.layers, 1))
                mine = self.per_layer.setdefault(op.name, {})
                mine[op.layer] = mine.get(op.layer, 0.0) + ms
                if not self.stack and op.layer >= 0:
                    self.layer_forward[op.layer] = self.layer_forward.get(op.layer, 0.0) + ms
                    self._time_backward(out, op.layer)
            elif ms < fastest.get(op.name, float("inf")):
                host.op_time(op.name, ms - fastest.get(op.name, 0.0))  # the sum stays the min
                fastest[op.name] = ms
        return True

    @property
    def layer_ms(self) -> float:
        """The capture's forward time of a layer (ms): its fastest layer's; 0: not timed."""
        return min(self.layer_forward.values(), default=0.0)

    @property
    def backward_ms(self) -> float:
        """The capture's backward time of a layer (ms): its fastest layer's; 0: not timed
        (yet)."""
        return min(self.layer_backward.values(), default=0.0)

    def robust_op_ms(self, op_ms: Dict[str, float], kinds: Dict[str, str]) -> Dict[str, float]:
        """``op_ms`` (the capture's mean over the layers) with each operator's fastest layer
        in place of the mean, but for operators whose time scales with the load (each layer
        routes its own load: there the mean stays)."""
        out = dict(op_ms)
        for name, layers in self.per_layer.items():
            if layers and kinds.get(name) not in SCALING_KINDS:
                out[name] = min(layers.values())
        return out

    def _time_backward(self, out: Any, layer: int) -> None:
        """Times the backward of the outermost call that returned ``out`` (from the inputs
        saved at its start): from the gradient of its first output to the first gradient of an
        input (the layer's input: its gradient is whole once the call's backward is done; an
        input other layers share would be whole only later)."""
        inputs, self._inputs = self._inputs, []
        outputs = [v for v in tensors(out) if v.requires_grad and v.grad_fn is not None]
        if not inputs or not outputs:
            return
        span: List[Optional[float]] = [None, None]  # [start, end] of this call's backward

        def started(_: torch.Tensor) -> None:
            if span[0] is None:
                span[0] = time.perf_counter()

        def ended(_: torch.Tensor) -> None:
            if span[0] is not None and span[1] is None:
                span[1] = time.perf_counter()
                ms = (span[1] - span[0]) * 1e3
                self.layer_backward[layer] = self.layer_backward.get(layer, 0.0) + ms

        for v in outputs:
            v.register_hook(started)
        for v in inputs:
            v.register_hook(ended)

    def op_order(self, names: Sequence[str]) -> List[str]:
        """Operator names in the order of their first call in the capture (never-called
        operators are left out)."""
        return sorted((n for n in names if n in self.order), key=self.order.__getitem__)
