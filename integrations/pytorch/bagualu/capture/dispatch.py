"""Real expert parallelism: a layer's load factor is the number of tokens this rank's experts
receive from the dispatch (an all-to-all over the EP group), over the balanced count.

``instrument(model, dispatch=...)`` names what hands this rank's experts their tokens, as
dotted paths relative to a planned block (fnmatch patterns, as ``ops``): a module of the block
(e.g. 'mlp.dispatch') or a method of an attribute that is no module (torchtitan's
'moe.routed_experts.token_dispatcher.dispatch'). The rows of the first tensor it returns are
the tokens received (the all-to-all's output: the sum of its output splits). The balanced
count is what the layer's router routed on this rank (its tokens x top-k): with the same
number of tokens on every EP rank (data-parallel micro-batches), that is the mean over the EP
ranks of what each rank's experts receive. A module named here is an operator of kind
``dispatch`` unless ``ops`` says otherwise.

Operators that run the dispatch (the dispatch module itself, the modules that contain it, the
block's own code) are never recomputed: a rerun would repeat the all-to-all on this rank only.
Their activations are kept instead (or offloaded, or cast, as planned).

Not thread-safe; hooks run on the training thread.
"""
from __future__ import annotations

import fnmatch
import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..discovery import find as discover
from ..errors import InstrumentError
from .host import Host

log = logging.getLogger("bagualu")


def patterns_of(dispatch: Any) -> List[str]:
    """``dispatch=`` as a list of patterns (one string or several); InstrumentError otherwise."""
    if isinstance(dispatch, str):
        dispatch = [dispatch]
    if not isinstance(dispatch, (list, tuple)) or not dispatch or \
            not all(isinstance(p, str) and p for p in dispatch):
        raise InstrumentError(f"dispatch={dispatch!r}: give a dotted path relative to a block "
                              "(e.g. 'mlp.dispatch') or a list of them")
    return list(dispatch)


def module_patterns(block: nn.Module, patterns: Sequence[str]) -> List[str]:
    """The patterns that name modules of ``block`` (they become ``dispatch`` operators)."""
    return [p for p in patterns
            if any(rel and fnmatch.fnmatchcase(rel, p) for rel, _ in block.named_modules())]


def holder_kinds(block: nn.Module, patterns: Sequence[str],
                 classify: Callable[[str, nn.Module, List[str]], Optional[str]]) -> Dict[str, str]:
    """Kinds for the modules that contain a dispatch of ``block`` (its MoE block, say): under
    real expert parallelism their own code runs on this rank's tokens (routing, the combine's
    weighted sum), not on the tokens its experts receive, so a kind that scales with the load
    (``classify``'s 'dispatch' for an MoE block) becomes 'other'."""
    from ..vocabulary import SCALING_KINDS
    mods = dict(block.named_modules())
    out: Dict[str, str] = {}
    for path, owner, _ in _targets(block, patterns):
        parts = path.split(".") if path else []
        # A dispatch module is the operator 'dispatch'; a dispatch method's holder contains it.
        for i in range(1, len(parts) + (0 if owner is None else 1)):
            rel = ".".join(parts[:i])
            m = mods[rel]
            if classify(rel, m, [c for c, _ in m.named_children()]) in SCALING_KINDS:
                out[rel] = "other"
    return out


def operators_with(model: nn.Module, layers: Any, ops: Optional[Dict[str, str]],
                   patterns: Sequence[str]) -> Dict[str, str]:
    """``ops`` (instrument's) for a model whose dispatch ``patterns`` name: the modules they
    name are ``dispatch`` operators and the modules containing one take a kind that does not
    scale with the load (holder_kinds), unless ``ops`` names them itself."""
    given = dict(ops or {})
    first = discover.find(model, layers, given)
    block = first.blocks[first.planned[0]]
    out = dict(given)
    for p in module_patterns(block, patterns):
        out.setdefault(p, "dispatch")
    for p, kind in holder_kinds(block, patterns, discover.classify).items():
        if not any(fnmatch.fnmatchcase(p, g) for g in given):
            out[p] = kind
    return out


