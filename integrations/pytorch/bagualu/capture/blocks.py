"""The OpBlock path: models written as chains of ``bagualu.Step`` (``bagualu.OpBlock``
layers). Each block is one planner layer and each step one operator; recompute runs a region
of consecutive steps under ``torch.utils.checkpoint``; modules outside the blocks that look
like operators are scoped and kept.

Unmodified models take the other path (capture/modules.py, recompute.py); both share the
runtime's tracker, plans and contexts, seen through capture/host.py. Not thread-safe: used
from the training thread.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Set, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..discovery.find import classify
from ..discovery.opblock import OpBlock, Step, recompute_closure, run_step
from ..errors import InstrumentError
from ..vocabulary import RECOMPUTE, Op
from .host import Host


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
        # layer -> storage pointer -> the env name it was saved under (capture only)
        self.env_keys: Dict[int, Dict[int, str]] = {}
        count = 0
        inside: Set[nn.Module] = set()
        for i, b in enumerate(blocks):
            b.bgl_layer = i
            self.layer_ops[i] = [Op(s.op, s.kind, i) for s in b.op_steps()]
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

    def begin_forward(self, capture: bool) -> None:
        """A forward starts; the capture learns which env name each saved storage has."""
        if capture:
            self.env_keys = {}

    def record_env(self, layer: int, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            self.env_keys.setdefault(layer, {})[value.untyped_storage().data_ptr()] = name

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

    def _recompute_set(self, block: OpBlock, mb: int, frozen_before: int = -1) -> Set[int]:
        steps = block.op_steps()
        ops = self.layer_ops[block.bgl_layer]
        chosen = {i for i, op in enumerate(ops) if self.host.strategy_of(op, mb) == RECOMPUTE
                  and i > frozen_before}
        if not chosen:
            return chosen
        return recompute_closure(steps, chosen, block.bgl_savers or _consumers(steps),
                                 block.input_name, frozen_before)

    def run_block(self, block: OpBlock, x: torch.Tensor) -> torch.Tensor:
        steps = block.op_steps()
        ops = self.layer_ops[block.bgl_layer]
        mb = self.host.tracker.micro_batch
        env: Dict[str, Any] = {block.input_name: x, **block.block_env()}
        t = self.host.tracker
        capture = t.capture
        # The block input comes from outside the layer (previous layer or embedding).
        if t.light is None:
            t.note_output(x, Op("input", "other", block.bgl_layer - 1), overwrite=False)
        if capture:
            self.record_env(block.bgl_layer, block.input_name, x)
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
                self.host.op_time(op.name,
                                  (time.perf_counter() - t0) * 1e3 / max(len(self.blocks), 1))
            if t.light is None:
                t.note_output(out, op)
            if capture:
                for name in steps[i].outputs:
                    self.record_env(block.bgl_layer, name, env[name])
            if steps[i].router and "load" in env:
                if self.host.observe_router(block.bgl_layer, float(env["load"])):
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
        router_layer = block.bgl_layer

        def region(*values: Any) -> Tuple[Any, ...]:
            local = dict(zip(inputs, values))
            for k in range(i, j + 1):
                run_step(steps[k], local)
                if steps[k].router and "load" in local and self.host.forwarding \
                        and torch.is_grad_enabled():
                    self.host.note_load(router_layer, float(local["load"]))
            return tuple(local[name] for name in outputs)

        values = [env[name] for name in inputs]
        self.host.tracker.hold_inputs([v for v in values if isinstance(v, torch.Tensor)], ops[i])
        t0 = time.perf_counter()
        result = checkpoint(region, *values, use_reentrant=False, preserve_rng_state=True)
        self.host.note_recompute((time.perf_counter() - t0) * 1e3, j - i + 1)
        for name, v in zip(outputs, result):
            env[name] = v

    def learn_savers(self, recs: List[Any]) -> None:
        """Which steps of each block read each saved value, from the capture's records."""
        for b in self.blocks:
            steps = b.op_steps()
            ops = self.layer_ops[b.bgl_layer]
            index = {op: k for k, op in enumerate(ops)}
            savers: Dict[str, Set[int]] = {n: set() for s in steps for n in s.outputs}
            by_key = self.env_keys.get(b.bgl_layer, {})
            for r in recs:
                name = by_key.get(r.ptr)
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
