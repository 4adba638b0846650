"""An adapter that makes a ``torch.distributed.pipelining`` schedule call bagualu.

    stage = PipelineStage(model, rank, world, device, input_args=(x_mb,), output_args=(y_mb,))
    schedule = bagualu.pipelining.wrap_schedule(Schedule1F1B(stage, n_mb, loss_fn=loss_fn))
    for it in range(steps):
        schedule.step(x)       # last stage: step(target=y, losses=losses); inside
        optimizer.step()       # begin_iteration() ... end_iteration()

The wrapper patches the stage's ``forward_one_chunk`` / ``backward_one_chunk`` (and, on the
last stage, the schedule's loss computation) on the instances it is given: every micro-batch's
forward (with its loss) runs inside ``bagualu.forward(mb)``, every backward inside
``bagualu.backward(mb)``, and ``bagualu.step_point(phase, f, b)`` is called at the schedule's
points (those of ``bagualu.schedule.one_f_one_b`` for ``Schedule1F1B``: the torch schedule runs
the same operations in the same order). Single-stage-per-rank schedules only
(``Schedule1F1B``, ``ScheduleGPipe``); interleaved (multi-stage) schedules are refused.

On gloo torch 2.5.1's Schedule1F1B hangs (pytorch/pytorch#132644): ``_batch_p2p`` returns
only the last ``Work`` of ``dist.batch_isend_irecv(...)`` (``.pop()``); gloo drops a send whose
``Work`` is destroyed before the peer posted its receive, so the peer waits forever.
``fix_batch_p2p()`` (called by ``wrap_schedule``) replaces that function, where it has the
``.pop()``, with one that waits for every operation of the batch, as pytorch/pytorch#152938 does.
"""
from __future__ import annotations

import inspect
import logging
import sys
from contextlib import ExitStack
from typing import Any, List, Optional, Tuple

from .errors import BagualuError
from .schedule import Point, one_f_one_b

__all__ = ["wrap_schedule", "PipelinedSchedule", "schedule_points", "gpipe", "fix_batch_p2p"]

log = logging.getLogger("bagualu")
Op = Tuple[str, int, int, bool]  # kind ("F"/"B"), micro-batch, point index, first op of point


def gpipe(micro_batches: int) -> List[Point]:
    """The scheduling points of a GPipe (fill-drain) stage: every forward, then every
    backward."""
    return ([("warmup", f, None) for f in range(micro_batches)]
            + [("cooldown", None, b) for b in range(micro_batches)])


def schedule_points(schedule: Any) -> List[Point]:
    """The bagualu scheduling points of one ``step()`` of a torch pipelining schedule."""
    from torch.distributed.pipelining import schedules as S
    if not isinstance(schedule, S.PipelineScheduleSingle):
        raise BagualuError(
            f"{type(schedule).__name__} is not supported: bagualu adapts schedules with one "
            "stage per rank (Schedule1F1B, ScheduleGPipe)")
    stage, n = schedule._stage, schedule._n_microbatches
    if not schedule._has_backward:
        raise BagualuError(f"{type(schedule).__name__} has no loss_fn: nothing to plan "
                           "(bagualu plans activations kept for a backward)")
    if isinstance(schedule, S.Schedule1F1B):
        return one_f_one_b(n, stage.num_stages, stage.stage_index)
    if isinstance(schedule, S.ScheduleGPipe):
        return gpipe(n)
    raise BagualuError(f"{type(schedule).__name__}: unknown operation order; pass points= "
                       "(a list of (phase, forward_mb, backward_mb))")


class _AllWorks:
    """The works of one batch_isend_irecv; wait() waits for all of them (and keeps them
    alive until then, so gloo does not cancel a send)."""

    def __init__(self, works: List[Any]) -> None:
        self.works = works

    def wait(self, *args: Any) -> bool:
        for w in self.works:
            w.wait(*args)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _batch_p2p_all(p2p_ops: List[Any], desc: Optional[str] = None) -> Any:
    import torch.distributed as dist
    if len(p2p_ops) == 0:
        return None
    return _AllWorks(dist.batch_isend_irecv(p2p_ops))


def fix_batch_p2p() -> bool:
    """Makes torch.distributed.pipelining's ``_batch_p2p`` wait for every operation of a
    batch (pytorch/pytorch#132644: with gloo the schedules otherwise hang). Idempotent; returns
    whether the fix is in place, False (and changes nothing) where torch's ``_batch_p2p`` does
    not drop works (no ``.pop()`` in its source)."""
    try:
        from torch.distributed.pipelining import schedules as S
    except ImportError:  # no torch.distributed.pipelining
        return False
    current = getattr(S, "_batch_p2p", None)
    if current is _batch_p2p_all:
        return True
    try:
        source = inspect.getsource(current) if current is not None else ""
    except (OSError, TypeError):
        source = ""
    if ".pop()" not in source:  # already keeps every work (or unknown code: left alone)
        return False
    S._batch_p2p = _batch_p2p_all
    log.info("bagualu: torch.distributed.pipelining waits for every send and receive of "
             "a batch (pytorch/pytorch#132644)")
    return True


