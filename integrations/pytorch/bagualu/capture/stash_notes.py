"""Compiled blocks planned per operator: what bagualu notes as each saved tensor of a compiled
block is stashed (capture/stash.py runs the note in eager, after the compiled forward computed
the tensor). The router's load is read from its saved expert indices (deferred planning, as the
router hook does in eager), the operator that computed the tensor is named its producer, the
capture orders the operators by their first saved tensor, and stats()["compiled"] counts the
placements and downgrades; under real expert parallelism (``dispatch=``) the load is the rows
of the tokens the dispatch delivered, read from the first saved tensor of that size. Under
simulated expert parallelism each block's stacked experts are
patched to compute this rank's experts only (``patch_compiled_experts``).

Not thread-safe: the training thread (the stash runs there, inside the compiled call)."""
from __future__ import annotations

import logging
import types
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..discovery.find import BLOCK_OP, Discovery
from ..errors import InstrumentError
from ..vocabulary import RECOMPUTE, Op
from .calls import OperatorCalls
from .host import Host

log = logging.getLogger("bagualu")

EXPERT_KINDS = frozenset({"expert_linear", "expert_activation"})


class StashNotes:
    """The stash notes of one instrumented model's compiled blocks (see the module docstring).
    ``routers`` (operator name -> its router), ``router_layers`` and ``load_varies`` are set by
    capture/modules.py's AutoLayers as it installs its hooks. Not thread-safe: the training
    thread."""

    def __init__(self, rt: Host, found: Discovery, calls: OperatorCalls,
                 dispatch: Optional[Any]) -> None:
        self.rt = rt
        self.found = found
        self.calls = calls
        self.dispatch = dispatch
        self.layers = len(found.planned)
        self.routers: Dict[str, Any] = {}  # operator name -> its router (modules.py's _Router)
        self.router_layers: Set[int] = set()
        self.load_varies = False
        self.loads_read: Set[int] = set()  # layers whose load this forward read
        # Stats: the strategies of every planned operator when the forward's first router load
        # was read ((layer, name) -> strategy), the layers whose router then downgraded the
        # plan (forward, micro-batch -> layers), the operators stashed after that under
        # another strategy (forward, micro-batch -> "L<layer>.<name>"), and the tensors of
        # forwards without a downgrade stashed under another strategy (none).
        self.forwards = 0
        self.plan_at_router: Dict[Tuple[int, str], str] = {}
        self.downgrades: Dict[Tuple[int, int], List[int]] = {}
        self.changed: Dict[Tuple[int, int], Set[str]] = {}
        self.stray = 0
        # (micro-batch, layer) -> the strategies its stashed tensors' operators had (a block
        # whose operators were placed differently), and the number of tensors stashed.
        self.placements: Dict[Tuple[int, int], Set[str]] = {}
        self.stashed = 0
        # Recompute groups (install(compiled_recompute=)): each union of groups is a compiled
        # variant of the blocks (capture/stash.py); the variant of each block call is picked
        # from the micro-batch's plan before the call starts (``variant_of``).
        self.groups: List[FrozenSet[str]] = []
        self.recomputable: FrozenSet[str] = frozenset()
        self.variant_calls: Dict[FrozenSet[str], int] = {}
        self.recomputed: Dict[Tuple[int, int], FrozenSet[str]] = {}  # (mb, layer) -> set
        self.widened = 0   # calls whose variant recomputes more than the plan's operators
        self.leftover = 0  # tensors a variant's operators still saved (placed as the block)
        self.ops_recomputed = 0  # operators recomputed by the variants, over block calls
        # variant -> the forward nodes its joint pass tagged MUST_RECOMPUTE, over its compiles
        self.tagged: Dict[FrozenSet[str], int] = {}

    def set_groups(self, groups: Any) -> None:
        """install(compiled_recompute=): None, "auto" (the experts' operators, one group: the
        variant whose bytes the planner's graph counts best, docs/pytorch.md) or groups of
        operator names. InstrumentError naming what is
        wrong: an unknown operator, the block's own code, an operator in two groups, more
        variants (every union of groups, 2^groups) than ``stash.variant_limit()``."""
        from . import stash
        found = self.found
        names = [n for n in found.op_names if n != BLOCK_OP]
        if groups == "auto":
            experts = tuple(n for n in names if found.kinds[n] in EXPERT_KINDS)
            groups = (experts,) if experts else ()
        out: List[FrozenSet[str]] = []
        for g in groups:
            bad = [n for n in g if n not in found.op_names]
            if bad:
                raise InstrumentError(
                    f"compiled_recompute: {', '.join(repr(n) for n in bad)} name no operator of "
                    f"the blocks of {found.layers_path} (known: {', '.join(names)})")
            if BLOCK_OP in g:
                raise InstrumentError(
                    f"compiled_recompute: '{BLOCK_OP}' (the block's own code) cannot be in a "
                    "recompute group; force 'block': 'recompute' to rerun whole blocks")
            twice = [n for n in g if any(n in o for o in out)]
            if twice:
                raise InstrumentError(f"compiled_recompute: {', '.join(twice)} in two groups")
            out.append(frozenset(g))
        variants = 2 ** len(out)
        limit = stash.variant_limit()
        if variants > limit:
            raise InstrumentError(
                f"compiled_recompute: {len(out)} groups make {variants} compiled variants of "
                f"each block (every union of groups), over the bound of {limit} (half of "
                "torch._dynamo.config.recompile_limit, "
                f"{torch._dynamo.config.recompile_limit}: past it dynamo runs the block "
                "uncompiled); give fewer groups (join some) or raise the recompile limit")
        self.groups = out
        self.recomputable = frozenset().union(*out) if out else frozenset()

    def variant_of(self, layer: int) -> Any:
        """Layer ``layer``'s variant picker: the recompute set of the block call starting now,
        the union of the groups any of whose operators the micro-batch's plan recomputes
        (a group is compiled whole: its other operators are recomputed too, ``widened``);
        none in the capture and where the whole block reruns."""
        groups = [(g, [Op(n, self.found.kinds[n], layer) for n in sorted(g)])
                  for g in self.groups]
        block = Op(BLOCK_OP, self.found.kinds[BLOCK_OP], layer)
        none: FrozenSet[str] = frozenset()

        def pick() -> FrozenSet[str]:
            rt = self.rt
            if not rt.forwarding or rt.capturing:
                return none
            mb = rt.tracker.micro_batch
            if rt.strategy_of(block, mb) == RECOMPUTE:
                return none
            chosen: Set[str] = set()
            widened = False
            for g, ops in groups:
                planned = [o.name for o in ops if rt.strategy_of(o, mb) == RECOMPUTE]
                if planned:
                    chosen |= g
                    # an operator of the group that saved tensors in the capture and that the
                    # plan did not recompute is recomputed with its group
                    widened |= any(n not in planned and n in self.calls.order for n in g)
            v = frozenset(chosen)
            self.variant_calls[v] = self.variant_calls.get(v, 0) + 1
            if v:
                self.widened += widened
                self.recomputed[(mb, layer)] = v
                self.ops_recomputed += len(v)
                self.placements.setdefault((mb, layer), set()).add(RECOMPUTE)
            else:
                self.recomputed.pop((mb, layer), None)
            return v
        return pick

    def note_tagged(self, variant: FrozenSet[str], nodes: int) -> None:
        """A compile of recompute set ``variant`` tagged ``nodes`` forward nodes of its joint
        graph to recompute (capture/stash.py's joint pass)."""
        self.tagged[variant] = self.tagged.get(variant, 0) + nodes

    def begin_forward(self) -> None:
        """A forward starts: no router load read yet."""
        self.loads_read.clear()
        self.forwards += 1

    def on_stash(self, layer: int) -> Any:
        """What a compiled block of layer ``layer`` does before its saved tensor is packed
        (capture/stash.py): reads the router's load from its saved expert indices (deferred
        planning, as the router hook does in eager), names the operator that computed it as
        its producer (unless the whole block is recomputed: its call owns everything) and, in
        the capture, orders the operators by their first saved tensor."""
        ops = {n: Op(n, self.found.kinds[n], layer) for n in self.found.op_names}

        def note(t: torch.Tensor, name: Optional[str], received: bool = False) -> None:
            rt = self.rt
            tr = rt.tracker
            if not rt.forwarding:
                return
            if received:
                self._read_received(t, layer)
            if name is None:
                return
            op = ops.get(name)
            if op is None:
                return
            self._read_load(t, name, layer)
            if tr.light is not None:
                return
            if tr.calls and tr.calls[-1].op.name == BLOCK_OP:
                return
            mb = tr.micro_batch
            strategy = rt.strategy_of(op, mb)
            if strategy == RECOMPUTE and name in self.recomputed.get((mb, layer), ()):
                self.leftover += 1  # the variant's partition saved it still: as the block
                return
            if strategy == RECOMPUTE and rt.capturing and name in self.recomputable:
                pass  # the capture runs the plain variant: measured as its operator's, kept
            elif strategy == RECOMPUTE:  # cannot be rerun alone: the block's strategy holds it
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

    def _read_load(self, t: torch.Tensor, name: str, layer: int) -> None:
        """The router's saved expert indices (``t``, of operator ``name``): its load, read once
        per layer and forward. A downgrade changes the placements of the block's tensors
        stashed after this one; recompute cannot start inside a compiled block
        (recompute_allowed), so it applies to later blocks' whole-block operator only."""
        router = self.routers.get(name) if self.load_varies else None
        if router is None or layer in self.loads_read or t.is_floating_point() or \
                t.dim() < 1 or t.shape[-1] != router.top_k or self.dispatch is not None:
            return
        self._observe(layer, router.load(t.reshape(-1, router.top_k)))

    def balance(self, layer: int, x: torch.Tensor) -> None:
        """A compiled block of ``layer`` starts on ``x`` under real expert parallelism: the
        balanced count of its dispatch is this rank's tokens times the router's top-k (what
        the router hook counts in eager, whose hooks do not run inside the block)."""
        router = next(iter(self.routers.values()), None)
        if self.dispatch is not None and router is not None and x.dim() >= 1 and \
                x.shape[-1] > 0:
            self.dispatch.slots[layer] = (x.numel() // x.shape[-1]) * router.top_k

    def _read_received(self, t: torch.Tensor, layer: int) -> None:
        """The first saved tensor of a compiled block whose rows are the tokens its real EP
        dispatch delivered (capture/stash.py's ``stash_received``): the layer's load factor,
        read once per layer and forward, as the dispatch hook does in eager."""
        if self.dispatch is None or layer in self.loads_read:
            return
        balanced = self.dispatch.slots.pop(layer, None)
        if not balanced:
            return
        self._observe(layer, t.shape[0] / balanced)

    def _observe(self, layer: int, load: float) -> None:
        """``load``, the load factor of ``layer`` read inside its compiled block, to the
        planner (deferred planning; a downgrade places the rest of the block's stashed
        tensors by the new plan)."""
        rt = self.rt
        tr = rt.tracker
        mb = tr.micro_batch
        if not self.loads_read:
            self.plan_at_router = {
                (li, n): rt.strategy_of(Op(n, self.found.kinds[n], li), mb)
                for li in range(self.layers) for n in self.found.op_names}
        self.loads_read.add(layer)
        if rt.observe_router(layer, load):
            self.downgrades.setdefault((self.forwards, mb), []).append(layer)
            if tr.light is not None:
                tr.end_light()

    def check_load_read(self, layer: int) -> None:
        """After a compiled block's forward: says once when its router's load could not be
        read (its graph saved no expert indices of the router's top-k shape: the partitioner
        recomputes them, or the router returns no indices), so its load factor stays the
        plan's."""
        if not self.load_varies or layer in self.loads_read or \
                layer not in self.router_layers or "load" in self.calls.warned:
            return
        self.calls.warned.add("load")
        if self.dispatch is not None:
            log.warning("bagualu: compiled layer %d saved no tensor of the rows its dispatch "
                        "(dispatch=) received for the backward (or the dispatch is no module "
                        "of the block): its load cannot be read inside the compiled block, and "
                        "its load factor stays the plan's", layer)
            return
        log.warning("bagualu: the router of compiled layer %d saved no expert indices of its "
                    "top-k shape for the backward: its load cannot be read inside the compiled "
                    "block, and its load factor stays the plan's", layer)

    def stats(self, per_op: bool) -> Dict[str, Any]:
        """How compiled blocks are planned: per operator or as blocks; per operator, the
        tensors their graphs stashed and the (micro-batch, layer) blocks whose operators got
        different strategies."""
        return {"per_operator": per_op, "stashed": self.stashed,
                "mixed_blocks": sum(1 for s in self.placements.values() if len(s) > 1),
                "downgrades": [{"forward": f, "micro_batch": mb, "layers": layers,
                                "changed": sorted(self.changed.get((f, mb), ()))}
                               for (f, mb), layers in sorted(self.downgrades.items())],
                "changed_without_downgrade": self.stray,
                "recompute": {
                    "groups": [sorted(g) for g in self.groups],
                    "variant_limit": _limit() if self.groups else None,
                    "calls": {"+".join(sorted(v)) or "none": c
                              for v, c in sorted(self.variant_calls.items(),
                                                 key=lambda kv: sorted(kv[0]))},
                    "operators_recomputed": self.ops_recomputed,
                    # the nodes each variant's compiles tagged to recompute (0: its operators
                    # computed nothing in the graphs it compiled)
                    "tagged": {"+".join(sorted(v)): n
                               for v, n in sorted(self.tagged.items(),
                                                  key=lambda kv: sorted(kv[0]))},
                    "mixed_blocks": sum(1 for k, v in self.placements.items()
                                        if RECOMPUTE in v and len(v) > 1),
                    "widened": self.widened, "leftover": self.leftover}}

    def op_times(self, op_ms: Dict[str, float], produced: Dict[str, int]) -> Dict[str, float]:
        """The operators' forward times when the blocks are compiled per operator: the
        block's measured time (its compiled call) shared by the bytes each operator saves
        (a compiled graph's operators cannot be timed apart; docs/pytorch.md)."""
        total = op_ms.get(BLOCK_OP, 0.0)
        weight = {n: float(produced.get(n, 0)) for n in self.found.op_names}
        s = sum(weight.values())
        out = dict(op_ms)
        for n, w in weight.items():
            out[n] = total * (w / s if s > 0 else 1.0 / len(weight))
        return out


def _limit() -> int:
    from . import stash
    return stash.variant_limit()


def patch_compiled_experts(found: Discovery, ep: Any,
                           patched: List[Tuple[nn.Module, Any]]) -> None:
    """Simulated expert parallelism in compiled blocks: each block's stacked experts
    (transformers 5) compute the routes of this rank's experts only, one expert after the
    other (``_local_experts_forward``: the eager loop's arithmetic, over a fixed list of
    experts instead of the data-dependent list of those hit), so that the tokens each
    expert saves are data-dependent sizes in the compiled graph (dynamo's unbacked sizes:
    no recompile per load) and the saved bytes follow the load as in eager. ``ep``:
    modules.py's ExpertParallel; each patched module and its old forward go to ``patched``
    (restored at removal)."""
    for li in range(len(found.planned)):
        block = found.blocks[found.planned[li]]
        done = False
        for path, m in block.named_modules():
            if not all(hasattr(m, a) for a in ("gate_up_proj", "down_proj", "act_fn",
                                               "num_experts")):
                continue
            if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or \
                    not getattr(m, "is_concatenated", True) or \
                    not getattr(m, "has_gate", True):
                break
            m._bagualu_local = ep.local_set(int(m.num_experts))
            patched.append((m, m.__dict__.get("forward")))
            m.forward = types.MethodType(_local_experts_forward, m)
            done = True
        if not done:
            raise InstrumentError(
                f"instrument(expert_parallel={ep.ep}) with compiled blocks: block "
                f"{found.planned[li]} of {found.layers_path} has no stacked experts "
                "bagualu can restrict inside a compiled graph (transformers 5's "
                "gate_up_proj/down_proj experts, no bias); use real expert parallelism "
                "(dispatch=), local_experts= for a model that computes only its own "
                "experts, or leave the blocks uncompiled")


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
