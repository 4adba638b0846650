"""The OpBlock path: models written as chains of ``bagualu.Step`` (``bagualu.OpBlock``
layers). Each block is one planner layer and each step one operator, entered and left like an
unmodified model's operator module (capture/calls.py): its strategy follows the operator that
produced a storage, and a step planned for recompute is rerun from its retained inputs by the
one recompute mechanism (recompute.py). Modules outside the blocks that look like operators are
scoped and kept.

Unmodified models take the other path (capture/modules.py); both share the runtime's tracker,
plans and contexts, seen through capture/host.py. Not thread-safe: used from the training
thread."""
from __future__ import annotations

from typing import Any, Dict, List, Set

import torch
from torch import nn

from ..discovery.find import classify
from ..discovery.opblock import OpBlock, Step, run_step
from ..errors import InstrumentError
from ..vocabulary import Op
from .calls import OperatorCalls
from .host import Host


class _StepCall:
    """A step as the callable a recompute call reruns: its function over its inputs."""

    __slots__ = ("step",)

    def __init__(self, step: Step) -> None:
        self.step = step

    @property
    def label(self) -> str:
        return f"OpBlock step {self.step.op}"

    def __call__(self, *values: Any) -> Any:
        return self.step.fn(*values)


class BlockPath:
    """The hooks and runs of the ``OpBlock`` layers of one model for one runtime: the blocks
    are numbered as the planner's layers and the recognised modules outside them are scoped
    (kept). InstrumentError when nothing is recognised."""

    def __init__(self, host: Host, model: nn.Module, blocks: List[OpBlock]) -> None:
        self.host = host
        self.blocks = blocks
        self.layer_ops: Dict[int, List[Op]] = {}
        self.module_ops: Dict[nn.Module, Op] = {}  # scoped modules outside the blocks
        self._handles: List[Any] = []
        self.calls = OperatorCalls(host, len(blocks))
        self._step_calls: Dict[int, List[_StepCall]] = {}
        count = 0
        inside: Set[nn.Module] = set()
        for i, b in enumerate(blocks):
            b.bgl_layer = i
            self.layer_ops[i] = [Op(s.op, s.kind, i) for s in b.op_steps()]
            self._step_calls[i] = [_StepCall(s) for s in b.op_steps()]
            count += len(self.layer_ops[i])
            inside.update(b.modules())
        for path, m in model.named_modules():
            if m in inside or m is model:
                continue
            kind = classify(path, m, [n for n, _ in m.named_children()])
            if kind is None:
                continue
            op = Op(path, kind, -1)  # outside the planner's layers: scoped, kept
            self.module_ops[m] = op
            self._handles.append(m.register_forward_pre_hook(self._pre_hook(op)))
            self._handles.append(m.register_forward_hook(self._post_hook(op)))
            count += 1
        if count == 0:
            raise InstrumentError(
                f"{type(model).__name__} has no recognised operators: no bagualu.OpBlock layer "
                "and no module named like norm/attn/router/expert/shared/dispatch/combine or of "
                "a known class (nn.Linear, nn.LayerNorm, ...); nothing can be planned")
        self.count = count

    @property
    def readers(self) -> Dict[int, Set[str]]:
        return self.calls.readers

    def op_order(self, names: List[str]) -> List[str]:
        return self.calls.op_order(names)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for b in self.blocks:
            b.bgl_layer = -1

    def instrumented(self, block: OpBlock) -> bool:
        return block.bgl_layer >= 0 and self.host.forwarding

    def _pre_hook(self, op: Op) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self.host.forwarding:
                self.host.tracker.scope.append(op)
        return hook

    def _post_hook(self, op: Op) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            t = self.host.tracker
            if self.host.forwarding and t.scope and t.scope[-1] is op:
                t.scope.pop()
                if t.light is None:  # producers matter only to records
                    t.note_output(out, op)
        return hook

    def run_block(self, block: OpBlock, x: torch.Tensor) -> torch.Tensor:
        """The block's forward under the operators' scopes."""
        layer = block.bgl_layer
        steps = block.op_steps()
        ops = self.layer_ops[layer]
        fns = self._step_calls[layer]
        env: Dict[str, Any] = {block.input_name: x, **block.block_env()}
        t = self.host.tracker
        if t.light is None:
            t.note_output(x, Op("input", "other", layer))  # the layer's input: always kept
        for i, s in enumerate(steps):
            op = ops[i]
            values = [env[n] for n in s.inputs]
            self.calls.enter(op, fns[i], values, {})
            out = None
            try:
                out = run_step(s, env)
            finally:
                self.calls.leave(op, out)
            if s.router and "load" in env:
                if self.host.observe_router(layer, float(env["load"])):
                    t.end_light()  # the rest of the forward may move activations
        return env[block.output_name]
