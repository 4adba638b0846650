"""Compiled blocks: which planned blocks run under torch.compile, and how each becomes one
operator whose entry and exit bagualu sees from outside the compiled region.

Dynamo traces every module hook that runs inside a compiled region, bagualu's included (the
scopes, producers and routers of capture/modules.py read storage pointers and call .item():
graph breaks, extra graphs, the recompile limit). So when the planned blocks are compiled,
their operator hooks are removed before the first compiled call and each block is entered and
left once, in eager:

- a block compiled in place (``block.compile()``, which sets nn.Module's
  ``_compiled_call_impl`` to the compiled ``_call_impl``: the block's own hooks run inside the
  compiled region) gets its ``_compiled_call_impl`` wrapped by ``_Entry``, which runs the
  block's enter and leave around the compiled call (restored at uninstall);
- a block wrapped by ``torch.compile(block)`` (an ``OptimizedModule`` in the block list, as
  torchtitan registers them) gets forward hooks on the wrapper, whose own hooks run in eager.

Per operator (``per_op``; torch 2.15 and later, the default): each compiled call runs inside a
``stash.Frame``, whose graph-module saved-tensor hooks put ``torch.ops.bagualu.stash`` and
``unstash`` into the block's graphs (capture/stash.py): every tensor the compiled graph saves is
named by the operator whose module computed it and placed by that operator's strategy for the
micro-batch (keep, offload, FP8), the layers keeping the eager block's operators. An operator
cannot be rerun alone inside a compiled graph: the planner is told none of them recomputes
(``recompute_allowed``) but those of install(compiled_recompute=)'s groups, each union of
groups a compiled variant of the blocks (stash.py) whose variant each block call picks from
the micro-batch's plan (``variant``, StashNotes.variant_of); the operators' times are the
block's, shared by the bytes each saves.
The routers' load is read where their saved expert indices are stashed (modules.py's
``_on_stash``): a downgrade places the rest of the running block's stashed tensors by the new
plan. Simulated expert parallelism restricts each block's stacked experts to this rank's
(``_local_experts_forward``), their token counts unbacked sizes in the graph (the frames turn
``capture_dynamic_output_shape_ops`` on while the blocks compile).

Per block (older torch, or ``compiled_operators="block"``): the compiled region is the operator
``block`` of its layer (kind ``other``): every tensor the compiled function hands autograd is
saved by it, at the end of its forward (Python saved-tensor hooks are not traced into a compiled
region; they run on the compiled function's saved tensors), and its strategy applies to all of
them: offload and FP8 move them after the forward, recompute reruns the compiled block
(recompute.py, RNG restored). Hooks that still run inside a
compiled region (a block compiled after the capture, a compiled module above the blocks) return
at once: ``eager_only``. Blocks compiled with CUDA graphs (``cuda_graphs``: mode
"reduce-overhead" or "max-autotune", inductor's triton.cudagraphs, the cudagraphs backend) are
refused in both forms (``refuse_cuda_graphs``). Not thread-safe: the training thread.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, FrozenSet, List, Optional, Tuple

import torch
from torch import nn

from ..discovery.find import Discovery, is_compiled_wrapper
from ..errors import BagualuError, InstrumentError
from ..vocabulary import SCALING_KINDS
from . import stash

log = logging.getLogger("bagualu")

IN_PLACE = "in place"    # block.compile()
WRAPPED = "wrapped"      # torch.compile(block) registered in the block list
Hook = Callable[..., Any]
Variant = Callable[[], FrozenSet[str]]  # a layer's recompute set for the call starting now


def eager_only(hook: Hook) -> Hook:
    """``hook`` where it runs in eager; a no-op where dynamo traces it (nothing of bagualu in
    the graph: no break, no guard on bagualu's state)."""
    def run(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            return None
        return hook(*args)
    return run


class _Entry:
    """A block's ``_compiled_call_impl`` with bagualu's enter and leave around it (and, per
    operator, the compiled call inside a stash frame)."""

    __slots__ = ("block", "compiled", "pre", "post", "on_stash", "dynamic", "variant",
                 "on_tagged")

    def __init__(self, block: nn.Module, compiled: Callable[..., Any], pre: Hook,
                 post: Hook, on_stash: Optional[stash.OnStash], dynamic: bool = False,
                 variant: Optional[Variant] = None,
                 on_tagged: Optional[stash.OnTagged] = None) -> None:
        self.block = block
        self.compiled = compiled
        self.pre = pre
        self.post = post
        self.on_stash = on_stash
        self.dynamic = dynamic
        self.variant = variant
        self.on_tagged = on_tagged

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.pre(self.block, args, kwargs)
        if self.on_stash is None:
            out = self.compiled(*args, **kwargs)
        else:
            v = self.variant() if self.variant is not None else frozenset()
            with stash.Frame(self.on_stash, self.dynamic, v, self.on_tagged):
                out = self.compiled(*args, **kwargs)
        self.post(self.block, args, out)
        return out


class _WrappedFrames:
    """The stash frames of a block wrapped by ``torch.compile`` (forward hooks on the wrapper:
    entered after bagualu's enter, left before its leave, also when the call raises)."""

    def __init__(self, on_stash: stash.OnStash, dynamic: bool = False,
                 variant: Optional[Variant] = None,
                 on_tagged: Optional[stash.OnTagged] = None) -> None:
        self.on_stash = on_stash
        self.dynamic = dynamic
        self.variant = variant
        self.on_tagged = on_tagged
        self.open: List[stash.Frame] = []

    def enter(self, m: nn.Module, args: Any, kwargs: Any) -> None:
        f = stash.Frame(self.on_stash, self.dynamic,
                        self.variant() if self.variant is not None else frozenset(),
                        self.on_tagged)
        f.__enter__()
        self.open.append(f)

    def leave(self, m: nn.Module, args: Any, out: Any) -> None:
        if self.open:
            self.open.pop().__exit__(None, None, None)


def _is_compiled(m: nn.Module) -> bool:
    return is_compiled_wrapper(m) or m.__dict__.get("_compiled_call_impl") is not None


_LINKS = ("_torchdynamo_orig_backend", "_torchdynamo_orig_callable", "_inner_convert")


def _backends(compiled: Any) -> List[Any]:
    """The backend objects behind ``compiled`` (an OptimizedModule, or the function
    ``block.compile()`` sets as ``_compiled_call_impl``): dynamo's callback chain, read through
    its links (``_LINKS``: torch 2.15's and 2.6's)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:  # the function: its get_compiler_config closes over the dynamo context
        get = getattr(compiled, "get_compiler_config", None)
        for cell in getattr(get, "__closure__", None) or ():
            try:
                if hasattr(cell.cell_contents, "callback"):
                    ctx = cell.cell_contents
                    break
            except ValueError:  # an empty cell
                continue
    out: List[Any] = []
    b = getattr(ctx, "callback", None)
    while b is not None and len(out) < 16 and all(b is not o for o in out):
        out.append(b)
        b = next((getattr(b, a) for a in _LINKS if getattr(b, a, None) is not None), None)
    return out


def cuda_graphs(compiled: Any) -> Optional[Tuple[str, str]]:
    """(the setting that asks for them, what to use instead) where ``compiled`` captures CUDA
    graphs, else None: inductor's ``triton.cudagraphs`` (``mode="reduce-overhead"`` or
    ``"max-autotune"``, the option, or inductor's global config) or dynamo's ``cudagraphs``
    backend."""
    inductor = None
    for b in _backends(compiled):
        name = getattr(b, "compiler_name", None)
        if name == "cudagraphs":
            return ("backend='cudagraphs'", "another backend (inductor's default mode, "
                    "aot_eager)")
        if name == "inductor" and isinstance(getattr(b, "config", None), dict):
            inductor = b.config  # the mode's and options' patches of inductor's config
    fix = ("mode='default' or 'max-autotune-no-cudagraphs', or "
           "options={'triton.cudagraphs': False}")
    if inductor is None:  # no inductor wrapper found: what the compiled object reports
        get = getattr(compiled, "get_compiler_config", None)
        try:
            config = get() if callable(get) else None
        except Exception:  # noqa: BLE001 - an unknown backend's: nothing to say
            config = None
        if isinstance(config, dict) and config.get("triton.cudagraphs"):
            return "inductor's triton.cudagraphs", fix
        return None
    if "triton.cudagraphs" not in inductor:
        import torch._inductor.config as inductor_config
        if inductor_config.triton.cudagraphs:
            return "torch._inductor.config.triton.cudagraphs = True", fix
        return None
    if not inductor["triton.cudagraphs"]:
        return None
    if inductor.get("max_autotune"):
        return "mode='max-autotune', which captures CUDA graphs", fix
    return "mode='reduce-overhead' or options={'triton.cudagraphs': True}", fix


class CompiledBlocks:
    """The compiled form of one instrumented model's planned blocks (see the module
    docstring). ``hooks(layer, module)`` gives the (pre, post) of a layer's block operator;
    ``drop_inner()`` removes the operator hooks inside the blocks."""

    def __init__(self, model: nn.Module, found: Discovery,
                 hooks: Callable[[int], Tuple[Hook, Hook]],
                 drop_inner: Callable[[], None], simulated_ep: bool,
                 on_stash: Optional[Callable[[int], stash.OnStash]] = None,
                 variant: Optional[Callable[[int], Variant]] = None,
                 on_tagged: Optional[stash.OnTagged] = None) -> None:
        self.model = model
        self.found = found
        self.hooks = hooks
        self.drop_inner = drop_inner
        self.simulated_ep = simulated_ep
        # Per operator when given (the layer's on_stash) and torch can (capture/stash.py).
        self.on_stash = on_stash if on_stash is not None and stash.supported() else None
        self.unsupported = on_stash is not None and self.on_stash is None
        # Per operator with recompute groups: each layer's variant, picked per call, and
        # who is told the nodes each variant's joint pass tagged (stash.Frame).
        self.variant = variant
        self.on_tagged = on_tagged
        self.form: Optional[str] = None            # of every planned block (None: eager)
        self.seen: Optional[List[Optional[str]]] = None  # the forms the capture planned
        self.handles: List[Any] = []
        self.entries: List[Tuple[nn.Module, Callable[..., Any]]] = []  # block, its compiled

    @property
    def active(self) -> bool:
        """Whether the planned blocks are compiled."""
        return self.form is not None

    @property
    def per_op(self) -> bool:
        """Whether the compiled blocks keep their operators (stash ops; else one each)."""
        return self.form is not None and self.on_stash is not None

    def forms(self) -> List[Optional[str]]:
        """The compiled form of each planned block now."""
        out: List[Optional[str]] = []
        for bi in self.found.planned:
            block = self.found.blocks[bi]
            entry = self.found.entry(bi)
            if entry is not block and is_compiled_wrapper(entry):
                out.append(WRAPPED)
            elif block.__dict__.get("_compiled_call_impl") is not None:
                out.append(IN_PLACE)
            else:
                out.append(None)
        return out

    def refuse_cuda_graphs(self) -> None:
        """InstrumentError when a planned block is compiled with CUDA graphs (at instrument for
        blocks compiled before it, else at the first forward): the activations a replayed
        graph saves stay at the addresses its capture gave them, in its own memory pool, so
        neither a stash (per operator) nor the block's placement (per block) can offload, cast
        or rerun them, and bagualu's CUDA allocator (a CUDAPluggableAllocator) has no graph
        pools for cudagraph trees. Refused on every device (on CPU inductor skips CUDA graphs,
        but a CPU dry run should refuse what the GPU run would)."""
        using: List[Tuple[int, Tuple[str, str]]] = []
        for bi in self.found.planned:
            entry = self.found.entry(bi)
            block = self.found.blocks[bi]
            if entry is not block and is_compiled_wrapper(entry):
                compiled: Any = entry
            else:
                compiled = block.__dict__.get("_compiled_call_impl")
                if isinstance(compiled, _Entry):
                    compiled = compiled.compiled
            how = cuda_graphs(compiled) if compiled is not None else None
            if how is not None:
                using.append((bi, how))
        if not using:
            return
        blocks = [bi for bi, _ in using]
        how, fix = using[0][1]
        raise InstrumentError(
            f"block{'s' if len(blocks) > 1 else ''} {', '.join(map(str, blocks))} of "
            f"{self.found.layers_path} {'are' if len(blocks) > 1 else 'is'} compiled with CUDA "
            f"graphs ({how}): bagualu cannot place the activations of a graph that CUDA "
            "replays (a replay reruns no stash, and its saved tensors stay where the capture "
            "put them, in a graph memory pool bagualu's CUDA allocator does not provide), "
            "neither per operator nor with install(compiled_operators='block'); compile the "
            f"blocks without CUDA graphs: {fix}")

    def refresh(self) -> bool:
        """Before every forward: the first (the capture) installs the entries of compiled
        blocks and says whether they are (True: each block is one operator now); later the
        forms may not change (the planner's graph was made at the capture's granularity)."""
        forms = self.forms()
        if self.seen is not None:
            if forms != self.seen:
                changed = [self.found.planned[i] for i, (a, b) in
                           enumerate(zip(forms, self.seen)) if a != b]
                raise BagualuError(
                    f"blocks {changed} of {self.found.layers_path} were compiled (or no longer "
                    "are) after bagualu's capture, the first forward, which planned them "
                    f"{'as one operator each' if self.form else 'by their operators'}: compile "
                    "the blocks before the first forward, or install() and instrument() again")
            if self.form == IN_PLACE:
                self._rewrap()
            return False
        self._check_above()
        self.refuse_cuda_graphs()
        self.seen = forms
        kinds = set(forms)
        if len(kinds) > 1:
            eager = [self.found.planned[i] for i, f in enumerate(forms) if f is None]
            raise InstrumentError(
                f"blocks {eager} of {self.found.layers_path} are not compiled and the other "
                "planned blocks are: the planner's layers share one operator graph; compile "
                "every block or none")
        form = forms[0] if forms else None
        if form is None:
            return False
        if self.simulated_ep and self.on_stash is None:
            raise InstrumentError(
                "instrument(expert_parallel=N) with compiled blocks needs them planned per "
                "operator (install(compiled_operators='operators'), torch 2.15 or later): the "
                "routers' load is read where their saved indices are stashed; per block, use "
                "real expert parallelism, or local_experts= for a model that computes only its "
                "own experts")
        self.form = form
        self.drop_inner()
        if self.on_stash is not None:
            stash.name_operators({s.path: s.name for sites in self.found.sites for s in sites},
                                 [n for n, k in self.found.kinds.items() if k in SCALING_KINDS])
        for li, bi in enumerate(self.found.planned):
            pre, post = self.hooks(li)
            on_stash = self.on_stash(li) if self.on_stash is not None else None
            if form == WRAPPED:
                wrapper = self.found.entry(bi)
                self.handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
                if on_stash is not None:
                    frames = _WrappedFrames(on_stash, self.simulated_ep, self._variant(li),
                                            self.on_tagged)
                    self.handles.append(wrapper.register_forward_pre_hook(frames.enter,
                                                                          with_kwargs=True))
                    self.handles.append(wrapper.register_forward_hook(frames.leave,
                                                                      always_call=True))
                self.handles.append(wrapper.register_forward_hook(post))
            else:
                block = self.found.blocks[bi]
                compiled = block.__dict__["_compiled_call_impl"]
                block._compiled_call_impl = _Entry(block, compiled, pre, post, on_stash,
                                                   self.simulated_ep, self._variant(li),
                                                   self.on_tagged)
                self.entries.append((block, compiled))
        if self.per_op:
            log.info("bagualu: the %d planned blocks of %s are compiled (%s): their saved "
                     "tensors are placed per operator (torch.ops.bagualu.stash); %s; routers' "
                     "load factors are read where their saved indices are stashed", len(forms),
                     self.found.layers_path, form,
                     "no operator inside them is recomputed alone" if self.variant is None
                     else "the recompute groups' operators are recomputed through compiled "
                     "variants, one picked per block call")
        elif self.unsupported:
            log.warning("bagualu: the %d planned blocks of %s are compiled (%s) and torch %s "
                        "cannot place their saved tensors per operator (it needs torch 2.15's "
                        "saved-tensor hook context): each block is one operator ('block')",
                        len(forms), self.found.layers_path, form, torch.__version__)
        else:
            log.info("bagualu: the %d planned blocks of %s are compiled (%s): each is one "
                     "operator ('block'); routers' load factors are not observed inside them",
                     len(forms), self.found.layers_path, form)
        return True

    def _variant(self, layer: int) -> Optional[Variant]:
        """Layer ``layer``'s variant picker (None: no recompute groups)."""
        if self.variant is None or self.on_stash is None:
            return None
        return self.variant(layer)

    def _rewrap(self) -> None:
        """A block compiled in place again (block.compile() once more) gets its entry back."""
        for i, bi in enumerate(self.found.planned):
            block = self.found.blocks[bi]
            impl = block.__dict__.get("_compiled_call_impl")
            if not isinstance(impl, _Entry):
                pre, post = self.hooks(i)
                on_stash = self.on_stash(i) if self.on_stash is not None else None
                block._compiled_call_impl = _Entry(block, impl, pre, post, on_stash,
                                                   self.simulated_ep, self._variant(i),
                                                   self.on_tagged)
                self.entries[i] = (block, impl)

    def _check_above(self) -> None:
        """A compiled module that holds the planned blocks traces them whole: nothing of a
        block would be seen from outside its compiled region."""
        planned = {self.found.blocks[bi] for bi in self.found.planned}
        for name, m in self.model.named_modules():
            if m in planned or not _is_compiled(m) or \
                    (is_compiled_wrapper(m) and m._orig_mod in planned):
                continue
            if any(b in planned for b in m.modules()):
                raise InstrumentError(
                    f"'{name or type(m).__name__}' is compiled and holds the planned blocks of "
                    f"{self.found.layers_path}: bagualu plans compiled blocks one by one; "
                    "compile each block (block.compile() or torch.compile(block)), not the "
                    "model")

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for block, compiled in self.entries:
            if isinstance(block.__dict__.get("_compiled_call_impl"), _Entry):
                block._compiled_call_impl = compiled
        self.entries.clear()
        self.form = None
