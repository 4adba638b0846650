"""An adapter that makes a ``torch.distributed.pipelining`` schedule call bagualu.

    stage = PipelineStage(model, rank, world, device, input_args=(x_mb,), output_args=(y_mb,))
    schedule = pipelining.wrap_schedule(Schedule1F1B(stage, n_mb, loss_fn=loss_fn))
    for it in range(steps):
        schedule.step(x)       # last stage: step(target=y, losses=losses); inside
        optimizer.step()       # begin_iteration() ... end_iteration()

The wrapper patches the stages' ``forward_one_chunk`` / ``backward_one_chunk`` (and the
schedule's loss computation) on the instances it is given: every micro-batch's forward (with
its loss on the last stage) runs inside ``bagualu.forward(mb)``, every backward inside
``bagualu.backward(mb)``, and ``bagualu.step_point(phase, f, b)`` is called before the first
operation of each of the schedule's points. The patched methods take whatever positional and
keyword arguments the installed torch passes (``save_forward_output``, ``last_backward``,
``loss_kwargs``, ... on current torch; the 2.5 signatures too) and hand them on unchanged.

Schedules with one stage per rank (``Schedule1F1B``, ``ScheduleGPipe``): the points of
``bagualu.schedule.one_f_one_b`` (torch's 1F1B runs the same operations in the same order) or
of ``gpipe``. Schedules with several stages per rank (``ScheduleInterleaved1F1B``, and the
other ``PipelineScheduleMulti`` schedules made of forwards and full backwards): the points
are derived from the operations torch runs on this rank (``pipeline_order_with_comms`` where
torch lowers the schedule to it, else ``pipeline_order``), each stage being the chunk of its
rank in stage-index order; points are then ``(phase, f, b, forward_chunk, backward_chunk)``
and the calls ``bagualu.forward(mb, chunk=c)``, ``bagualu.backward(mb, chunk=c)`` and
``bagualu.step_point(phase, f, b, forward_chunk=fc, backward_chunk=bc)``. For
``ScheduleInterleaved1F1B`` with micro-batches divisible by the ranks these are the points of
``bagualu.schedule.interleaved_one_f_one_b`` (the planner's order). Schedules that split the
backward into input and weight parts (zero-bubble, DualPipeV: ``I``/``W`` actions) are refused.

On gloo torch 2.5.1's Schedule1F1B hangs (pytorch/pytorch#132644): ``_batch_p2p`` returns
only the last ``Work`` of ``dist.batch_isend_irecv(...)`` (``.pop()``); gloo drops a send whose
``Work`` is destroyed before the peer posted its receive, so the peer waits forever.
``fix_batch_p2p()`` (called by ``wrap_schedule``) replaces that function, where it has the
``.pop()``, with one that waits for every operation of the batch, as pytorch/pytorch#152938 does.
Current torch (2.8 and later) returns every work; there the call changes nothing.
"""
from __future__ import annotations

import inspect
import logging
import sys
from contextlib import ExitStack
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .. import api as bagualu
from ..errors import BagualuError
from .schedule import Point, interleaved_one_f_one_b, one_f_one_b

__all__ = ["wrap_schedule", "PipelinedSchedule", "schedule_points", "points_from_actions",
           "gpipe", "fix_batch_p2p"]

log = logging.getLogger("bagualu")
AnyPoint = Tuple[Any, ...]  # (phase, f, b) or (phase, f, b, forward_chunk, backward_chunk)
# kind ("F"/"B"), micro-batch, chunk, point index, first operation of its point
Op = Tuple[str, int, int, int, bool]
Action = Tuple[str, int, int]  # kind ("F"/"B"), micro-batch, chunk


def gpipe(micro_batches: int) -> List[Point]:
    """The scheduling points of a GPipe (fill-drain) stage: every forward, then every
    backward."""
    return ([("warmup", f, None) for f in range(micro_batches)]
            + [("cooldown", None, b) for b in range(micro_batches)])


