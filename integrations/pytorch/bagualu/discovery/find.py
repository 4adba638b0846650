"""Finds the planner's layers and operators in an unmodified ``nn.Module``.

Layers are the repeated transformer blocks: the entries of an ``nn.ModuleList`` (or
``nn.Sequential``) that share a class, e.g. ``model.model.layers`` of a Hugging Face model. The
largest run of consecutive blocks with the same structure is planned; other blocks (a dense
first layer of DeepSeek-V3, say) are kept and accounted outside the planner's layers.

Operators are a block's submodules classified by structure and name into the planner's kinds
(docs/pytorch.md, "Unmodified models"). A module's own code (functional calls such as
``F.scaled_dot_product_attention``, softmax, top-k, residual adds) belongs to the innermost
operator module that runs it; the block's own code is the operator ``block``. Per-expert
modules of an expert list collapse into one operator (``mlp.experts.*.w1``).

Pure discovery: nothing here installs a hook (``instrument`` does, see modules.py).
Not thread-safe; used once per model.
"""
from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..errors import InstrumentError
from ..vocabulary import KINDS, SCALING_KINDS

Layers = Optional[Union[str, Sequence[str]]]  # instrument(layers=): one path or several
BLOCK_OP = "block"  # the operator of a block's own code (residual adds and the like)
NO_OP = "none"      # an override kind: the module is not an operator (its code joins the parent)
_ACTIVATION_NAMES = ("act", "act_fn", "activation", "activation_fn")
_ATTENTION_CHILDREN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "qkv", "wq", "wk", "wv",
                       "o_proj", "out_proj", "q_a_proj", "kv_a_proj_with_mqa", "c_attn")


@dataclass
class OpSite:
    """One module of a block that is (part of) a planner operator."""

    path: str        # relative to the block, e.g. 'mlp.experts.3.w1'
    name: str        # the operator's name in the layer graph, e.g. 'mlp.experts.*.w1'
    kind: str
    cls: str         # the module's class name
    module: nn.Module


@dataclass
class Discovery:
    """What ``find`` found: the layers, which of them are planned, and their operators."""

    layers_path: str
    blocks: List[nn.Module]
    planned: List[int]                    # indices into blocks, consecutive
    sites: List[List[OpSite]]             # per planned block, in module order
    op_names: List[str]                   # operator names of one planned block, module order
    kinds: Dict[str, str]                 # operator name -> kind
    skipped: List[Tuple[int, str]] = field(default_factory=list)  # (block, why) not planned
    # Where each block sits: (container, index); the entry there is the block or a compiled
    # wrapper of it (torch.compile(block) registered in its place).
    slots: List[Tuple[Any, int]] = field(default_factory=list)

    def entry(self, i: int) -> Any:
        """What the model calls for block ``i``: the block, or the compiled wrapper now in
        its place."""
        if not self.slots:
            return self.blocks[i]
        container, index = self.slots[i]
        return container[index]

    def describe(self) -> str:
        """The table ``bagualu.describe`` prints."""
        first = self.planned[0]
        lines = [f"layers: {self.layers_path} ({len(self.blocks)} x "
                 f"{type(self.blocks[first]).__name__}); planned: blocks "
                 f"{self.planned[0]}..{self.planned[-1]} ({len(self.planned)} layers)"]
        for i, why in self.skipped:
            lines.append(f"  block {i} not planned (kept): {why}")
        counts: Dict[str, int] = {}
        classes: Dict[str, str] = {}
        for s in self.sites[0]:
            counts[s.name] = counts.get(s.name, 0) + 1
            classes.setdefault(s.name, s.cls)
        lines.append(f"operators per layer ({len(self.op_names)}):")
        width = max(len(n) for n in self.op_names)
        for n in self.op_names:
            kind = self.kinds[n]
            extra = " (scales with load)" if kind in SCALING_KINDS else ""
            many = f" x{counts[n]}" if counts.get(n, 0) > 1 else ""
            lines.append(f"  {n:<{width}}  {kind:<17} {classes.get(n, '')}{many}{extra}")
        return "\n".join(lines)


def _resolve(model: nn.Module, path: str) -> Any:
    obj: Any = model
    for part in path.split("."):
        if part == "":
            continue
        if part.isdigit() and isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)):
            obj = obj[int(part)]
            continue
        if isinstance(obj, nn.ModuleDict) and part in obj:
            obj = obj[part]
            continue
        if not hasattr(obj, part):
            raise InstrumentError(f"layers='{path}': {type(obj).__name__} has no attribute "
                                  f"'{part}'")
        obj = getattr(obj, part)
    return obj


