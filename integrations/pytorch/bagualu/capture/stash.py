"""Per-operator placements inside compiled blocks: the ``torch.ops.bagualu.stash`` and
``unstash`` ops and the graph-module saved-tensor hooks that put them into a compiled block's
graphs.

A compiled block's saved tensors never meet the operator scopes of eager capture: dynamo
traces the block whole, and Python saved-tensor hooks would see every tensor at the block's
end with no producer. Saved-tensor hooks that are ``fx.GraphModule``\\ s are instead inlined by
AOTAutograd (torch 2.15, after the partitioner has chosen what to save, so the partition and
every computed value stay those of plain compile): while each saved node's pack hook is traced,
``_get_saved_tensor_hook_context()`` names the node, whose ``nn_module_stack`` names the module
that computed it. The traced pack is ``stash(t, op)``, with ``op`` the id of the planner
operator owning that module (a constant in the graph); the traced unpack is ``unstash(handle,
sizes, strides, dtype, device)`` at the start of the block's backward graph. Both are opaque
custom ops with fake implementations, so nothing of bagualu is traced and no graph breaks.

At run time ``stash`` hands the tensor to the saved-tensor hooks that were in effect outside
the block (the runtime's pack, or a rerun's collecting hook), after naming its producer
(``Frame.on_stash``): the core places it by the current micro-batch's plan for that operator,
keep, offload or FP8, with no recompile. ``unstash`` gives back what the outer unpack returns.
A handle is a 0-d int64 tensor whose entry lives as long as autograd holds the handle.

Real expert parallelism (``dispatch=``, a module of the block): the first saved tensor whose
leading size is that of the dispatch module's output (the tokens the all-to-all delivered, a
data-dependent size in the graph) is stashed through ``stash_received`` instead, which also
hands its rows to ``on_stash`` (the layer's load factor, read in eager as the router's is).

Recompute per operator (install(compiled_recompute=)): each recompute set is a compiled variant
with its own pair of hooks, tagged MUST_RECOMPUTE by a joint pass while it compiles (below,
"recompute variants").

Each planned block runs its compiled call inside ``Frame`` (capture/compiled.py), which pushes
these hooks (one pair per variant for the process: dynamo guards on their identity), the
filtering mode "no_static" (every saved tensor but parameters and buffers, the block's input
included) and, for inductor, no buffer reuse or in-place buffers in the blocks' graphs
(``_inductor_config``).
Not thread-safe: the training thread (unstash runs on autograd's thread while the training
thread waits in backward()).
"""
from __future__ import annotations

import contextlib
import itertools
import re
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

try:  # torch 2.15: the saved node while a graph-module hook is traced
    from torch._functorch._aot_autograd.graph_compile import _get_saved_tensor_hook_context
except ImportError:  # older torch: compiled blocks stay one operator (capture/compiled.py)
    _get_saved_tensor_hook_context = None

OUTER = -1  # op id of a saved block input (its producer is whoever made it outside)

_names: List[str] = []                 # op id -> planner operator name (ids are in graphs)
_ids: Dict[str, int] = {}
_paths: Dict[str, str] = {}            # module path within a block -> operator name
_scaling: Set[str] = set()             # operators whose saved bytes follow the router's load
_dispatches: Set[str] = set()          # module paths (within a block) of real EP dispatches
_handles: Dict[int, Tuple[Any, Optional[Callable[[Any], torch.Tensor]]]] = {}
_next = itertools.count(1)
_frames: List["Frame"] = []            # compiled block calls running now, innermost last


def supported() -> bool:
    """Whether this torch inlines graph-module saved-tensor hooks with their saved node."""
    return _get_saved_tensor_hook_context is not None


def name_operators(paths: Dict[str, str], scaling: Sequence[str] = ()) -> None:
    """Module path within a planned block -> its planner operator ('' is the block's own
    code), and the operators whose saved bytes the planner scales with the router's load.
    Read when a block's graphs are traced (the ids are baked into them)."""
    _paths.update(paths)
    _scaling.clear()  # this install's (a graph traced before keeps what it baked in)
    _scaling.update(scaling)


def name_dispatches(paths: Sequence[str]) -> None:
    """The module paths within a planned block of real expert parallelism's dispatches
    (``dispatch=``): their output's rows are the tokens this rank's experts receive. Read when
    a block's graphs are traced."""
    _dispatches.clear()
    _dispatches.update(paths)


def op_name(op: int) -> Optional[str]:
    """The operator name of id ``op`` (None: a block input)."""
    return _names[op] if 0 <= op < len(_names) else None


