"""Hooks that make an unmodified model's operators visible to the tracker.

For every operator module found by discovery/find.py: a forward pre-hook enters the
operator (capture/calls.py, shared with OpBlock layers: its scope, where its saved tensors and
the storages its own code makes belong, and the recompute call it opens when the micro-batch's
plan recomputes it) after noting which tensors it receives from the enclosing operator; a
forward hook leaves it (the operator becomes the producer of its outputs, the call closes). Each planned block marks its input (the layer's
input, always kept) and the tensors it receives from outside (rotary tables, masks: counted
outside the layers). Routers report the micro-batch's load factor for this process's experts
(deferred planning), and under ``expert_parallel`` this process computes only its own experts,
as one rank of expert parallelism would. Under real expert parallelism (``dispatch=``) the
load factor comes from the dispatch instead (capture/dispatch.py); the router gives the balanced
count.

The runtime is seen through the Host protocol (capture/host.py), so that this module does not
import runtime.py. Not thread-safe; hooks run on the training thread.
"""
from __future__ import annotations

import logging
import types
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..discovery.find import BLOCK_OP, Discovery, expert_count, top_k_of
from ..errors import InstrumentError
from ..vocabulary import OUTSIDE, Op
from .calls import OperatorCalls, tensors as _tensors
from .compiled import CompiledBlocks, eager_only
from . import stash
from .dispatch import Dispatches
from .host import Host
from .stash_notes import StashNotes, patch_compiled_experts

log = logging.getLogger("bagualu")
DEFERRABLE = frozenset({"dispatch", "combine", "expert_linear", "expert_activation",
                        "shared_linear", "shared_activation"})


class ExpertParallel:
    """Which experts this process computes, and the load factor a router's output implies.

    ``expert_parallel=N`` (rank ``ep_rank``): this process stands for one rank of N-way expert
    parallelism and bagualu skips the other ranks' experts (their tokens leave, as they would
    for another GPU). ``local_experts=[...]``: the model itself computes only these experts;
    bagualu only measures the load. Neither: every expert is local (load 1.0 always)."""

    def __init__(self, expert_parallel: Optional[int], ep_rank: int,
                 local_experts: Optional[Sequence[int]]) -> None:
        if expert_parallel is not None and local_experts is not None:
            raise InstrumentError("give expert_parallel= or local_experts=, not both")
        if expert_parallel is not None and (not isinstance(expert_parallel, int)
                                            or expert_parallel < 1):
            raise InstrumentError(f"expert_parallel must be a positive integer, got "
                                  f"{expert_parallel!r}")
        if expert_parallel is not None and not 0 <= ep_rank < expert_parallel:
            raise InstrumentError(f"ep_rank {ep_rank} outside 0..{expert_parallel - 1}")
        self.ep = expert_parallel
        self.rank = ep_rank
        self.local = None if local_experts is None else sorted(set(int(e) for e in local_experts))
        if self.local is not None and not self.local:
            raise InstrumentError("local_experts is empty")
        self.simulate = expert_parallel is not None and expert_parallel > 1

    def local_set(self, experts: int) -> List[int]:
        if self.local is not None:
            bad = [e for e in self.local if e >= experts or e < 0]
            if bad:
                raise InstrumentError(f"local_experts {bad} outside 0..{experts - 1}")
            return self.local
        if self.ep is None:
            return list(range(experts))
        if experts % self.ep:
            raise InstrumentError(f"expert_parallel={self.ep} does not divide the "
                                  f"{experts} experts")
        n = experts // self.ep
        return list(range(self.rank * n, (self.rank + 1) * n))