def points_from_actions(actions: Sequence[Action]) -> List[AnyPoint]:
    """Scheduling points (phase, f, b, forward_chunk, backward_chunk) of one rank's sequence of
    compute operations ``(kind, micro_batch, chunk)``, kind "F" or "B", in the order they run.

    Every forward before every backward (fill-drain, as GPipe): the forwards are ``warmup``,
    the backwards ``cooldown``. Otherwise a forward immediately followed by a backward is one
    point (the 1F1B pair), unless both are the same micro-batch of the same chunk (then two
    points, as on the last stage of ``one_f_one_b``); forwards before the first such pair or
    backward are ``warmup``, backwards after the last forward ``cooldown``, everything else
    ``steady``. For the operations of interleaved 1F1B this gives the planner's points
    (``interleaved_one_f_one_b``) except where the planner's warm-up holds every forward
    (``schedule_points`` then takes the planner's grouping of the same operations)."""
    last_forward = max((i for i, a in enumerate(actions) if a[0] == "F"), default=-1)
    first_backward = min((i for i, a in enumerate(actions) if a[0] == "B"),
                         default=len(actions))
    if last_forward < first_backward:  # fill-drain
        return [("warmup", mb, None, c, None) if kind == "F" else ("cooldown", None, mb, None, c)
                for kind, mb, c in actions]
    points: List[AnyPoint] = []
    started = False  # a backward has run: later lone forwards are steady, not warm-up
    i = 0
    while i < len(actions):
        kind, mb, chunk = actions[i]
        nxt = actions[i + 1] if i + 1 < len(actions) else None
        if kind not in ("F", "B"):
            raise BagualuError(f"unknown operation kind {kind!r} (F or B)")
        if kind == "F" and nxt is not None and nxt[0] == "B":
            started = True
            if (nxt[1], nxt[2]) != (mb, chunk):
                points.append(("steady", mb, nxt[1], chunk, nxt[2]))
            else:  # F_x B_x: two points
                points.append(("steady", mb, None, chunk, None))
                points.append(("steady", None, mb, None, chunk))
            i += 2
            continue
        if kind == "F":
            points.append(("steady" if started else "warmup", mb, None, chunk, None))
        else:
            started = True
            points.append(("cooldown" if i > last_forward else "steady", None, mb, None, chunk))
        i += 1
    return points


def _schedules() -> Any:
    try:
        from torch.distributed.pipelining import schedules as S
    except ImportError as e:  # torch without torch.distributed
        raise BagualuError(f"torch.distributed.pipelining is not available: {e}") from e
    return S


def _local_stages(schedule: Any) -> Tuple[List[Any], bool]:
    """The schedule's stages on this rank in stage-index order, and whether the schedule is a
    multi-stage one (PipelineScheduleMulti)."""
    S = _schedules()
    if isinstance(schedule, S.PipelineScheduleSingle):
        return [schedule._stage], False
    if isinstance(schedule, S.PipelineScheduleMulti):
        return sorted(schedule._stages, key=lambda s: s.stage_index), True
    raise BagualuError(
        f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule bagualu "
        "adapts (PipelineScheduleSingle: Schedule1F1B, ScheduleGPipe; PipelineScheduleMulti: "
        "ScheduleInterleaved1F1B, ScheduleLoopedBFS)")


def _check_backward(schedule: Any) -> None:
    if not schedule._has_backward:
        raise BagualuError(f"{type(schedule).__name__} has no loss_fn: nothing to plan "
                           "(bagualu plans activations kept for a backward)")


def _kind(computation_type: Any) -> str:
    """"F", "B", "I", "W", "SEND_F", ... of a torch action type (a str enum on current torch,
    an int enum whose str() is the letter on torch 2.5)."""
    value = getattr(computation_type, "value", computation_type)
    return value if isinstance(value, str) else str(computation_type)