_ROOT = re.compile(r"^L\['[^']*'\]")
_INDEX = re.compile(r"\[(\d+)\]|\['([^']*)'\]")
# A module whose forward an instance attribute wraps (torchtitan's Module.parallelize: a
# closure over the bound forward) is reached through that closure:
# ``attention.forward.__closure__[0].cell_contents.__self__.wq`` is ``attention.wq``.
_WRAPPED = re.compile(r"\.forward(?:\.__closure__\[\d+\]\.cell_contents)+(?:\.__self__)?")


def module_path(stack_entry: str) -> str:
    """A dynamo nn_module_stack path (``L['self'].mlp.experts[0]``, ``._modules['x']``, a
    wrapped forward's closure) relative to the compiled block: ``mlp.experts.0``."""
    p = _WRAPPED.sub("", _ROOT.sub("", stack_entry))
    p = p.replace("._orig_mod", "").replace("._modules", "")
    p = _INDEX.sub(lambda m: "." + (m.group(1) or m.group(2)), p)
    return p.strip(".").replace("..", ".")


def _op_of_name(name: Optional[str]) -> int:
    """The id of operator ``name`` (OUTER for None)."""
    if name is None:
        return OUTER
    if name not in _ids:
        _ids[name] = len(_names)
        _names.append(name)
    return _ids[name]


def _op_of(node: fx.Node) -> int:
    """The id of the operator that computed ``node`` (the deepest operator module on its
    module stack; the block's own code where none is; OUTER for a graph input)."""
    if node.op == "placeholder":
        return OUTER
    stack = node.meta.get("nn_module_stack") or {}
    best = _paths.get("")
    best_len = -1
    for entry in stack.values():
        path = module_path(entry[0] if isinstance(entry, tuple) else str(entry))
        for p, name in _paths.items():
            if p and len(p) > best_len and (path == p or path.startswith(p + ".")):
                best, best_len = name, len(p)
    return _op_of_name(best)


# -- the ops ------------------------------------------------------------------------------
# Defined on the namespace's fragment with plain kernels (CompositeExplicitAutograd): a call
# costs the dispatcher and the kernel, not torch.library.custom_op's Python wrapper as well.
_lib = torch.library.Library("bagualu", "FRAGMENT")
_lib.define("stash(Tensor t, int op) -> Tensor")
_lib.define("stash_received(Tensor t, int op) -> Tensor")
_lib.define("unstash(Tensor h, SymInt[] size, SymInt[] stride, ScalarType dtype, "
            "Device device) -> Tensor")


def stash(t: torch.Tensor, op: int, received: bool = False) -> torch.Tensor:
    """Places a saved tensor of a compiled block by the plan (module docstring); returns its
    handle. ``received``: its rows are the tokens the block's dispatch delivered."""
    frame = _frames[-1] if _frames else None
    entry: Tuple[Any, Optional[Callable[[Any], torch.Tensor]]]
    if frame is None:
        entry = (t, None)
    else:
        entry = frame.pack(t, op, True) if received else frame.pack(t, op)
    hid = next(_next)
    _handles[hid] = entry
    h = torch.tensor(hid, dtype=torch.int64)
    weakref.finalize(h, _handles.pop, hid, None)
    return h