class PipelinedSchedule:
    """A torch pipelining schedule whose stage calls bagualu; see ``wrap_schedule``."""

    def __init__(self, schedule: Any, points: Optional[List[Point]] = None,
                 iterations: bool = True) -> None:
        from torch.distributed.pipelining import schedules as S
        if not isinstance(schedule, S.PipelineScheduleSingle):
            raise BagualuError(
                f"{type(schedule).__name__} is not supported: bagualu adapts schedules with one "
                "stage per rank (Schedule1F1B, ScheduleGPipe)")
        self.schedule = schedule
        self.stage = schedule._stage
        self.expected: List[Point] = list(points) if points is not None \
            else schedule_points(schedule)
        self.ops: List[Op] = []
        for i, (_, f, b) in enumerate(self.expected):
            if f is not None:
                self.ops.append(("F", f, i, True))
            if b is not None:
                self.ops.append(("B", b, i, f is None))
        self.iterations = iterations
        self.points: List[Point] = []        # the points called in the current/last step
        self.plans = 0                       # how many of them returned a plan
        self.micro_batch: Optional[int] = None  # whose forward or backward is running
        self.line: Optional[dict] = None     # the last end_iteration line
        self._cursor = 0
        self._pending: Optional[ExitStack] = None
        self._orig = (self.stage.forward_one_chunk, self.stage.backward_one_chunk,
                      schedule._maybe_compute_loss)
        self.stage.forward_one_chunk = self._forward_one_chunk
        self.stage.backward_one_chunk = self._backward_one_chunk
        schedule._maybe_compute_loss = self._maybe_compute_loss

    # -- the patched methods ----------------------------------------------------------------
    def _advance(self, kind: str, mb: int) -> None:
        import bagualu
        if self._cursor >= len(self.ops) or self.ops[self._cursor][:2] != (kind, mb):
            want = "nothing" if self._cursor >= len(self.ops) else "%s%d" % self.ops[
                self._cursor][:2]
            raise BagualuError(f"{type(self.schedule).__name__} ran {kind}{mb} where bagualu "
                               f"expected {want} (operation {self._cursor} of its points); "
                               "pass points= matching the schedule")
        _, _, index, first = self.ops[self._cursor]
        self._cursor += 1
        if first:
            point = self.expected[index]
            if bagualu.step_point(*point) is not None:
                self.plans += 1
            self.points.append(point)

    def _close_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.close()
            self.micro_batch = None

    def _forward_one_chunk(self, fwd_chunk_id: int, args: Tuple[Any, ...],
                           kwargs: Optional[dict] = None) -> Any:
        import bagualu
        self._close_pending()
        self._advance("F", fwd_chunk_id)
        stack = ExitStack()
        stack.enter_context(bagualu.forward(fwd_chunk_id))
        self.micro_batch = fwd_chunk_id
        try:
            out = self._orig[0](fwd_chunk_id, args, kwargs)
        except BaseException:
            self.micro_batch = None
            stack.__exit__(*sys.exc_info())
            raise
        if self.stage.is_last and self.schedule._has_backward:
            self._pending = stack  # the loss belongs to this forward: closed after it
        else:
            stack.close()
            self.micro_batch = None
        return out

    def _maybe_compute_loss(self, stage: Any, output: Any, target_mbs: Any,
                            mb_index: int) -> Any:
        try:
            return self._orig[2](stage, output, target_mbs, mb_index)
        finally:
            self._close_pending()

    def _backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None,
                            full_backward: bool = True) -> Any:
        import bagualu
        self._close_pending()
        self._advance("B", bwd_chunk_id)
        self.micro_batch = bwd_chunk_id
        try:
            with bagualu.backward(bwd_chunk_id):
                return self._orig[1](bwd_chunk_id, loss=loss, full_backward=full_backward)
        finally:
            self.micro_batch = None

    # -- the schedule's interface -----------------------------------------------------------
    def step(self, *args: Any, target: Any = None, losses: Optional[List] = None,
             **kwargs: Any) -> Any:
        """One iteration of the schedule (``begin_iteration`` / ``end_iteration`` around it
        unless ``iterations=False``); returns what the schedule's step returns."""
        import bagualu
        bagualu.current()  # raises BagualuError when bagualu is not installed
        self._cursor, self.points, self.plans = 0, [], 0
        if self.iterations:
            bagualu.begin_iteration()
        try:
            out = self.schedule.step(*args, target=target, losses=losses, **kwargs)
        finally:
            self._close_pending()
        if self._cursor != len(self.ops):
            raise BagualuError(f"{type(self.schedule).__name__} ran {self._cursor} of the "
                               f"{len(self.ops)} operations bagualu expected")
        if self.iterations:
            self.line = bagualu.end_iteration()
        return out

    def unwrap(self) -> Any:
        """Restores the stage's and the schedule's methods; returns the schedule."""
        self._close_pending()
        for obj, name in ((self.stage, "forward_one_chunk"), (self.stage, "backward_one_chunk"),
                          (self.schedule, "_maybe_compute_loss")):
            obj.__dict__.pop(name, None)
        return self.schedule

    def __getattr__(self, name: str) -> Any:  # the schedule's other attributes
        schedule = self.__dict__.get("schedule")
        if schedule is None:
            raise AttributeError(name)
        return getattr(schedule, name)


def wrap_schedule(schedule: Any, points: Optional[List[Point]] = None,
                  iterations: bool = True, fix_p2p: bool = True) -> PipelinedSchedule:
    """Makes a torch.distributed.pipelining schedule (Schedule1F1B, ScheduleGPipe; built with
    its ``PipelineStage`` and ``loss_fn``) call bagualu at its scheduling points.

    ``points``: the (phase, forward_mb, backward_mb) order of one step when the schedule is
    not one bagualu knows. ``iterations``: wrap every ``step()`` in begin_iteration /
    end_iteration. ``fix_p2p``: apply ``fix_batch_p2p()`` (needed on gloo before torch 2.8)."""
    if fix_p2p:
        fix_batch_p2p()
    if isinstance(schedule, PipelinedSchedule):
        raise BagualuError("the schedule is already wrapped")
    return PipelinedSchedule(schedule, points, iterations)