def _rank_actions(schedule: Any, stages: List[Any], rank: Optional[int] = None
                  ) -> List[Action]:
    """The forwards and full backwards pipeline rank ``rank`` (default: this one) runs in one
    step of a multi-stage schedule, as (kind, micro-batch, chunk); the chunks of a rank are
    its stages in stage-index order."""
    name = type(schedule).__name__
    own = getattr(schedule, "rank", None)
    if own is None:
        own = stages[0].group_rank
    rank = own if rank is None else rank
    if rank == own:
        local = [s.stage_index for s in stages]
    else:
        mapping = getattr(schedule, "stage_index_to_group_rank", None) or {}
        local = sorted(s for s, r in mapping.items() if r == rank)
    order = None
    for attr in ("pipeline_order_with_comms", "pipeline_order"):  # what runs, else the plan
        table = getattr(schedule, attr, None)
        if table and table.get(rank):
            order = table[rank]
            break
    if order is None:
        raise BagualuError(f"{name} has no operation order for rank {rank} "
                           "(pipeline_order); pass points=")
    custom = getattr(schedule, "_comp_type_to_function_map", None) or {}
    if any(_kind(t) in ("F", "B") for t in custom):
        raise BagualuError(f"{name} runs forwards or backwards through custom functions "
                           "(register_custom_function): bagualu cannot see them")
    chunk_of = {s: c for c, s in enumerate(local)}
    split = getattr(schedule, "use_full_backward", True) is False  # torch 2.5's B + W
    actions: List[Action] = []

    def visit(action: Any) -> None:
        if action is None:
            return
        sub = getattr(action, "sub_actions", None)
        if sub:  # OVERLAP_F_B and similar: their parts run in order
            for a in sub:
                visit(a)
            return
        kind = _kind(action.computation_type)
        if kind in ("I", "W") or (kind == "B" and split):
            raise BagualuError(
                f"{name} splits the backward into input (I) and weight (W) parts (zero-bubble "
                "schedules); bagualu plans forwards and full backwards only: use "
                "ScheduleInterleaved1F1B, Schedule1F1B or ScheduleGPipe")
        if kind not in ("F", "B"):
            return  # communication, unshard/reshard, gradient reduction: not points
        if action.stage_index not in chunk_of:
            raise BagualuError(f"{name}: rank {rank} runs stage {action.stage_index}, which "
                               f"is not one of its stages {sorted(chunk_of)}")
        actions.append((kind, int(action.microbatch_index), chunk_of[action.stage_index]))

    for a in order:
        visit(a)
    return actions


def _chunks(point: AnyPoint) -> Tuple[int, int]:
    """(forward chunk, backward chunk) of a point; 0 for a 3-tuple or a None chunk."""
    if len(point) == 5:
        return point[3] or 0, point[4] or 0
    if len(point) == 3:
        return 0, 0
    raise BagualuError(f"point {point!r}: expected (phase, forward_mb, backward_mb) or (phase, "
                       "forward_mb, backward_mb, forward_chunk, backward_chunk)")


def _operations(points: Sequence[AnyPoint]) -> List[Op]:
    """The operations of points, in order: (kind, micro-batch, chunk, point index, whether it
    is the first operation of its point)."""
    ops: List[Op] = []
    for i, point in enumerate(points):
        f, b = point[1], point[2]
        fc, bc = _chunks(point)
        if f is not None:
            ops.append(("F", f, fc, i, True))
        if b is not None:
            ops.append(("B", b, bc, i, f is None))
    return ops


def _planner_points(schedule: Any, rank: Optional[int]) -> Optional[List[AnyPoint]]:
    """The planner's interleaved 1F1B points of the rank of a ScheduleInterleaved1F1B, or None
    (another schedule, or a configuration the planner does not model)."""
    S = _schedules()
    if not isinstance(schedule, getattr(S, "ScheduleInterleaved1F1B", ())):
        return None
    stages = schedule._stages
    ranks = getattr(schedule, "pp_group_size", None) or stages[0].group_size
    own = getattr(schedule, "rank", None)
    rank = (stages[0].group_rank if own is None else own) if rank is None else rank
    try:
        return list(interleaved_one_f_one_b(schedule._n_microbatches, ranks, rank,
                                            len(stages)))
    except ValueError:  # e.g. micro-batches not divisible by the ranks
        return None