class _Router:
    """A router operator: its output gives the micro-batch's routing."""

    def __init__(self, experts: int, top_k: int, local: List[int]) -> None:
        self.experts = experts
        self.top_k = top_k
        self.local = torch.tensor(local, dtype=torch.long)
        self.fraction = len(local) / experts
        # Whether each expert index (and the 'no expert' index, ``experts``) is this rank's:
        # one gather per router call (about 13 us on 512 tokens x 8 routes here, where
        # torch.isin took 51), on the device of the indices (cached per device).
        table = torch.zeros(experts + 1, dtype=torch.bool)
        table[self.local] = True
        self._is_local = {table.device: table}

    def is_local(self, idx: torch.Tensor) -> torch.Tensor:
        """Per route in ``idx`` (expert indices, the 'no expert' index included): whether
        this rank holds its expert."""
        table = self._is_local.get(idx.device)
        if table is None:
            table = self._is_local[idx.device] = next(iter(self._is_local.values())).to(
                idx.device)
        return table[idx]

    def indices(self, out: Any) -> Tuple[Optional[torch.Tensor], int]:
        """The (tokens, k) expert indices in the router's output, and where (leaf index; -1
        when computed here from the logits)."""
        leaves = pytree.tree_leaves(out)
        for i, v in enumerate(leaves):
            if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 2 \
                    and v.shape[-1] == self.top_k:
                return v.reshape(-1, self.top_k), i
        for v in leaves:
            if isinstance(v, torch.Tensor) and v.is_floating_point() and \
                    v.shape[-1] == self.experts:
                logits = v.detach().reshape(-1, self.experts)
                return logits.topk(self.top_k, dim=-1).indices, -1
        return None, -1

    def load(self, idx: torch.Tensor) -> float:
        """The routes to this rank's experts against a balanced share of them (1: balanced).
        Where the rank holds every expert every route is local: 1 with no tensor work."""
        if self.fraction == 1.0:
            return 1.0
        local = self.is_local(idx)
        balanced = idx.shape[0] * self.top_k * self.fraction
        return float(local.sum()) / balanced if balanced > 0 else 1.0

    def restrict(self, out: Any) -> Any:
        """Expert parallelism on one process: routes of other ranks' experts become the
        experts' 'no expert' index (the experts count), which HF experts skip."""
        idx, where = self.indices(out)
        if idx is None or where < 0:
            return None
        keep = self.is_local(idx)
        new = idx.masked_fill(~keep, self.experts)
        leaves, spec = pytree.tree_flatten(out)
        leaves[where] = new
        return pytree.tree_unflatten(leaves, spec)


