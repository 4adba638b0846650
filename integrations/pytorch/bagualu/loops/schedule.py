"""Pipeline schedules as bagualu scheduling points, and a 1F1B adapter for stages that talk to
their neighbours with torch.distributed point-to-point calls.

A point is ``(phase, forward_mb, backward_mb)`` (``one_f_one_b``: one model chunk per rank) or
``(phase, forward_mb, backward_mb, forward_chunk, backward_chunk)`` (``interleaved_one_f_one_b``:
several chunks per rank; a chunk is ``None`` where its micro-batch is ``None``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import api as bagualu

Point = Tuple[str, Optional[int], Optional[int]]
ChunkPoint = Tuple[str, Optional[int], Optional[int], Optional[int], Optional[int]]


def one_f_one_b(micro_batches: int, stages: int, rank: int) -> List[Point]:
    """The scheduling points (phase, forward mb, backward mb) of stage ``rank`` in 1F1B:
    warm-up forwards, steady forward+backward pairs, cool-down backwards. On the last stage
    F_x and B_x are two points."""
    return [p[:3] for p in interleaved_one_f_one_b(micro_batches, stages, rank, 1)]


def interleaved_one_f_one_b(micro_batches: int, stages: int, rank: int,
                            chunks: int) -> List[ChunkPoint]:
    """The scheduling points (phase, forward mb, backward mb, forward chunk, backward chunk)
    of pipeline rank ``rank`` of ``stages`` holding ``chunks`` model chunks (chunk c is local
    stage c: the stages ``rank + c * stages`` of the model) in interleaved 1F1B. The order is
    the planner's own (``bgl_planner_schedule``, Megatron's schedule: ``(stages - rank - 1) * 2
    + (chunks - 1) * stages`` warm-up forwards); a steady forward and the backward after it are
    one point, except the same micro-batch of the same chunk (the last rank's last chunk),
    which is two. Interleaving needs ``micro_batches`` divisible by ``stages``; bad arguments
    raise ValueError."""
    from ..planning.embedded import schedule_steps
    steps = schedule_steps(stages, rank, micro_batches, chunks)
    points: List[ChunkPoint] = []
    i = 0
    while i < len(steps):
        s = steps[i]
        n = steps[i + 1] if i + 1 < len(steps) else None
        f, fc = s["micro_batch"], s["chunk"]
        if s["forward"] and s["phase"] == "steady" and n is not None and not n["forward"] \
                and n["phase"] == "steady" and (n["micro_batch"], n["chunk"]) != (f, fc):
            points.append(("steady", f, n["micro_batch"], fc, n["chunk"]))
            i += 2
            continue
        points.append((s["phase"], f, None, fc, None) if s["forward"]
                      else (s["phase"], None, f, None, fc))
        i += 1
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
