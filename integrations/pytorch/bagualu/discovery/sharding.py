"""How a model is wrapped for data parallelism, and what that means for its saved tensors:
FSDP2 (``fully_shard``) modules, their parameters in sharded and all-gathered form, and the
legacy wrappers bagualu refuses.

FSDP2 registers each managed parameter on its module as a sharded ``DTensor`` between
forwards; its pre-forward hook all-gathers the layer's parameters into unsharded
``nn.Parameter`` objects, sets those on the modules, and its post-forward hook frees their
storage (resized to 0 under ``reshard_after_forward=True``) and sets the shards back; the
backward gathers them again before the layer's gradients are computed. Autograd saves those
unsharded parameters (or views of them, e.g. a weight's transpose), and they are never
activations: ``is_parameter`` recognises them at pack time by type, not by storage pointer
(FSDP2 reallocates the storage at every all-gather, so a pointer seen at instrument means
nothing later).

A recompute rerun of a module needs the module's unsharded parameters: ``Sharding.ready``
says whether FSDP2 holds them now (a scheduled rerun that comes too early is skipped and
happens on demand, inside the layer's own backward, after FSDP2's pre-backward all-gather).

Pure inspection: nothing here installs a hook. Not thread-safe; used by the training thread.
"""
from __future__ import annotations

from typing import Dict, List, Set, Tuple

import torch
from torch import nn

from ..errors import InstrumentError


def _dtensor_type() -> type:
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except ImportError:  # a torch built without distributed
        return type(None)


def _fsdp_module_type() -> type:
    try:
        from torch.distributed.fsdp import FSDPModule
        return FSDPModule
    except ImportError:
        return type(None)


_DTENSOR = _dtensor_type()
_FSDP_MODULE = _fsdp_module_type()
_PARAMETER = nn.Parameter
_TENSOR = torch.Tensor


def is_parameter(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a parameter or a view of one: a model's own parameters, and
    FSDP2's all-gathered unsharded parameters (nn.Parameter objects whose storage FSDP2 frees
    and gathers again), whose saved forms are the parameter or a view with it as ``_base``."""
    # A plain tensor is no parameter (Parameter's isinstance is Python-level: only tensor
    # subclasses, Parameter itself and torch's _is_param marker on wrapped subclasses need it).
    if type(t) is not _TENSOR and isinstance(t, _PARAMETER):
        return True
    base = t._base  # None for most saved tensors
    return base is not None and (type(base) is not _TENSOR and isinstance(base, _PARAMETER))


def local_storage_ptrs(model: nn.Module) -> Set[int]:
    """Storage pointers of the model's parameters and buffers (a DTensor's: its local
    shard's): saved, but not activations."""
    out: Set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if isinstance(t, _DTENSOR):
            t = t.to_local()
        try:
            st = t.untyped_storage()
            if st.nbytes() > 0:
                out.add(st.data_ptr())
        except RuntimeError:  # a storage-less tensor (meta, or freed by its owner)
            continue
    return out


def refuse_legacy_wrappers(model: nn.Module) -> None:
    """InstrumentError for the legacy FullyShardedDataParallel wrapper, naming what to use.

    FSDP1 flattens each unit's parameters into one FlatParameter and swaps module parameters
    for views of it around every forward and backward; bagualu supports its successor,
    ``fully_shard`` (FSDP2), instead. DistributedDataParallel works as it is (its gradient
    hooks do not touch saved activations)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
    except ImportError:
        return
    for name, m in model.named_modules():
        if isinstance(m, FSDP1):
            where = f"'{name}'" if name else "the model"
            raise InstrumentError(
                f"{where} is wrapped in the legacy torch.distributed.fsdp."
                "FullyShardedDataParallel (FSDP1), which bagualu does not plan: shard the "
                "model with torch.distributed.fsdp.fully_shard (FSDP2) instead, each "
                "transformer block and then the root (docs/pytorch.md, 'FSDP2')")


class Sharding:
    """The FSDP2 modules of one instrumented model (none: everything is always ready)."""

    def __init__(self, model: nn.Module) -> None:
        self.fsdp_modules: List[nn.Module] = [m for m in model.modules()
                                              if isinstance(m, _FSDP_MODULE)]
        # (owner module, parameter name) of every parameter FSDP2 manages: sharded DTensors
        # between forwards (instrument runs then).
        self.managed: Set[Tuple[int, str]] = set()
        for m in (model.modules() if self.fsdp_modules else ()):
            for n, p in m.named_parameters(recurse=False):
                if isinstance(p, _DTENSOR):
                    self.managed.add((id(m), n))
        self._cache: Dict[int, Tuple[List[Tuple[nn.Module, str]], bool]] = {}

    @property
    def active(self) -> bool:
        return bool(self.fsdp_modules)

    def _facts(self, module: nn.Module) -> Tuple[List[Tuple[nn.Module, str]], bool]:
        hit = self._cache.get(id(module))
        if hit is None:
            owned = [(m, n) for m in module.modules() for n in list(m._parameters)
                     if (id(m), n) in self.managed]
            has_fsdp = any(isinstance(m, _FSDP_MODULE) for m in module.modules())
            hit = self._cache[id(module)] = (owned, has_fsdp)
        return hit

    def ready(self, module: nn.Module, scheduled: bool) -> bool:
        """Whether ``module`` can be rerun now: FSDP2 holds its parameters unsharded, and
        (``scheduled``: a rerun ahead of the backward that needs it) it runs no FSDP2 module,
        whose forward hooks would all-gather or reshard outside FSDP2's own order."""
        if not self.fsdp_modules:
            return True
        owned, has_fsdp = self._facts(module)
        if scheduled and has_fsdp:
            return False
        return not any(isinstance(m._parameters.get(n), _DTENSOR) for m, n in owned)
