"""Pipeline schedules as bagualu scheduling points, and a 1F1B adapter for stages that talk to
their neighbours with torch.distributed point-to-point calls.

A point is ``(phase, forward_mb, backward_mb)`` (``one_f_one_b``: one model chunk per rank) or
``(phase, forward_mb, backward_mb, forward_chunk, backward_chunk)`` (``interleaved_one_f_one_b``:
several chunks per rank; a chunk is ``None`` where its micro-batch is ``None``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

Point = Tuple[str, Optional[int], Optional[int]]
ChunkPoint = Tuple[str, Optional[int], Optional[int], Optional[int], Optional[int]]


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


def _interleaved_unit(k: int, forward: bool, stages: int, chunks: int) -> Tuple[int, int]:
    """(micro-batch, chunk) of the k-th forward or backward of a rank in Megatron's
    interleaved order: groups of ``stages`` micro-batches walk the chunks in turn (backwards
    from the last chunk)."""
    group = stages * chunks
    in_group = k % group
    chunk = in_group // stages
    return (k // group) * stages + in_group % stages, chunk if forward else chunks - 1 - chunk


def interleaved_one_f_one_b(micro_batches: int, stages: int, rank: int,
                            chunks: int) -> List[ChunkPoint]:
    """The scheduling points (phase, forward mb, backward mb, forward chunk, backward chunk)
    of pipeline rank ``rank`` of ``stages`` holding ``chunks`` model chunks (the stages
    ``rank``, ``rank + stages``, ... of the model: chunk c is local stage c) in interleaved 1F1B,
    the planner's step order (governor/planner/pipeline_schedule.cc, Megatron's schedule):
    ``(stages - rank - 1) * 2 + (chunks - 1) * stages`` warm-up forwards, steady
    forward+backward pairs, cool-down backwards. A steady pair whose forward and backward are
    the same micro-batch of the same chunk (the last rank's last chunk) is two points, as on
    the last stage of ``one_f_one_b``. ``chunks=1`` gives the points of ``one_f_one_b`` with
    chunk 0. Interleaving (chunks > 1) needs ``micro_batches`` divisible by ``stages``."""
    if not 0 <= rank < stages:
        raise ValueError(f"rank {rank} outside 0..{stages - 1}")
    if chunks < 1:
        raise ValueError(f"chunks must be positive, got {chunks}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be positive, got {micro_batches}")
    if chunks == 1:
        return [(ph, f, b, None if f is None else 0, None if b is None else 0)
                for ph, f, b in one_f_one_b(micro_batches, stages, rank)]
    if micro_batches % stages:
        raise ValueError(f"interleaved 1F1B needs micro_batches ({micro_batches}) divisible "
                         f"by the pipeline stages ({stages})")
    total = micro_batches * chunks
    warm = min((stages - rank - 1) * 2 + (chunks - 1) * stages, total)
    points: List[ChunkPoint] = []
    for k in range(warm):
        f, fc = _interleaved_unit(k, True, stages, chunks)
        points.append(("warmup", f, None, fc, None))
    for k in range(warm, total):
        f, fc = _interleaved_unit(k, True, stages, chunks)
        b, bc = _interleaved_unit(k - warm, False, stages, chunks)
        if (f, fc) == (b, bc):
            points.append(("steady", f, None, fc, None))
            points.append(("steady", None, b, None, bc))
        else:
            points.append(("steady", f, b, fc, bc))
    for k in range(total - warm, total):
        b, bc = _interleaved_unit(k, False, stages, chunks)
        points.append(("cooldown", None, b, None, bc))
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
