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
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from ..discovery.find import BLOCK_OP, Discovery, expert_count, top_k_of
from ..errors import InstrumentError
from ..vocabulary import OUTSIDE, RECOMPUTE, Op
from .calls import OperatorCalls, tensors as _tensors
from .compiled import CompiledBlocks, eager_only
from .dispatch import Dispatches
from .host import Host

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
        local = torch.isin(idx, self.local.to(idx.device))
        balanced = idx.shape[0] * self.top_k * self.fraction
        return float(local.sum()) / balanced if balanced > 0 else 1.0

    def restrict(self, out: Any) -> Any:
        """Expert parallelism on one process: routes of other ranks' experts become the
        experts' 'no expert' index (the experts count), which HF experts skip."""
        idx, where = self.indices(out)
        if idx is None or where < 0:
            return None
        keep = torch.isin(idx, self.local.to(idx.device))
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
        self.router_ops: Dict[str, _Router] = {}  # operator name -> its router (compiled)
        self.loads_read: Set[int] = set()  # compiled: layers whose load this forward read
        self.router_layers: Set[int] = set()
        # Compiled (stats): the strategies of every planned operator when the forward's first
        # router load was read ((layer, name) -> strategy), the layers whose router then
        # downgraded the plan (forward, micro-batch -> layers), the operators stashed after
        # that under another strategy (forward, micro-batch -> "L<layer>.<name>"), and the
        # tensors of forwards without a downgrade stashed under another strategy (none).
        self.forwards = 0
        self.plan_at_router: Dict[Tuple[int, str], str] = {}
        self.downgrades: Dict[Tuple[int, int], List[int]] = {}
        self.changed: Dict[Tuple[int, int], Set[str]] = {}
        self.stray = 0
        # Whether a router's load can differ from 1 (set at install): some experts are other
        # ranks' (simulated or given local_experts) or an expert dispatch measures it. Where
        # it cannot, no deferred plan can follow a router, and the operators containing one
        # open no recompute call for it.
        self.load_varies = False
        # Compiled per operator: (micro-batch, layer) -> the strategies its stashed tensors'
        # operators had (stats: a block whose operators were placed differently), and the
        # number of tensors stashed.
        self.placements: Dict[Tuple[int, int], Set[str]] = {}
        self.stashed = 0
        self.compiled = CompiledBlocks(model, found, self._block_hooks, self._drop_inner,
                                       ep.simulate,
                                       self._on_stash if compiled_per_op else None)
        try:
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
                    self.router_ops[s.name] = self.routers[s.module]
                    self.router_layers.add(li)
            if self.dispatch is not None:
                self.dispatch.install(li, block)
                self.calls.no_replay.update(s.name for s in sites
                                            if self.dispatch.runs_dispatch(li, s.path))
        self.load_varies = self.dispatch is not None or any(
            r.fraction < 1.0 for r in self.routers.values())
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
        if self.dispatch is not None:
            self.dispatch.remove()
            self.calls.no_replay.add(BLOCK_OP)
            log.warning("bagualu: the planned blocks are compiled: the dispatch (dispatch=) "
                        "inside them is not seen, and the load factor stays the plan's (issue "
                        "41: not built for real expert parallelism)")
        if self.ep.simulate:
            self._patch_compiled_experts()

    def _patch_compiled_experts(self) -> None:
        """Simulated expert parallelism in compiled blocks: each block's stacked experts
        (transformers 5) compute the routes of this rank's experts only, one expert after the
        other (``_local_experts_forward``: the eager loop's arithmetic, over a fixed list of
        experts instead of the data-dependent list of those hit), so that the tokens each
        expert saves are data-dependent sizes in the compiled graph (dynamo's unbacked sizes:
        no recompile per load) and the saved bytes follow the load as in eager."""
        for li in range(self.layers):
            block = self.found.blocks[self.found.planned[li]]
            done = False
            for path, m in block.named_modules():
                if not all(hasattr(m, a) for a in ("gate_up_proj", "down_proj", "act_fn",
                                                   "num_experts")):
                    continue
                if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or \
                        not getattr(m, "is_concatenated", True) or \
                        not getattr(m, "has_gate", True):
                    break
                m._bagualu_local = self.ep.local_set(int(m.num_experts))
                self.patched.append((m, m.__dict__.get("forward")))
                m.forward = types.MethodType(_local_experts_forward, m)
                done = True
            if not done:
                raise InstrumentError(
                    f"instrument(expert_parallel={self.ep.ep}) with compiled blocks: block "
                    f"{self.found.planned[li]} of {self.found.layers_path} has no stacked experts "
                    "bagualu can restrict inside a compiled graph (transformers 5's "
                    "gate_up_proj/down_proj experts, no bias); use real expert parallelism "
                    "(dispatch=), local_experts= for a model that computes only its own "
                    "experts, or leave the blocks uncompiled")

    def _block_hooks(self, layer: int) -> Tuple[Any, Any]:
        """The (pre, post) hooks of layer ``layer``'s block operator."""
        op = Op(BLOCK_OP, self.found.kinds[BLOCK_OP], layer)
        return self._block_pre(op, layer), self._block_post(op, layer == self.layers - 1)

    def before_forward(self) -> bool:
        """Before each forward: True when the operators of the layers changed (the planned
        blocks are compiled; each is one operator now, see ``layer_ops``)."""
        self.loads_read.clear()
        self.forwards += 1
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

    def _on_stash(self, layer: int) -> Any:
        """What a compiled block of layer ``layer`` does before its saved tensor is packed
        (capture/stash.py): reads the router's load from its saved expert indices (deferred
        planning, as the router hook does in eager), names the operator that computed it as
        its producer (unless the whole block is recomputed: its call owns everything) and, in
        the capture, orders the operators by their first saved tensor."""
        ops = {n: Op(n, self.found.kinds[n], layer) for n in self.found.op_names}

        def note(t: torch.Tensor, name: Optional[str]) -> None:
            rt = self.rt
            tr = rt.tracker
            if name is None or not rt.forwarding:
                return
            op = ops.get(name)
            if op is None:
                return
            router = self.router_ops.get(name) if self.load_varies else None
            if router is not None and layer not in self.loads_read and \
                    not t.is_floating_point() and t.dim() >= 1 and \
                    t.shape[-1] == router.top_k and self.dispatch is None:
                mb = tr.micro_batch
                if not self.loads_read:
                    self.plan_at_router = {
                        (li, n): rt.strategy_of(Op(n, self.found.kinds[n], li), mb)
                        for li in range(self.layers) for n in self.found.op_names}
                self.loads_read.add(layer)
                # The router's saved expert indices: its load, read here (the stash runs in
                # eager after the compiled forward computed them). A downgrade changes the
                # placements of the block's tensors stashed after this one; recompute cannot
                # start inside a compiled block (recompute_allowed), so it applies to later
                # blocks' whole-block operator only.
                if rt.observe_router(layer, router.load(t.reshape(-1, router.top_k))):
                    self.downgrades.setdefault((self.forwards, mb), []).append(layer)
                    if tr.light is not None:
                        tr.end_light()
            if tr.light is not None:
                return
            if tr.calls and tr.calls[-1].op.name == BLOCK_OP:
                return
            mb = tr.micro_batch
            strategy = rt.strategy_of(op, mb)
            if strategy == RECOMPUTE:  # cannot be rerun alone: its block's strategy holds it
                if name not in self.calls.warned:
                    self.calls.warned.add(name)
                    log.warning("bagualu: %s is inside a compiled block and cannot be "
                                "recomputed alone; its tensors follow the block's strategy "
                                "(force 'block': 'recompute' to rerun whole blocks, or "
                                "install(compiled_operators='block'))", name)
                return
            if rt.capturing:
                self.calls.order.setdefault(name, len(self.calls.order))
            tr.note_output(t, op)
            self.stashed += 1
            self.placements.setdefault((mb, layer), set()).add(strategy)
            was = self.plan_at_router.get((layer, name)) if self.loads_read else None
            if was is not None and was != strategy:
                if (self.forwards, mb) in self.downgrades:
                    self.changed.setdefault((self.forwards, mb), set()).add(f"L{layer}.{name}")
                else:
                    self.stray += 1
        return note

    def _check_load_read(self, layer: int) -> None:
        """After a compiled block's forward: says once when its router's load could not be
        read (its graph saved no expert indices of the router's top-k shape: the partitioner
        recomputes them, or the router returns no indices), so its load factor stays the
        plan's."""
        if not self.load_varies or self.dispatch is not None or layer in self.loads_read or \
                layer not in self.router_layers or "load" in self.calls.warned:
            return
        self.calls.warned.add("load")
        log.warning("bagualu: the router of compiled layer %d saved no expert indices of its "
                    "top-k shape for the backward: its load cannot be read inside the compiled "
                    "block, and its load factor stays the plan's", layer)

    def compiled_stats(self) -> Dict[str, Any]:
        """How compiled blocks are planned: per operator or as blocks; per operator, the
        tensors their graphs stashed and the (micro-batch, layer) blocks whose operators got
        different strategies."""
        return {"per_operator": self.compiled.per_op, "stashed": self.stashed,
                "mixed_blocks": sum(1 for s in self.placements.values() if len(s) > 1),
                "downgrades": [{"forward": f, "micro_batch": mb, "layers": layers,
                                "changed": sorted(self.changed.get((f, mb), ()))}
                               for (f, mb), layers in sorted(self.downgrades.items())],
                "changed_without_downgrade": self.stray}

    def compiled_op_times(self, op_ms: Dict[str, float],
                          produced: Dict[str, int]) -> Dict[str, float]:
        """The operators' forward times when the blocks are compiled per operator: the
        block's measured time (its compiled call) shared by the bytes each operator saves
        (a compiled graph's operators cannot be timed apart; docs/pytorch.md)."""
        if not self.compiled.per_op:
            return op_ms
        total = op_ms.get(BLOCK_OP, 0.0)
        weight = {n: float(produced.get(n, 0)) for n in self.found.op_names}
        s = sum(weight.values())
        out = dict(op_ms)
        for n, w in weight.items():
            out[n] = total * (w / s if s > 0 else 1.0 / len(weight))
        return out

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
                self._check_load_read(op.layer)
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


def _local_experts_forward(self: nn.Module, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                           ) -> torch.Tensor:
    """transformers 5's eager experts loop over this rank's experts (``_bagualu_local``, a
    fixed list: compiled without a data-dependent loop); the routes to other ranks' experts
    are not computed (another GPU's work), as under simulated expert parallelism in eager."""
    out = torch.zeros_like(hidden_states)
    for e in self._bagualu_local:
        top_k_pos, token_idx = torch.where(top_k_index.t() == e)  # the eager loop's order
        gate, up = F.linear(hidden_states[token_idx], self.gate_up_proj[e]).chunk(2, dim=-1)
        h = F.linear(self.act_fn(gate) * up, self.down_proj[e])
        h = h * top_k_weights[token_idx, top_k_pos, None]
        out.index_add_(0, token_idx, h.to(out.dtype))
    return out


def _zeros_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.zeros_like(x)