def schedule_points(schedule: Any, rank: Optional[int] = None) -> List[AnyPoint]:
    """The bagualu scheduling points of one ``step()`` of a torch pipelining schedule:
    (phase, f, b) for one stage per rank, (phase, f, b, forward_chunk, backward_chunk) for a
    multi-stage schedule; ``rank``: those of another pipeline rank of a multi-stage schedule
    (from torch's table of every rank)."""
    S = _schedules()
    stages, multi = _local_stages(schedule)
    _check_backward(schedule)
    if multi:
        actions = _rank_actions(schedule, stages, rank)
        planned = _planner_points(schedule, rank)
        if planned is not None and [op[:3] for op in _operations(planned)] == actions:
            return planned  # the same operations: grouped as the planner groups them
        return points_from_actions(actions)
    if rank is not None and rank != stages[0].group_rank:
        raise BagualuError(f"{type(schedule).__name__}: the points of another rank are "
                           "known for multi-stage schedules only")
    stage, n = stages[0], schedule._n_microbatches
    # Not torch's pipeline_order here: the single-stage schedules run their own loops (and
    # the 1F1B table of torch 2.15 numbers the last rank's forwards from 1).
    if isinstance(schedule, S.Schedule1F1B):
        return list(one_f_one_b(n, stage.num_stages, stage.stage_index))
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
    not drop works (no ``.pop()`` in its source: torch 2.8 and later)."""
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


def _arg(args: Tuple[Any, ...], kwargs: Dict[str, Any], index: int, name: str,
         default: Any) -> Any:
    """A patched method's argument ``name`` (position ``index`` after the micro-batch)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


