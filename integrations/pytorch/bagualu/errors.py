"""Exceptions raised by the bagualu package."""
from __future__ import annotations


class BagualuError(RuntimeError):
    """Base class of every error bagualu raises."""


class LibraryNotFound(BagualuError):
    """A shared library of the project (libbgl_planner.so, libbgl_alloc.so) is missing."""


class PlannerError(BagualuError):
    """The planner rejected a model or a request; the message is the planner's."""


class InstallError(BagualuError):
    """bagualu.install() cannot do what was asked (e.g. CUDA was already initialised)."""


class PolicyError(BagualuError, ValueError):
    """An unknown or unusable activation policy was requested."""


class InstrumentError(BagualuError):
    """A model cannot be instrumented (e.g. it has no recognised operators)."""


class OutOfMemoryError(BagualuError, MemoryError):
    """The (simulated) device ran out of activation memory; the allocator's message follows."""


class NotReady(BagualuError):
    """A scheduled recompute cannot run yet (FSDP2 holds its module's parameters sharded):
    the enforcer skips the piece and the data is regenerated on demand."""