def unstash(h: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """The saved tensor of handle ``h``, where and as the plan left it, brought back."""
    hid = int(h)
    entry = _handles.get(hid)
    if entry is None:
        raise RuntimeError(f"bagualu: saved tensor {hid} of a compiled block is gone (its "
                           "backward ran already, or its graph was freed)")
    packed, unpack = entry
    return packed if unpack is None else unpack(packed)


def stash_received(t: torch.Tensor, op: int) -> torch.Tensor:
    """``stash`` of a tensor whose rows are the tokens a real EP dispatch delivered."""
    return stash(t, op, True)


_lib.impl("stash", stash, "CompositeExplicitAutograd")
_lib.impl("stash_received", stash_received, "CompositeExplicitAutograd")
_lib.impl("unstash", unstash, "CompositeExplicitAutograd")


@torch.library.register_fake("bagualu::stash", lib=_lib)
def _(t: torch.Tensor, op: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.register_fake("bagualu::stash_received", lib=_lib)
def _(t: torch.Tensor, op: int) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


@torch.library.register_fake("bagualu::unstash", lib=_lib)
def _(h: torch.Tensor, size: Sequence[int], stride: Sequence[int], dtype: torch.dtype,
      device: torch.device) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


# -- the graph-module hooks ---------------------------------------------------------------
def _pack(t: torch.Tensor) -> Tuple[Any, ...]:
    """(handle, sizes..., strides...): sizes and strides go through the graphs as values, so
    that symbolic ones (an expert's tokens, data-dependent under expert parallelism) reach the
    backward graph as its inputs."""
    ctx = _get_saved_tensor_hook_context() if supported() else None
    if ctx is None:  # run as a plain hook (never pushed outside a Frame's compiled call)
        raise RuntimeError("bagualu's stash hook ran outside a compiled graph")
    _check_saved_values(ctx["_fw_graph"])
    node = ctx["_node"]
    op = _op_of(node)
    if _frames and _frames[-1].variant:
        op = _recompute_input_owner(node, op, _frames[-1].variant)
    if _frames and (_frames[-1].dynamic or _dispatches) and op_name(op) in _scaling and \
            not free_unbacked_symbols(node.meta.get("val")):
        # Expert parallelism, simulated or real: the tokens an operator that scales with the
        # load saves are data-dependent (unbacked) sizes; a tensor of fixed size it saves
        # (inductor's partition saves the MoE block's input under its module, say; the
        # all-to-all's token counts) does not follow the load, and is placed and counted as
        # the block's own code (kind other), so that the planner does not scale its bytes.
        op = _op_of_name(_paths.get(""))
    elif _dispatches and op_name(op) not in _scaling and \
            free_unbacked_symbols(node.meta.get("val")) & _received_symbols(ctx["_fw_graph"]):
        # Real expert parallelism: a tensor whose size follows the tokens received (not the
        # tokens sent, whose count is fixed), saved outside the operators that scale with the
        # load (a node with no module of the block on its stack: the all-to-all's own, say),
        # belongs to the dispatch, whose bytes the planner scales.
        op = _op_of_name(_scaling_owner())
    v = node.meta.get("val")
    if _dispatches and isinstance(v, torch.Tensor) and v.dim() >= 1 and \
            isinstance(v.shape[0], torch.SymInt) and \
            v.shape[0].node.expr in _received_rows(ctx["_fw_graph"]):
        h = torch.ops.bagualu.stash_received(t, op)
    else:
        h = torch.ops.bagualu.stash(t, op)
    return (h, *t.size(), *t.stride())


def _recompute_input_owner(node: fx.Node, op: int, variant: FrozenSet[str]) -> int:
    """The operator that places saved ``node`` of a recompute variant's forward graph: a
    node that a recomputed operator reads (the partition saves it as the recomputed region's
    input) and that an operator outside the variant reads too is that operator's (its first
    such reader): the plain partition saved it as that reader's input, under that operator,
    so the planner's graph counts it there. On Qwen3-MoE and Mixtral the experts' variant
    saves the MoE block's reshaped input (operator ``mlp``) where the plain partition saved
    the gate's view of it (``mlp.gate``); placed by ``mlp``'s plan instead of the gate's,
    the points' bytes were up to 10% off the planner's (docs/pytorch.md, "Compiled
    blocks"). Any other node keeps ``op``."""
    readers = [_op_of(u) for u in node.users if u.op == "call_function"]
    if not any(op_name(r) in variant for r in readers):
        return op
    for r in readers:
        if r != op and r >= 0 and op_name(r) not in variant:
            return r
    return op


def _received_symbols(graph: fx.Graph) -> Set[Any]:
    """The unbacked symbols the received rows of ``graph``'s dispatches are made of."""
    out: Set[Any] = set()
    for e in _received_rows(graph):
        out |= e.free_symbols
    return out


def _scaling_owner() -> Optional[str]:
    """The operator that owns a received-size tensor saved outside the scaling operators:
    a dispatch module's, else the first scaling operator (by name)."""
    for path in sorted(_dispatches):
        if _paths.get(path) in _scaling:
            return _paths[path]
    return min(_scaling) if _scaling else _paths.get("")


_rows: "weakref.WeakKeyDictionary[fx.Graph, Set[Any]]" = weakref.WeakKeyDictionary()


def _within(stack: Any, paths: Set[str]) -> bool:
    """Whether a node's nn_module_stack runs inside one of the module ``paths``."""
    for entry in (stack or {}).values():
        p = module_path(entry[0] if isinstance(entry, tuple) else str(entry))
        if any(p == d or p.startswith(d + ".") for d in paths):
            return True
    return False


def _received_rows(graph: fx.Graph) -> Set[Any]:
    """The symbolic leading sizes of what the dispatch modules of a forward graph hand the
    rest of the block (a node inside a dispatch read by one outside it): the rows of the
    tokens received. Sizes known at trace time are left out (a fixed count is no load)."""
    got = _rows.get(graph)
    if got is not None:
        return got
    got = set()
    for n in graph.nodes:
        v = n.meta.get("val")
        if n.op != "call_function" or not isinstance(v, torch.Tensor) or v.dim() < 1 or \
                not isinstance(v.shape[0], torch.SymInt) or \
                not _within(n.meta.get("nn_module_stack"), _dispatches):
            continue
        if any(u.op == "output" or not _within(u.meta.get("nn_module_stack"), _dispatches)
               for u in n.users):
            got.add(v.shape[0].node.expr)
    _rows[graph] = got
    return got


_checked: "weakref.WeakSet[fx.Graph]" = weakref.WeakSet()


def _check_saved_values(graph: fx.Graph) -> None:
    """A forward graph that saves a value other than a tensor or a symbolic size for its
    backward (an opaque object: the process group of expert parallelism's functional
    all-to-all) cannot take these hooks: torch 2.15's inlining leaves such values out of the
    forward's outputs while the backward still takes them (it then stops on a StopIteration
    taking its arguments). Refused here, naming the value and what to do."""
    if graph in _checked:
        return
    _checked.add(graph)
    for n in graph.output_node().args[0]:
        if isinstance(n, fx.Node) and type(n.meta.get("val")).__name__ == "FakeScriptObject":
            raise RuntimeError(
                f"bagualu: this compiled block saves '{n.name}', an opaque object (such as a "
                "process group), for its backward; torch inlines saved-tensor hooks without "
                "such values, so its tensors cannot be placed per operator: "
                "install(compiled_operators='block') (torchtitan: --bagualu.compiled_operators "
                "block)")


def _unpack(packed: Tuple[Any, ...]) -> torch.Tensor:
    ctx = _get_saved_tensor_hook_context()
    if ctx is None:
        raise RuntimeError("bagualu's unstash hook ran outside a compiled graph")
    v = ctx["_node"].meta["val"]
    n = v.dim()
    h, size, stride = packed[0], list(packed[1:1 + n]), list(packed[1 + n:1 + 2 * n])
    return torch.ops.bagualu.unstash(h, size, stride, v.dtype, v.device)


def _graph_module(fn: Callable[[Any], Any]) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(fn, (x,)))
    return fx.GraphModule(nn.Module(), g)


PACK = _graph_module(_pack)
UNPACK = _graph_module(_unpack)

# -- recompute variants (issue 41 item 2) --------------------------------------------------
# A variant is a recompute set: the operators of a compiled block that its graphs recompute in
# the backward instead of saving. Each has its own pair of hook graph modules (the same
# functions): dynamo guards on the identity of the saved-tensor hooks in effect, so each
# variant's call of a block's code is its own cache entry, compiled once and hit from then on
# (no recompile per micro-batch). While a variant compiles, a joint-graph pass
# (``_tag_recompute``, chained before a user's ``joint_custom_pass``) tags the forward nodes of
# its operators MUST_RECOMPUTE: the partitioner saves their inputs instead and reruns them in
# the backward. The pairs live as long as the process, keyed by the set's operator names (a
# graph compiled for a set bakes it in).
_pairs: Dict[FrozenSet[str], Tuple[fx.GraphModule, fx.GraphModule]] = {
    frozenset(): (PACK, UNPACK)}


def hooks_of(variant: FrozenSet[str]) -> Tuple[fx.GraphModule, fx.GraphModule]:
    """The (pack, unpack) graph modules of recompute set ``variant``."""
    pair = _pairs.get(variant)
    if pair is None:
        pair = _pairs[variant] = (_graph_module(_pack), _graph_module(_unpack))
    return pair


def variant_limit() -> int:
    """The most compiled variants a block may have: half of dynamo's recompile limit per code
    object (each variant is one cache entry of the block's code, and each may recompile once
    more for automatic dynamic shapes)."""
    return max(1, int(torch._dynamo.config.recompile_limit) // 2)


def _forward_nodes(gm: fx.GraphModule) -> List[fx.Node]:
    """The joint graph's forward nodes: calls that depend on no tangent."""
    backward: Set[fx.Node] = set()
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            backward.add(n)
        elif any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        elif n.op == "call_function":
            out.append(n)
    return out


OnTagged = Callable[[FrozenSet[str], int], None]  # (variant, forward nodes tagged)


class _JointPass:
    """torch._functorch.config.joint_custom_pass while a variant compiles: tags its operators'
    forward nodes MUST_RECOMPUTE, tells ``on_tagged`` how many, then runs the user's pass
    (``then``) if any."""

    def __init__(self, variant: FrozenSet[str], then: Optional[Callable[..., Any]],
                 on_tagged: Optional[OnTagged] = None) -> None:
        self.variant = variant
        self.then = then
        self.on_tagged = on_tagged

    def __deepcopy__(self, memo: Dict[int, Any]) -> "_JointPass":
        """Itself: dynamo deep-copies torch._functorch.config to log each compile's metrics,
        and ``on_tagged`` reaches the runtime's native handles (ctypes pointers), which do
        not copy (dynamo logged that failure's traceback at ERROR on every variant's
        compile)."""
        return self

    def __call__(self, gm: fx.GraphModule, inputs: Any) -> fx.GraphModule:
        from torch.utils.checkpoint import CheckpointPolicy
        tagged = 0
        for n in _forward_nodes(gm):
            if op_name(_op_of(n)) in self.variant:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                n.meta["ac_graph_id"] = 1
                tagged += 1
        if self.on_tagged is not None:
            self.on_tagged(self.variant, tagged)
        return self.then(gm, inputs) if self.then is not None else gm


OnStash = Callable[..., None]  # (tensor, operator name or None[, received: bool])


class Frame:
    """One compiled block call with the stash hooks pushed (``with Frame(on_stash):``):
    remembers the saved-tensor hooks in effect outside it, which place what ``stash`` gets,
    and ``on_stash(t, operator name or None)``, which names the producer first
    (``on_stash(t, name, True)`` for the tensor whose rows a real EP dispatch received). Not
    thread-safe: the training thread."""

    __slots__ = ("on_stash", "outer", "mode", "dynamic", "variant", "on_tagged")

    def __init__(self, on_stash: Optional[OnStash], dynamic: bool = False,
                 variant: FrozenSet[str] = frozenset(),
                 on_tagged: Optional[OnTagged] = None) -> None:
        self.on_stash = on_stash
        # The recompute set of this call (its compiled variant; empty: plain compile's), and
        # who is told the nodes its joint pass tagged where the call compiles the variant.
        self.variant = variant
        self.on_tagged = on_tagged
        # Simulated expert parallelism: the local experts' tokens are data-dependent sizes
        # (nonzero), which dynamo captures only with capture_dynamic_output_shape_ops.
        self.dynamic = dynamic
        self.outer: Optional[Tuple[Any, Any]] = None
        self.mode: Any = None  # the ExitStack of the config patches and the hooks

    def pack(self, t: torch.Tensor, op: int, received: bool = False
             ) -> Tuple[Any, Optional[Callable[[Any], Any]]]:
        if self.outer is None:
            return t, None
        if self.on_stash is not None:
            if received:
                self.on_stash(t, op_name(op), True)
            else:
                self.on_stash(t, op_name(op))
        pack, unpack = self.outer
        return pack(t), unpack

    def __enter__(self) -> "Frame":
        self.outer = torch._functorch._aot_autograd.utils.top_saved_tensors_hooks()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(torch._functorch.config.patch(
                saved_tensors_hooks_filtering_mode="no_static"))
            stack.enter_context(_inductor_config().patch(inplace_buffers=False,
                                                         allow_buffer_reuse=False))
            if self.dynamic:
                stack.enter_context(torch._dynamo.config.patch(
                    capture_dynamic_output_shape_ops=True))
            if self.variant:
                stack.enter_context(torch._functorch.config.patch(
                    joint_custom_pass=_JointPass(self.variant,
                                                 torch._functorch.config.joint_custom_pass,
                                                 self.on_tagged)))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(
                *hooks_of(self.variant)))
        except BaseException:
            stack.close()
            raise
        self.mode = stack
        _frames.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if _frames and _frames[-1] is self:
            _frames.pop()
        self.mode.__exit__(*exc)


def _inductor_config() -> Any:
    """torch._inductor.config: inductor may write a kernel's output into a dead buffer of its
    graph (buffer reuse, in-place buffers). An unstashed tensor is such a buffer to inductor,
    but the core may still hold it (kept, the same storage as another saved view, the next
    layer's input): compiled with either on, the backward overwrote saved activations
    (gradients off by orders of magnitude). Off in the blocks' graphs only (the patch is in
    effect while they compile)."""
    import torch._inductor.config as config
    return config


def live_handles() -> int:
    """Saved tensors of compiled blocks whose handles autograd still holds (tests: none
    after a backward)."""
    return len(_handles)
