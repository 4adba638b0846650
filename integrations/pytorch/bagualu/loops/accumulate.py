"""Gradient accumulation over micro-batches without pipeline parallelism, with bagualu.

One process runs every micro-batch's forward then its backward (the gradients add up), and
bagualu plans each forward at the planner's points of a single stage
(``install(pipeline_stages=1, micro_batches=n)``): ``("steady", mb, None)`` before the forward
of ``mb``, ``("steady", None, mb)`` before its backward, the points of
``bagualu.schedule.one_f_one_b(n, 1, 0)``.

A loop::

    bagualu.install(capacity="2GiB", policy="bagualu", pipeline_stages=1, micro_batches=n)
    bagualu.instrument(model)
    for step in range(steps):
        loop = bagualu.micro_batches(n)             # begin_iteration() ... end_iteration()
        for mb in loop:                             # mb is an int: 0, 1, ..., n-1
            with mb.forward():
                loss = loss_fn(model(x[mb]), y[mb]) / n
            with mb.backward():
                loss.backward()
        optimizer.step(); optimizer.zero_grad()
        print(loop.line)                            # the iteration's end_iteration() line

or a function::

    losses = bagualu.accumulate_gradients(lambda mb: loss_fn(model(x[mb]), y[mb]) / n, n)

Each micro-batch's forward must come before its backward, and its backward before the next
micro-batch's forward (the single-stage order the planner plans for); anything else raises
``BagualuError``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional

from .. import api as bagualu
from ..errors import BagualuError

__all__ = ["micro_batches", "accumulate_gradients", "MicroBatches", "MicroBatch"]


class MicroBatch(int):
    """A micro-batch index (an ``int``: ``x[mb]`` works) with its bagualu contexts:
    ``forward()`` (step point, then ``bagualu.forward(mb)``) and ``backward()`` (step point,
    then ``bagualu.backward(mb)``)."""

    loop: "MicroBatches"

    def __new__(cls, index: int, loop: "MicroBatches") -> "MicroBatch":
        mb = super().__new__(cls, index)
        mb.loop = loop
        return mb

    @contextmanager
    def forward(self) -> Iterator[None]:
        """The forward of this micro-batch (and its loss): planned, then captured."""
        self.loop._enter(int(self), "forward")
        if bagualu.step_point("steady", int(self), None) is not None:
            self.loop.plans += 1
        with bagualu.forward(int(self)):
            yield
        self.loop._done(int(self), "forward")

    @contextmanager
    def backward(self) -> Iterator[None]:
        """The backward of this micro-batch (``loss.backward()`` inside)."""
        self.loop._enter(int(self), "backward")
        bagualu.step_point("steady", None, int(self))
        with bagualu.backward(int(self)):
            yield
        self.loop._done(int(self), "backward")


class MicroBatches:
    """The micro-batches of one training step (see the module's docstring): iterating yields
    ``MicroBatch`` 0..n-1 between ``begin_iteration()`` and ``end_iteration()``
    (``iterations=False``: the caller's). After the loop: ``line`` (the end_iteration line),
    ``plans`` (how many forwards got a plan)."""

    def __init__(self, n: int, iterations: bool = True) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BagualuError(f"micro_batches: a positive number of micro-batches, got {n!r}")
        self.n = n
        self.iterations = iterations
        self.line: Optional[dict] = None
        self.plans = 0
        self._state: List[str] = ["new"] * n  # new -> forward -> forwarded -> ... -> done
        self._started = False

    def _enter(self, mb: int, what: str) -> None:
        want = "new" if what == "forward" else "forwarded"
        if self._state[mb] != want:
            done = {"new": "nothing yet", "forward": "its forward is running",
                    "forwarded": "its forward ran", "backward": "its backward is running",
                    "done": "its forward and backward ran"}[self._state[mb]]
            raise BagualuError(f"micro-batch {mb}: {what}() where {done}; each micro-batch "
                               "runs forward() once, then backward() once")
        if what == "forward":
            busy = [i for i, s in enumerate(self._state) if s not in ("new", "done")]
            if busy:
                raise BagualuError(f"micro-batch {mb}: forward() before the backward() of "
                                   f"micro-batch {busy[0]} (without pipeline parallelism each "
                                   "micro-batch's backward comes before the next forward)")
        self._state[mb] = what

    def _done(self, mb: int, what: str) -> None:
        self._state[mb] = "forwarded" if what == "forward" else "done"

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[MicroBatch]:
        if self._started:
            raise BagualuError("a MicroBatches loop runs once; call bagualu.micro_batches(n) "
                               "for every training step")
        self._started = True
        bagualu.current()  # raises BagualuError when bagualu is not installed
        if self.iterations:
            bagualu.begin_iteration()
        for i in range(self.n):
            yield MicroBatch(i, self)
            if self._state[i] != "done":
                raise BagualuError(f"micro-batch {i}: the loop moved on without its "
                                   f"{'forward() and ' if self._state[i] == 'new' else ''}"
                                   "backward()")
        if self.iterations:
            self.line = bagualu.end_iteration()


def micro_batches(n: int, iterations: bool = True) -> MicroBatches:
    """The micro-batches of one gradient-accumulation step: ``for mb in
    bagualu.micro_batches(n): with mb.forward(): ...; with mb.backward(): ...``."""
    return MicroBatches(n, iterations)


def accumulate_gradients(loss_of: Callable[[int], Any], n: int,
                         iterations: bool = True) -> List[Any]:
    """One step of gradient accumulation: for every micro-batch ``mb`` in 0..n-1,
    ``loss = loss_of(mb)`` under ``mb.forward()`` and ``loss.backward()`` under
    ``mb.backward()``. Returns the detached losses (the optimizer step is the caller's).
    ``loss_of`` returns a scalar tensor (divide by ``n`` there for the mean)."""
    losses: List[Any] = []
    for mb in micro_batches(n, iterations):
        with mb.forward():
            loss = loss_of(mb)
        with mb.backward():
            loss.backward()
        losses.append(loss.detach())
    return losses