def is_compiled_wrapper(m: Any) -> bool:
    """Whether ``m`` is what torch.compile(module) returns (an OptimizedModule; none exists
    before torch.compile imported dynamo)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(m, eval_frame.OptimizedModule)


def unwrap(m: nn.Module) -> nn.Module:
    """The module a compiled wrapper compiles (``m`` itself otherwise)."""
    return m._orig_mod if is_compiled_wrapper(m) else m


def find_blocks(model: nn.Module, layers: Layers = None) -> Tuple[str, List[nn.Module]]:
    """The repeated blocks of ``model``: those at ``layers`` (a dotted path, or a list of
    paths whose blocks are concatenated in order: the stages of one rank under an interleaved
    schedule) or, guessed, the entries of the ModuleList/Sequential with the most parameters
    among those whose entries (at least two) share a class. A block registered as its
    compiled wrapper (torch.compile(block)) is the module it wraps."""
    path, slots = find_slots(model, layers)
    return path, [unwrap(c[i]) for c, i in slots]


def find_slots(model: nn.Module, layers: Layers = None) -> Tuple[str, List[Tuple[Any, int]]]:
    """Where the blocks of ``find_blocks`` sit: (container, index) each."""
    if isinstance(layers, (list, tuple)):
        if not layers or not all(isinstance(p, str) for p in layers):
            raise InstrumentError(f"layers={layers!r}: give a dotted path or a non-empty list "
                                  "of dotted paths")
        slots: List[Tuple[Any, int]] = []
        for p in layers:
            slots.extend(find_slots(model, p)[1])
        return ", ".join(layers), slots
    if layers is not None:
        obj = _resolve(model, layers)
        if isinstance(obj, nn.ModuleDict):  # torchtitan's layers: its values, in order
            obj = list(obj.values())
        if not isinstance(obj, (nn.ModuleList, nn.Sequential, list, tuple)) or \
                not all(isinstance(m, nn.Module) for m in obj) or len(obj) == 0:
            raise InstrumentError(f"layers='{layers}' is a {type(obj).__name__}, not a "
                                  "non-empty nn.ModuleList (or ModuleDict) of blocks")
        return layers, [(obj, i) for i in range(len(obj))]
    best: Optional[Tuple[int, str, Any]] = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        kids = [unwrap(k) for k in m]
        if len({type(k) for k in kids}) != 1 or _is_expert_list(path):
            continue
        if not any(True for _ in kids[0].children()):
            continue  # a list of leaves (e.g. per-head linears) is not a list of blocks
        size = sum(p.numel() for p in m.parameters())
        if best is None or size > best[0]:
            best = (size, path, m)
    if best is None:
        raise InstrumentError(
            f"{type(model).__name__}: no layers found: looked for an nn.ModuleList or "
            "nn.Sequential of at least two blocks of one class (e.g. model.model.layers); "
            "pass instrument(model, layers='path.to.blocks')")
    return best[1], [(best[2], i) for i in range(len(best[2]))]


def _is_expert_list(path: str) -> bool:
    last = path.rsplit(".", 1)[-1].lower()
    return "expert" in last and "shared" not in last


def _collapse(path: str, lists: Sequence[str]) -> str:
    """'mlp.experts.3.w1' -> 'mlp.experts.*.w1' when 'mlp.experts' is a ModuleList of the
    block (list entries are one operator)."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit() and ".".join(parts[:i]) in lists:
            parts[i] = "*"
    return ".".join(parts)


def classify(path: str, module: nn.Module, children: Sequence[str]) -> Optional[str]:
    """The operator kind of a block's submodule from its relative path, class and children, or
    None when its code belongs to the enclosing operator."""
    parts = path.lower().split(".")
    name = parts[-1]
    cname = type(module).__name__.lower()
    in_shared = any("shared" in p for p in parts)
    in_experts = not in_shared and any(p.startswith("expert") for p in parts)
    kids = {c.lower() for c in children}
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return None  # containers are never called
    if isinstance(module, (nn.Dropout, nn.Embedding, nn.Identity)) or "rotary" in cname:
        return None
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in cname:
        return "norm"
    if not in_experts and not in_shared and (
            name in ("gate", "router", "gating") or "router" in cname
            or (cname.endswith("gate") and "expert" not in cname)):
        return "router"
    is_linear = isinstance(module, nn.Linear) or ("linear" in cname and not kids)
    is_act = (name in _ACTIVATION_NAMES or cname.endswith("activation") or
              type(module).__module__ == "torch.nn.modules.activation")
    if in_shared:
        if is_act:
            return "shared_activation"
        return "shared_linear" if is_linear or kids else "shared_activation"
    if in_experts:
        if is_act:
            return "expert_activation"
        if is_linear:
            return "expert_linear"
        if name.startswith("expert") and any(p.dim() == 3 for p in module.parameters(False)):
            return "expert_linear"  # stacked (grouped) expert weights: the experts' own code
        if name.isdigit() or kids:
            return "expert_activation"  # one expert MLP's own code: act(w1(x)) * w3(x)
        return "expert_linear"
    if any(k.startswith("expert") and "shared" not in k for k in kids):
        return "dispatch"  # an MoE block's own code: routing, gathers, the weighted sum
    if kids & set(_ATTENTION_CHILDREN) or "attention" in cname or name in (
            "attn", "attention", "self_attn", "self_attention", "mixer"):
        return "attention"
    if is_linear:
        return "linear"
    if is_act:
        return "other"
    if kids:
        return "other"  # a dense MLP or another composite: its own code
    return None