class AutoLayers:
    """The hooks of one instrumented unmodified model (see the module docstring)."""

    def __init__(self, rt: Host, model: nn.Module, found: Discovery,
                 ep: ExpertParallel, dispatch: Optional[Dispatches] = None,
                 compiled_per_op: bool = True) -> None:
        self.rt = rt
        self.found = found
        self.ep = ep
        self.dispatch = dispatch
        self.handles: List[Any] = []
        self.patched: List[Tuple[nn.Module, Any]] = []
        self.restore_experts: Optional[Tuple[nn.Module, str]] = None
        self.layers = len(found.planned)
        self.calls = OperatorCalls(rt, self.layers)
        self.routers: Dict[nn.Module, _Router] = {}
        # Compiled blocks planned per operator: what each stash notes (the routers' load, the
        # producers, the counts of stats()["compiled"]).
        self.stashes = StashNotes(rt, found, self.calls, dispatch)
        groups = getattr(getattr(rt, "settings", None), "compiled_recompute", None)
        if compiled_per_op and groups is not None:
            self.stashes.set_groups(groups)  # InstrumentError naming bad groups
        # Whether a router's load can differ from 1 (set at install): some experts are other
        # ranks' (simulated or given local_experts) or an expert dispatch measures it. Where
        # it cannot, no deferred plan can follow a router, and the operators containing one
        # open no recompute call for it.
        self.load_varies = False
        self.compiled = CompiledBlocks(model, found, self._block_hooks, self._drop_inner,
                                       ep.simulate,
                                       self.stashes.on_stash if compiled_per_op else None,
                                       self.stashes.variant_of if self.stashes.groups
                                       else None, self.stashes.note_tagged)
        try:
            self.compiled.refuse_cuda_graphs()  # blocks compiled before instrument
            self._install(model)
        except BaseException:
            self.remove()
            raise

    # -- installation -----------------------------------------------------------------------
    def _install(self, model: nn.Module) -> None:
        found = self.found
        for li, sites in enumerate(found.sites):
            block = found.blocks[found.planned[li]]
            descendants_of: Dict[nn.Module, Set[nn.Module]] = {
                s.module: set(s.module.modules()) for s in sites}
            router_mods = [s.module for s in sites if s.kind == "router"]
            for s in sites:
                op = Op(s.name, s.kind, li)
                defer = s.kind in DEFERRABLE and any(
                    r in descendants_of[s.module] for r in router_mods)
                if s.path == "":
                    pre = self._block_pre(op, li)
                    post = self._block_post(op, li == self.layers - 1)
                else:
                    pre = self._pre(op, s.module, defer)
                    post = self._post(op)
                self.handles.append(s.module.register_forward_pre_hook(eager_only(pre),
                                                                       with_kwargs=True))
                self.handles.append(s.module.register_forward_hook(eager_only(post)))
                if s.kind == "router":
                    self._add_router(block, s.path, s.module)
                    self.stashes.routers[s.name] = self.routers[s.module]
                    self.stashes.router_layers.add(li)
            if self.dispatch is not None:
                self.dispatch.install(li, block)
                self.calls.no_replay.update(s.name for s in sites
                                            if self.dispatch.runs_dispatch(li, s.path))
        self.load_varies = self.dispatch is not None or any(
            r.fraction < 1.0 for r in self.routers.values())
        self.stashes.load_varies = self.load_varies
        if self.ep.simulate:
            self._patch_expert_lists()
            self.restore_experts = _eager_experts(model)

    def _add_router(self, block: nn.Module, path: str, module: nn.Module) -> None:
        parent = block
        parts = path.split(".")
        for p in parts[:-1]:
            parent = getattr(parent, p) if not p.isdigit() else parent[int(p)]
        experts = expert_count(module) or expert_count(parent)
        k = top_k_of(module) or top_k_of(parent)
        if experts is None or k is None:
            raise InstrumentError(
                f"router '{path}' ({type(module).__name__}): cannot tell the number of experts "
                "or top-k (looked for num_experts/n_routed_experts/num_local_experts and "
                "top_k/num_experts_per_tok on it and its parent); name it otherwise with "
                f"ops={{'{path}': 'linear'}}")
        r = _Router(experts, k, self.ep.local_set(experts))
        self.routers[module] = r
        # Experts held as an nn.ModuleList (transformers 4.x) return zeros for other ranks
        # (_patch_expert_lists), and their routing code may not take a 'no expert' index
        # (DeepSeek-V3's one_hot): the routes stay as they are there.
        if self.ep.simulate and not _has_expert_list(parent):
            self.handles.append(module.register_forward_hook(eager_only(self._restrict(r))))

    def _patch_expert_lists(self) -> None:
        """Under simulated expert parallelism, experts held as an nn.ModuleList (transformers
        4.x) of other ranks return zeros: their tokens are another GPU's work."""
        for li, sites in enumerate(self.found.sites):
            block = self.found.blocks[self.found.planned[li]]
            for path, m in block.named_modules():
                last = path.rsplit(".", 1)[-1].lower()
                if not isinstance(m, nn.ModuleList) or "expert" not in last or "shared" in last:
                    continue
                local = set(self.ep.local_set(len(m)))
                for i, expert in enumerate(m):
                    if i in local:
                        continue
                    old = expert.__dict__.get("forward")
                    expert.forward = types.MethodType(_zeros_forward, expert)
                    self.patched.append((expert, old))

    def _drop_inner(self) -> None:
        """The blocks are compiled: their operator hooks would run inside the compiled region
        (capture/compiled.py enters each block from outside it). A dispatch inside them is
        not seen either, and the block that runs it is never recomputed (its all-to-all)."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        stash.name_dispatches([])  # an earlier install's
        if self.dispatch is not None:
            modules = sorted(self.dispatch.module_paths)
            self.dispatch.remove()
            self.calls.no_replay.add(BLOCK_OP)
            if self.compiled.per_op and modules:
                stash.name_dispatches(modules)  # read where their received rows are stashed
            elif self.compiled.per_op:
                log.warning("bagualu: the planned blocks are compiled: a dispatch (dispatch=) "
                            "that is a method, not a module of the block, is not seen inside "
                            "them (a compiled graph names only modules), and the load factor "
                            "stays the plan's; name a module that runs the all-to-all")
            else:
                log.warning("bagualu: the planned blocks are compiled, each one operator: the "
                            "dispatch (dispatch=) inside them is not seen, and the load factor "
                            "stays the plan's (install(compiled_operators='operators') reads "
                            "it)")
        if self.ep.simulate:
            patch_compiled_experts(self.found, self.ep, self.patched)

    def _block_hooks(self, layer: int) -> Tuple[Any, Any]:
        """The (pre, post) hooks of layer ``layer``'s block operator."""
        op = Op(BLOCK_OP, self.found.kinds[BLOCK_OP], layer)
        return self._block_pre(op, layer), self._block_post(op, layer == self.layers - 1)

    def before_forward(self) -> bool:
        """Before each forward: True when the operators of the layers changed (the planned
        blocks are compiled; each is one operator now, see ``layer_ops``)."""
        self.stashes.begin_forward()
        if not self.compiled.refresh():
            return False
        self.calls.fastest = {}  # a compiled block's first call compiles it
        return True

    def layer_ops(self) -> Dict[int, List[Op]]:
        """The operators of each planned layer: the discovered ones, or the block alone when
        the blocks are compiled as one operator each."""
        one = self.compiled.active and not self.compiled.per_op
        names = [BLOCK_OP] if one else self.found.op_names
        return {li: [Op(n, self.found.kinds[n], li) for n in names]
                for li in range(self.layers)}

    def compiled_stats(self) -> Dict[str, Any]:
        """stats()["compiled"]: how compiled blocks are planned (StashNotes.stats)."""
        return self.stashes.stats(self.compiled.per_op)

    def compiled_op_times(self, op_ms: Dict[str, float],
                          produced: Dict[str, int]) -> Dict[str, float]:
        """The operators' forward times: per operator in compiled blocks, the block's shared by
        the bytes each saves (StashNotes.op_times); else as measured."""
        return self.stashes.op_times(op_ms, produced) if self.compiled.per_op else op_ms

    def remove(self) -> None:
        self.compiled.remove()
        for h in self.handles:
            h.remove()
        self.handles.clear()
        if self.dispatch is not None:
            self.dispatch.remove()
        for m, old in self.patched:
            if old is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = old
        self.patched.clear()
        if self.restore_experts is not None:
            model, impl = self.restore_experts
            model.set_experts_implementation(impl)
            self.restore_experts = None

    # -- hooks ------------------------------------------------------------------------------
    def _pre(self, op: Op, module: nn.Module, defer: bool) -> Any:
        def hook(m: nn.Module, args: Any, kwargs: Any) -> None:
            rt = self.rt
            if not rt.forwarding:
                return None
            t = rt.tracker
            if t.light is None and t.scope:
                # Tensors the enclosing operator's own code made are its products.
                enclosing = t.scope[-1]
                call = t.calls[-1] if t.calls and t.calls[-1].op is enclosing else None
                t.note_output((args, kwargs), enclosing, overwrite=False, call=call)
            self.calls.enter(op, m, args, kwargs, defer and self.load_varies)
            return None
        return hook

    def _block_pre(self, op: Op, layer: int) -> Any:
        inp = Op("input", "other", layer)

        def hook(m: nn.Module, args: Any, kwargs: Any) -> None:
            rt = self.rt
            if not rt.forwarding:
                return None
            t = rt.tracker
            tensors = _tensors((args, kwargs))
            if tensors:
                first = tensors[0]
                if t.light is None:
                    t.note_output(first, inp)  # the layer's input: always kept
                for v in tensors[1:]:
                    if v.numel() > 0 and v.untyped_storage().data_ptr() != \
                            first.untyped_storage().data_ptr():
                        t.note_external(v)
                        if t.light is None:
                            t.note_output(v, OUTSIDE, overwrite=False)
            if tensors and self.dispatch is not None and self.compiled.per_op:
                self.stashes.balance(layer, tensors[0])
            self.calls.enter(op, m, args, kwargs, False)
            return None
        return hook

    def _post(self, op: Op) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            rt = self.rt
            if not rt.forwarding or not self.calls.leave(op, out):
                return None
            r = self.routers.get(m)
            if r is not None:
                idx, _ = r.indices(out)
                if idx is None:
                    return None
                if self.dispatch is not None:  # the dispatch gives the load; this, the balance
                    self.dispatch.slots[op.layer] = int(idx.numel())
                elif rt.observe_router(op.layer, r.load(idx)):
                    rt.tracker.end_light()
            return None
        return hook

    def _block_post(self, op: Op, last: bool) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            rt = self.rt
            if not rt.forwarding:
                return None
            stack = self.calls.stack
            call = stack[-1][1] if stack and stack[-1][0] is op else None
            if not self.calls.leave(op, out):
                return None
            if call is not None and self.compiled.per_op:
                _rerun_before_backward(call, out)
            if self.compiled.per_op:
                self.stashes.check_load_read(op.layer)
            if last and rt.tracker.light is None:
                rt.tracker.note_output(out, OUTSIDE)  # leaves the planned layers
            return None
        return hook

    def _restrict(self, r: _Router) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> Any:
            return r.restrict(out)
        return hook

    # -- after the capture ------------------------------------------------------------------
    @property
    def readers(self) -> Dict[int, Set[str]]:
        """Storage pointer -> the operators of layer 0 whose calls read it (capture)."""
        return self.calls.readers

    def op_order(self, names: Sequence[str]) -> List[str]:
        return self.calls.op_order(names)