def _targets(block: nn.Module, patterns: Sequence[str]) -> List[Tuple[str, Any, Any]]:
    """(module path, owner, what) per target in ``block``: ('mlp.dispatch', None, module) for
    a module, ('moe.routed_experts', holder, 'dispatch') for the method of a non-module
    attribute ``holder`` of the module at that path."""
    out: List[Tuple[str, Any, Any]] = []
    for p in patterns:
        mods = [(rel, m) for rel, m in block.named_modules() if rel and fnmatch.fnmatchcase(rel, p)]
        if mods:
            out.extend((rel, None, m) for rel, m in mods)
            continue
        owner_path, _, attr = p.rpartition(".")
        found = False
        for rel, m in block.named_modules():
            for name, value in vars(m).items():
                if name.startswith("_") or isinstance(value, nn.Module):
                    continue
                path = f"{rel}.{name}" if rel else name
                if owner_path and fnmatch.fnmatchcase(path, owner_path) and \
                        callable(getattr(value, attr, None)):
                    out.append((rel, value, attr))
                    found = True
        if not found:
            raise InstrumentError(
                f"dispatch: '{p}' names neither a module of the block "
                f"({type(block).__name__}) nor a method of one of its attributes (give the "
                "path relative to a block, e.g. 'mlp.dispatch' or "
                "'moe.routed_experts.token_dispatcher.dispatch')")
    return out


def rows(out: Any) -> Optional[int]:
    """The tokens a dispatch returned: the rows of the first tensor among its outputs."""
    for v in pytree.tree_leaves(out):
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    return None


class Dispatches:
    """The dispatch hooks of one instrumented model: ``slots[layer]`` is what the layer's
    router routed in the running forward (set by the router hook); each dispatch's output
    gives the layer's load factor to the host (deferred planning)."""

    def __init__(self, host: Host, patterns: Sequence[str]) -> None:
        self.host = host
        self.patterns = list(patterns)
        self.slots: Dict[int, int] = {}
        self.handles: List[Any] = []
        self.wrapped: List[Tuple[Any, str, bool, Any]] = []
        self.holders: Dict[int, Set[str]] = {}  # layer -> paths of the modules running it
        self.module_paths: Set[str] = set()  # the dispatch modules' paths within a block
        self._owners: Set[Tuple[int, str]] = set()
        self._warned = False

    def install(self, layer: int, block: nn.Module) -> None:
        """Hooks the dispatch targets of planned layer ``layer`` (its block ``block``)."""
        paths: Set[str] = set()
        for path, owner, what in _targets(block, self.patterns):
            if owner is None:
                self.handles.append(what.register_forward_hook(self._module_hook(layer)))
                self.module_paths.add(path)
            else:
                self._wrap(owner, what, layer)
            paths.add(path)
        self.holders[layer] = paths

    def runs_dispatch(self, layer: int, module_path: str) -> bool:
        """Whether the operator at ``module_path`` of the block ('' for the block's own code)
        runs a dispatch of ``layer``: it is one, or contains one."""
        for p in self.holders.get(layer, ()):
            if module_path == "" or p == module_path or p.startswith(module_path + "."):
                return True
        return False

    def _module_hook(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            self.observe(layer, out)
        return hook

    def _wrap(self, owner: Any, name: str, layer: int) -> None:
        if (id(owner), name) in self._owners:
            raise InstrumentError(
                f"dispatch: one {type(owner).__name__} object serves several layers; bagualu "
                f"cannot tell which layer's tokens its '{name}' dispatches")
        self._owners.add((id(owner), name))
        had = name in vars(owner)
        old = vars(owner).get(name)
        real = getattr(owner, name)

        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = real(*args, **kwargs)
            self.observe(layer, out)
            return out

        setattr(owner, name, wrapper)
        self.wrapped.append((owner, name, had, old))

    def observe(self, layer: int, out: Any) -> None:
        """A dispatch of ``layer`` returned ``out``: its load factor goes to the host."""
        host = self.host
        if not host.forwarding:
            return  # a recompute's rerun is no new routing
        got = rows(out)
        balanced = self.slots.pop(layer, None)
        if got is None or not balanced:
            if not self._warned:
                self._warned = True
                log.warning("bagualu: the dispatch of layer %d ran without %s; its load factor "
                            "is unknown (name the router with ops={'path': 'router'})", layer,
                            "a tensor output" if got is None else "a router before it")
            return
        if host.observe_router(layer, got / balanced):
            host.tracker.end_light()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for owner, name, had, old in reversed(self.wrapped):
            if had:
                setattr(owner, name, old)
            else:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
        self.wrapped.clear()
