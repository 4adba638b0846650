"""OpBlock, the layer DSL: a layer written as a chain of operators (``Step``) over named
tensors; each step is one planner operator (capture/blocks.py runs them under bagualu)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..vocabulary import KINDS


@dataclass
class Step:
    """One operator of an OpBlock: fn(*env[inputs]) -> value(s) for env[outputs]."""

    op: str
    kind: str
    fn: Callable[..., Any]
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    router: bool = False  # its output named 'load' is the observed load factor


class OpBlock(nn.Module):
    """A transformer layer as a chain of operators. Subclasses implement build_steps()."""

    input_name = "x"
    output_name = "out"

    def __init__(self) -> None:
        super().__init__()
        self.bgl_layer = -1
        self._steps: Optional[List[Step]] = None

    def build_steps(self) -> List[Step]:
        raise NotImplementedError

    def block_env(self) -> Dict[str, Any]:
        """Extra named values (non-tensor state such as a routing knob) fixed at the start of
        each forward, so a recompute sees the values the forward saw."""
        return {}

    def op_steps(self) -> List[Step]:
        if self._steps is None:
            self._steps = self.build_steps()
            for s in self._steps:
                if s.kind not in KINDS:
                    raise ValueError(f"{type(self).__name__}: step '{s.op}' has unknown kind "
                                     f"'{s.kind}' (known: {', '.join(KINDS)})")
        return self._steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .. import _active
        rt = _active.runtime
        if rt is not None and rt.block_path is not None and rt.block_path.instrumented(self):
            return rt.block_path.run_block(self, x)
        env: Dict[str, Any] = {self.input_name: x, **self.block_env()}
        for s in self.op_steps():
            run_step(s, env)
        return env[self.output_name]


def run_step(s: Step, env: Dict[str, Any]) -> Any:
    """Runs one step on env, storing its outputs; returns the raw result."""
    out = s.fn(*[env[n] for n in s.inputs])
    if len(s.outputs) == 1:
        env[s.outputs[0]] = out
    else:
        for n, v in zip(s.outputs, out):
            env[n] = v
    return out