def _signature(block: nn.Module) -> Tuple[Tuple[str, str], ...]:
    return tuple((p, type(m).__name__) for p, m in block.named_modules())


def chunk_layers(model: nn.Module, chunks: int) -> Optional[List[str]]:
    """The layer paths of a rank's stages under an interleaved schedule: when ``model`` is a
    list of ``chunks`` modules (one per local stage, chunk order), the blocks found in each;
    None for any other model."""
    if chunks < 2 or not isinstance(model, (nn.ModuleList, nn.Sequential)) \
            or len(model) != chunks:
        return None
    return [f"{i}.{find_blocks(m)[0]}" for i, m in enumerate(model)]


def find(model: nn.Module, layers: Layers = None,
         ops: Optional[Dict[str, str]] = None) -> Discovery:
    """Discovers the layers and operators of ``model`` (see the module docstring).

    ``ops``: overrides, fnmatch pattern on the module path relative to its block (or on the
    operator name, or on the full path) -> kind ('none': not an operator)."""
    ops = dict(ops or {})
    for pattern, kind in ops.items():
        if kind not in KINDS and kind != NO_OP:
            raise InstrumentError(f"ops['{pattern}']: unknown kind '{kind}' (known: "
                                  f"{', '.join(KINDS)}, or '{NO_OP}')")
    path, slots = find_slots(model, layers)
    blocks = [unwrap(c[i]) for c, i in slots]
    sigs = [_signature(b) for b in blocks]
    # The longest run of consecutive blocks with one structure is planned.
    best_start, best_len, start = 0, 0, 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or sigs[i] != sigs[start]:
            if i - start > best_len:
                best_start, best_len = start, i - start
            start = i
    planned = list(range(best_start, best_start + best_len))
    skipped = [(i, "its structure differs from the planned blocks'")
               for i in range(len(blocks)) if i not in planned]
    full = {m: p for p, m in model.named_modules()}
    used: Dict[str, int] = {p: 0 for p in ops}
    sites: List[List[OpSite]] = []
    for i in planned:
        b = blocks[i]
        lists = [p for p, m in b.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))
                 and p]
        mine = [OpSite("", BLOCK_OP, "other", type(b).__name__, b)]
        for rel, m in b.named_modules():
            if not rel:
                continue
            name = _collapse(rel, lists)
            kind = None
            for pattern, k in ops.items():
                fullpath = full.get(m, rel)
                if fnmatch.fnmatchcase(rel, pattern) or fnmatch.fnmatchcase(name, pattern) \
                        or fnmatch.fnmatchcase(fullpath, pattern):
                    kind = k
                    used[pattern] += 1
                    break
            if kind is None:
                kind = classify(rel, m, [c for c, _ in m.named_children()])
            if kind is None or kind == NO_OP:
                continue
            mine.append(OpSite(rel, name, kind, type(m).__name__, m))
        sites.append(mine)
    for pattern, n in used.items():
        if n == 0:
            raise InstrumentError(f"ops: the pattern '{pattern}' matches no module of the "
                                  f"planned blocks of {path} (patterns match paths relative to "
                                  "a block, e.g. 'mlp.experts', or full module paths)")
    names: List[str] = []
    kinds: Dict[str, str] = {}
    for s in sites[0]:
        if s.name not in kinds:
            names.append(s.name)
            kinds[s.name] = s.kind
        elif kinds[s.name] != s.kind:
            raise InstrumentError(f"operator '{s.name}' gets two kinds ({kinds[s.name]}, "
                                  f"{s.kind}); name one with ops={{'{s.name}': 'kind'}}")
    if len(names) == 1:
        raise InstrumentError(f"{path}: no operator found in the blocks "
                              f"({type(blocks[planned[0]]).__name__}): looked for norms, "
                              "attention, projections, a router/gate, experts, shared experts "
                              "and MLPs; name them with ops={'path.pattern': 'kind'}")
    return Discovery(path, blocks, planned, sites, names, kinds, skipped, slots)


def _positive_int(objs: Sequence[Any], attrs: Sequence[str]) -> Optional[int]:
    for obj in objs:
        for attr in attrs:
            v = getattr(obj, attr, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def expert_count(module: nn.Module) -> Optional[int]:
    """The number of experts a router/MoE block routes to: common attribute names on it or its
    config, else the rows of its (router) weight."""
    n = _positive_int((module, getattr(module, "config", None)),
                      ("num_experts", "n_routed_experts", "num_local_experts"))
    if n is not None:
        return n
    w = getattr(module, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 2 else None


def top_k_of(module: nn.Module) -> Optional[int]:
    """Experts per token of a router/MoE block, from common attribute names."""
    return _positive_int((module, getattr(module, "config", None)),
                         ("top_k", "num_experts_per_tok", "topk"))