def _rerun_before_backward(call: Any, out: Any) -> None:
    """A compiled block recomputed whole, its tensors stashed (capture/stash.py): the rerun
    must run before the block's compiled backward starts, since the unstash that would start
    it runs inside that backward, where AOTAutograd disables saved-tensor hooks (a rerun there
    saves nothing through them). A hook on the block's output gradient runs it first."""
    for v in pytree.tree_leaves(out):
        if isinstance(v, torch.Tensor) and v.requires_grad:
            def rerun(grad: torch.Tensor) -> None:
                if not call.done and call.pending:
                    call.regenerate()
            v.register_hook(rerun)
            return


def _has_expert_list(module: nn.Module) -> bool:
    """Whether ``module`` holds its routed experts as an nn.ModuleList child."""
    return any(isinstance(m, nn.ModuleList) and "expert" in n.lower() and "shared" not in n.lower()
               for n, m in module.named_children())


def _eager_experts(model: nn.Module) -> Optional[Tuple[nn.Module, str]]:
    """transformers 5 runs stacked experts through grouped_mm by default, which computes every
    routed slot (other EP ranks' slots with weight zero), so skipping them would save no
    memory; its eager loop skips them. Simulated expert parallelism switches to it; returns
    what to restore at uninstall."""
    config = getattr(model, "config", None)
    current = getattr(config, "_experts_implementation", None)
    setter = getattr(model, "set_experts_implementation", None)
    if current in (None, "eager") or setter is None:
        return None
    setter("eager")
    log.info("bagualu: expert_parallel: %s's experts run transformers' eager loop (was %s), "
             "which skips the other ranks' experts", type(model).__name__, current)
    return model, current


def _zeros_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros_like(x)