class PipelinedSchedule:
    """A torch pipelining schedule whose stages call bagualu; see ``wrap_schedule``."""

    def __init__(self, schedule: Any, points: Optional[Sequence[AnyPoint]] = None,
                 iterations: bool = True) -> None:
        stages, multi = _local_stages(schedule)
        _check_backward(schedule)
        self.schedule = schedule
        self.stages = stages
        self.stage = stages[0]
        self.chunks = len(stages)            # local stages: bagualu's chunks on this rank
        self.expected: List[AnyPoint] = list(points) if points is not None \
            else schedule_points(schedule)
        self.ops: List[Op] = _operations(self.expected)
        self.iterations = iterations
        self.points: List[AnyPoint] = []     # the points called in the current/last step
        self.plans = 0                       # how many of them returned a plan
        self.micro_batch: Optional[int] = None  # whose forward or backward is running
        self.chunk: Optional[int] = None     # ... of which local stage
        self.line: Optional[dict] = None     # the last end_iteration line
        self._cursor = 0
        self._active = False                 # inside step(): the patched methods call bagualu
        self._pending: Optional[ExitStack] = None
        self._orig: List[Tuple[Any, Any]] = []
        for chunk, stage in enumerate(stages):
            self._orig.append((stage.forward_one_chunk, stage.backward_one_chunk))
            stage.forward_one_chunk = self._forward_patch(chunk)
            stage.backward_one_chunk = self._backward_patch(chunk)
        self._orig_loss = schedule._maybe_compute_loss
        schedule._maybe_compute_loss = self._maybe_compute_loss

    # -- bagualu calls ----------------------------------------------------------------------
    def _label(self, kind: str, mb: int, chunk: int) -> str:
        return f"{kind}{mb}" if self.chunks == 1 else f"{kind}{mb} of chunk {chunk}"

    def _advance(self, kind: str, mb: int, chunk: int) -> None:
        want_op = self.ops[self._cursor] if self._cursor < len(self.ops) else None
        if want_op is None or want_op[:3] != (kind, mb, chunk):
            want = "nothing" if want_op is None else self._label(*want_op[:3])
            raise BagualuError(f"{type(self.schedule).__name__} ran {self._label(kind, mb, chunk)}"
                               f" where bagualu expected {want} (operation {self._cursor} of "
                               "its points); pass points= matching the schedule")
        _, _, _, index, first = want_op
        self._cursor += 1
        if first:
            point = self.expected[index]
            fc, bc = _chunks(point)
            plan = bagualu.step_point(*point[:3], forward_chunk=fc, backward_chunk=bc)
            if plan is not None:
                self.plans += 1
            self.points.append(point)

    def _close_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.close()
            finally:
                self.micro_batch = self.chunk = None

    # -- the patched methods ----------------------------------------------------------------
    def _forward_patch(self, chunk: int) -> Any:
        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            orig = self._orig[chunk][0]
            if not self._active:  # outside step() (eval(), shape inference): plain torch
                return orig(fwd_chunk_id, *args, **kwargs)
            self._close_pending()
            self._advance("F", fwd_chunk_id, chunk)
            stack = ExitStack()
            stack.enter_context(bagualu.forward(fwd_chunk_id, chunk=chunk))
            self.micro_batch, self.chunk = fwd_chunk_id, chunk
            try:
                out = orig(fwd_chunk_id, *args, **kwargs)
            except BaseException:
                self.micro_batch = self.chunk = None
                stack.__exit__(*sys.exc_info())
                raise
            if self.stages[chunk].is_last:
                self._pending = stack  # the loss belongs to this forward: closed after it
            else:
                stack.close()
                self.micro_batch = self.chunk = None
            return out
        return forward_one_chunk

    def _maybe_compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._orig_loss(*args, **kwargs)
        finally:
            self._close_pending()

    def _backward_patch(self, chunk: int) -> Any:
        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            orig = self._orig[chunk][1]
            if not self._active:
                return orig(bwd_chunk_id, *args, **kwargs)
            self._close_pending()
            if not _arg(args, kwargs, 1, "full_backward", True):
                raise BagualuError(
                    f"{type(self.schedule).__name__} ran the input part of the backward of "
                    f"micro-batch {bwd_chunk_id} alone (full_backward=False): bagualu plans "
                    "full backwards only")
            self._advance("B", bwd_chunk_id, chunk)
            self.micro_batch, self.chunk = bwd_chunk_id, chunk
            try:
                with bagualu.backward(bwd_chunk_id, chunk=chunk):
                    return orig(bwd_chunk_id, *args, **kwargs)
            finally:
                self.micro_batch = self.chunk = None
        return backward_one_chunk

    # -- the schedule's interface -----------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> Any:
        """One iteration of the schedule (``begin_iteration`` / ``end_iteration`` around it
        unless ``iterations=False``); the arguments are the schedule's ``step`` arguments
        (``target=``, ``losses=``, ...); returns what the schedule's step returns."""
        bagualu.current()  # raises BagualuError when bagualu is not installed
        self._cursor, self.points, self.plans = 0, [], 0
        if self.iterations:
            bagualu.begin_iteration()
        self._active = True
        try:
            out = self.schedule.step(*args, **kwargs)
        finally:
            self._active = False
            self._close_pending()
        if self._cursor != len(self.ops):
            raise BagualuError(f"{type(self.schedule).__name__} ran {self._cursor} of the "
                               f"{len(self.ops)} operations bagualu expected")
        if self.iterations:
            self.line = bagualu.end_iteration()
        return out

    def unwrap(self) -> Any:
        """Restores the stages' and the schedule's methods; returns the schedule."""
        self._close_pending()
        for stage in self.stages:
            stage.__dict__.pop("forward_one_chunk", None)
            stage.__dict__.pop("backward_one_chunk", None)
        self.schedule.__dict__.pop("_maybe_compute_loss", None)
        return self.schedule

    def __getattr__(self, name: str) -> Any:  # the schedule's other attributes
        schedule = self.__dict__.get("schedule")
        if schedule is None:
            raise AttributeError(name)
        return getattr(schedule, name)


def wrap_schedule(schedule: Any, points: Optional[Sequence[AnyPoint]] = None,
                  iterations: bool = True, fix_p2p: bool = True) -> PipelinedSchedule:
    """Makes a torch.distributed.pipelining schedule (Schedule1F1B, ScheduleGPipe,
    ScheduleInterleaved1F1B, ...; built with its ``PipelineStage``\\ s and ``loss_fn``) call
    bagualu at its scheduling points.

    ``points``: the (phase, forward_mb, backward_mb) order of one step (or, several stages
    per rank, (phase, f, b, forward_chunk, backward_chunk)) when bagualu should not derive it.
    ``iterations``: wrap every ``step()`` in begin_iteration / end_iteration. ``fix_p2p``:
    apply ``fix_batch_p2p()`` (needed on gloo before torch 2.8, a no-op after)."""
    if isinstance(schedule, PipelinedSchedule):
        raise BagualuError("the schedule is already wrapped")
    if fix_p2p:
        fix_batch_p2p()
    return PipelinedSchedule(schedule, points, iterations)
