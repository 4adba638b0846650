"""The OpBlock path: models written as chains of ``bagualu.Step`` (``bagualu.OpBlock``
layers). Each block is one planner layer and each step one operator; recompute runs a region
of consecutive steps under ``torch.utils.checkpoint``; modules outside the blocks that look
like operators are scoped and kept.

Unmodified models take the other path (modules.py, recompute.py); both share the runtime's
tracker, plans and contexts (runtime.py). Not thread-safe: used from the training thread.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .errors import InstrumentError
from .ops import OpBlock, Step, classify, recompute_closure, run_step
from .strategy import RECOMPUTE, Op
from .tracker import param_storages

if TYPE_CHECKING:  # the runtime owns this object; no import at run time (no cycle)
    from .runtime import Runtime


class BlockPath:
    """Instruments and runs the ``OpBlock`` layers of one model for one runtime."""

    def __init__(self, rt: "Runtime") -> None:
        self.rt = rt
        self.module_ops: Dict[nn.Module, Op] = {}  # scoped modules outside the blocks
        self._handles: List[Any] = []

    def instrument(self, model: nn.Module, blocks: List[OpBlock],
                   info: Optional[Dict[str, Any]]) -> int:
        """Numbers the blocks as the planner's layers and scopes the recognised modules
        outside them (kept); returns the number of operators."""
        self.rt.model_info = dict(info or {})
        self.rt.tracker.param_keys = param_storages(model)
        count = 0
        inside: Set[nn.Module] = set()
        for i, b in enumerate(blocks):
            b.bgl_layer = i
            self.rt.layer_ops[i] = [Op(s.op, s.kind, i) for s in b.op_steps()]
            count += len(self.rt.layer_ops[i])
            inside.update(b.modules())
        self.rt.blocks = blocks
        self.rt.layer_count = len(blocks)
        for path, m in model.named_modules():
            if m in inside or m is model:
                continue
            kind = classify(path, m)
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
        self.rt._freeze_gc()
        return count

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for b in self.rt.blocks:
            b.bgl_layer = -1

    def instrumented(self, block: OpBlock) -> bool:
        return block.bgl_layer >= 0 and self.rt.forwarding

    def _pre_hook(self, op: Op) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            if self.rt.forwarding:
                self.rt.tracker.scope.append(op)
        return hook

    def _post_hook(self, op: Op) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            t = self.rt.tracker
            if self.rt.forwarding and t.scope and t.scope[-1] is op:
                t.scope.pop()
                if t.light is None:  # producers matter only to records
                    t.note_output(out, op)
        return hook

    def _recompute_set(self, block: OpBlock, mb: int, frozen_before: int = -1) -> Set[int]:
        steps = block.op_steps()
        ops = self.rt.layer_ops[block.bgl_layer]
        chosen = {i for i, op in enumerate(ops) if self.rt.strategy_of(op, mb) == RECOMPUTE
                  and i > frozen_before}
        if not chosen:
            return chosen
        return recompute_closure(steps, chosen, block.bgl_savers or _consumers(steps),
                                 block.input_name, frozen_before)

    def run_block(self, block: OpBlock, x: torch.Tensor) -> torch.Tensor:
        steps = block.op_steps()
        ops = self.rt.layer_ops[block.bgl_layer]
        mb = self.rt.tracker.micro_batch
        env: Dict[str, Any] = {block.input_name: x, **block.block_env()}
        t = self.rt.tracker
        capture = t.capture
        # The block input comes from outside the layer (previous layer or embedding).
        if t.light is None:
            t.note_output(x, Op("input", "other", block.bgl_layer - 1), overwrite=False)
        if capture:
            self.rt.record_env(block.bgl_layer, block.input_name, x)
        rec = self._recompute_set(block, mb) if t.light is None else set()
        n = len(steps)
        i = 0
        issuer = t.issuer if t.issuer is not None and t.issuer.active else None
        while i < n:
            if issuer is not None:
                issuer.forward_op(mb, ops[i])
            if i in rec:
                j = i
                while j + 1 < n and j + 1 in rec:
                    j += 1
                self._run_region(block, steps, ops, env, i, j)
                i = j + 1
                continue
            op = ops[i]
            t.scope.append(op)
            t0 = time.perf_counter() if capture else 0.0
            try:
                out = run_step(steps[i], env)
            finally:
                t.scope.pop()
            if capture:
                self.rt.op_ms[op.name] = self.rt.op_ms.get(op.name, 0.0) + \
                    (time.perf_counter() - t0) * 1e3 / max(len(self.rt.blocks), 1)
            if t.light is None:
                t.note_output(out, op)
            if capture:
                for name in steps[i].outputs:
                    self.rt.record_env(block.bgl_layer, name, env[name])
            if steps[i].gate and "load" in env:
                if self.rt.observe_gate(block.bgl_layer, float(env["load"])):
                    t.end_light()  # the rest of the forward may move activations
                    rec = self._recompute_set(block, mb, frozen_before=i)
            i += 1
        return env[block.output_name]

    def _run_region(self, block: OpBlock, steps: List[Step], ops: List[Op],
                    env: Dict[str, Any], i: int, j: int) -> None:
        produced: Set[str] = set()
        inputs: List[str] = []
        for k in range(i, j + 1):
            for name in steps[k].inputs:
                if name not in produced and name not in inputs:
                    inputs.append(name)
            produced.update(steps[k].outputs)
        later = {name for s in steps[j + 1:] for name in s.inputs} | {block.output_name}
        outputs = [name for k in range(i, j + 1) for name in steps[k].outputs if name in later]
        gate_layer = block.bgl_layer

        def region(*values: Any) -> Tuple[Any, ...]:
            local = dict(zip(inputs, values))
            for k in range(i, j + 1):
                run_step(steps[k], local)
                if steps[k].gate and "load" in local and self.rt.forwarding \
                        and torch.is_grad_enabled():
                    self.rt._observe_only(gate_layer, float(local["load"]))
            return tuple(local[name] for name in outputs)

        values = [env[name] for name in inputs]
        self.rt.tracker.hold_inputs([v for v in values if isinstance(v, torch.Tensor)], ops[i])
        t0 = time.perf_counter()
        result = checkpoint(region, *values, use_reentrant=False, preserve_rng_state=True)
        self.rt.iter["recompute_ms"] += (time.perf_counter() - t0) * 1e3
        self.rt.iter["recompute_ops"] += j - i + 1
        for name, v in zip(outputs, result):
            env[name] = v

    def learn_savers(self, recs: List[Any]) -> None:
        """Which steps of each block read each saved value, from the capture's records."""
        for b in self.rt.blocks:
            steps = b.op_steps()
            ops = self.rt.layer_ops[b.bgl_layer]
            index = {op: k for k, op in enumerate(ops)}
            savers: Dict[str, Set[int]] = {n: set() for s in steps for n in s.outputs}
            by_key = getattr(self.rt, "_env_keys", {}).get(b.bgl_layer, {})
            for r in recs:
                name = by_key.get(r.key)
                if name is None:
                    continue
                savers.setdefault(name, set()).update(index[c] for c in r.consumers
                                                      if c in index)
            b.bgl_savers = savers if by_key else _consumers(steps)


def _consumers(steps: List[Step]) -> Dict[str, Set[int]]:
    out: Dict[str, Set[int]] = {}
    for i, s in enumerate(steps):
        for n in s.inputs:
            out.setdefault(n, set()).add(i)
    return out
