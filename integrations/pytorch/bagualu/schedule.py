"""Pipeline schedules as bagualu scheduling points, and a 1F1B adapter for stages that talk to
their neighbours with torch.distributed point-to-point calls."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Point = Tuple[str, Optional[int], Optional[int]]


def one_f_one_b(micro_batches: int, stages: int, rank: int) -> List[Point]:
    """The scheduling points (phase, forward mb, backward mb) of stage ``rank`` in 1F1B:
    warm-up forwards, steady forward+backward pairs, cool-down backwards (the planner's
    step order for the same stage)."""
    if not 0 <= rank < stages:
        raise ValueError(f"rank {rank} outside 0..{stages - 1}")
    warm = min(stages - rank - 1, micro_batches)
    points: List[Point] = [("warmup", f, None) for f in range(warm)]
    for i in range(micro_batches - warm):
        if warm + i == i:  # the last stage: F_x and B_x are two points
            points.append(("steady", i, None))
            points.append(("steady", None, i))
        else:
            points.append(("steady", warm + i, i))
    for b in range(micro_batches - warm, micro_batches):
        points.append(("cooldown", None, b))
    return points


@dataclass
class P2PStage:
    """Runs one pipeline stage's 1F1B iteration with torch.distributed send/recv.

    forward_fn(mb, input or None) -> output (last stage: the scalar loss); activations go to
    rank+1, gradients come back from it. Every forward and backward runs inside
    bagualu.forward / bagualu.backward, every point calls bagualu.step_point."""

    rank: int
    stages: int
    micro_batches: int
    shape: Tuple[int, ...]
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    group: Any = None

    def run(self, forward_fn: Callable[[int, Optional[torch.Tensor]], torch.Tensor]
            ) -> Dict[int, float]:
        import torch.distributed as dist
        import bagualu
        first, last = self.rank == 0, self.rank == self.stages - 1
        inputs: Dict[int, torch.Tensor] = {}
        outputs: Dict[int, torch.Tensor] = {}
        losses: Dict[int, float] = {}
        pending: List[Any] = []  # isend handles and their buffers (sends never block)

        def do_forward(phase: str, f: int) -> None:
            x = None
            if not first:
                x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                dist.recv(x, self.rank - 1, group=self.group)
                x.requires_grad_(True)
                inputs[f] = x
            with bagualu.forward(f):
                out = forward_fn(f, x)
            if last:
                losses[f] = float(out.detach())
            else:
                buf = out.detach().contiguous()
                pending.append((dist.isend(buf, self.rank + 1, group=self.group), buf))
            outputs[f] = out

        def do_backward(b: int) -> None:
            out = outputs.pop(b)
            with bagualu.backward(b):
                if last:
                    out.backward()
                else:
                    g = torch.empty_like(out)
                    dist.recv(g, self.rank + 1, group=self.group)
                    out.backward(g)
            if not first:
                x = inputs.pop(b)
                buf = x.grad.contiguous()
                pending.append((dist.isend(buf, self.rank - 1, group=self.group), buf))

        for phase, f, b in one_f_one_b(self.micro_batches, self.stages, self.rank):
            bagualu.step_point(phase, f, b)
            if f is not None:
                do_forward(phase, f)
            if b is not None:
                do_backward(b)
        for handle, _ in pending:
            handle.wait()
        return losses
