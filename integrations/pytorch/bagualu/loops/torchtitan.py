"""bagualu as torchtitan's activation memory manager, through torchtitan's own configuration
(docs/torchtitan.md): a ``Trainer`` subclass whose config adds a ``bagualu`` section, and
config functions named like torchtitan's (``bagualu.torchtitan``'s module-level lookup) that
return torchtitan's config with this trainer and that section.

    torchrun --nproc-per-node 2 -m torchtitan.train --module bagualu.torchtitan \\
        --config deepseek_v3_debugmodel --bagualu.capacity 512MiB

What the trainer does, with no change to torchtitan's files:
- installs bagualu once the process group exists and before the model is built
  (``init_distributed``): capacity, policy and governor from ``--bagualu.*``, the pipeline
  rank, stages and micro-batches from torchtitan's parallelism;
- instruments each model part after torchtitan parallelized it: its decoder blocks (the
  planned layers: the longest run of blocks of one structure, e.g. DeepSeek-V3's MoE blocks
  after its dense first one), attention, router, grouped experts, shared experts (the
  operator kinds torchtitan's module names need are given here, ``TORCHTITAN_OPS``); under
  expert parallelism the load factor comes from the token dispatcher's output
  (``moe.routed_experts.token_dispatcher.dispatch``: the tokens the all-to-all delivered);
- plans at every scheduling point: under pipeline parallelism torchtitan's schedule is wrapped
  by ``bagualu.pipelining.wrap_schedule`` (1F1B, GPipe; Interleaved1F1B with the rank's
  stages as bagualu's chunks, each stage's blocks one chunk's layers), without
  it every gradient-accumulation micro-batch is one forward and one backward of
  ``bagualu.micro_batches``.
torchtitan's activation checkpointing is off in the configs returned here (bagualu plans
recompute itself); ``activation-checkpoint:selective`` etc. on the command line turn it back on.
With ``--compile.enable --compile.components model`` torchtitan compiles each decoder block in
place: bagualu plans each compiled block as one operator (docs/pytorch.md, "Compiled blocks"),
and its own hooks on torchtitan's FSDP2 units run outside dynamo (``_fsdp_units``).

Imports torchtitan: load it only where torchtitan is installed. Not thread-safe: torchtitan's
training thread.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torchtitan.trainer import Trainer
from .. import api as bagualu
from .. import errors
from . import pipelining
from .accumulate import micro_batches

log = logging.getLogger("bagualu")

# torchtitan's module names -> the planner's operator kinds, where discovery's guess needs
# help: GroupedExperts holds the routed experts' stacked weights; the router's gate is part of
# the router operator (TokenChoiceTopKRouter, which knows num_experts and top_k).
# The leading '*' also matches inside torchtitan's activation-checkpoint wrapper
# ('_checkpoint_wrapped_module.moe...').
TORCHTITAN_OPS = {
    "*moe.routed_experts.inner_experts": "expert_linear",
    "*moe.router.gate": "none",
}
DISPATCH = "*moe.routed_experts.token_dispatcher.dispatch"


@dataclass(kw_only=True, slots=True)
class BagualuConfig:
    """The ``[bagualu]`` section: ``--bagualu.capacity 512MiB --bagualu.policy bagualu``."""

    capacity: str = ""
    """Activation memory per rank (a size: '512MiB', '40GiB'); required."""

    policy: str = "bagualu"
    """keep-all, static-under, static-over or bagualu (docs/pytorch.md, 'Policies')."""

    governor: str = ""
    """The node daemon's address; '' = $BGL_GOVERNOR or its default socket, 'none' = the
    embedded planner only."""

    issue_order: str = "dual-batch"
    """The plans' issue order: dual-batch or serial."""

    allow_fp8: bool = True
    """Whether plans may store activations in FP8 (False: training stays bit for bit what
    torchtitan computes; offload and recompute are exact)."""

    log_iterations: bool = True
    """Log bagualu's line per training step on every rank."""

    compiled_operators: str = "block"
    """With --compile.enable: 'block' (each compiled block one operator) or 'operators' (each
    saved tensor placed by its own operator: install's compiled_operators). 'block' by
    default: per operator, torchtitan's compiled DeepSeek-V3 blocks under expert parallelism
    save the process group for their backward, which torch's inlined saved-tensor hooks lose
    (refused naming it; docs/torchtitan.md)."""

    compiled_recompute: Optional[str] = None
    """With --compile.enable and --bagualu.compiled_operators operators: the operators of a
    compiled block that may be recomputed (install's compiled_recompute): None (none alone),
    'auto' (the experts' operators, one group), or groups of operator names, the groups
    separated by ',' and a group's operators joined by '+' ('moe.experts,attention+norm': two
    groups). Each union of groups is one compiled variant of the blocks (docs/torchtitan.md,
    "Compiled blocks")."""

    min_load_factor: Optional[float] = None
    """Policy bagualu: every point plans for at least this load factor, in [1, 64] (a worst
    load known in advance; install's min_load_factor). None: the recent forwards' median."""


def recompute_groups(value: Optional[str]) -> Any:
    """``--bagualu.compiled_recompute``'s value as install's ``compiled_recompute``: None,
    'auto', or a tuple of groups ('a+b,c' -> (('a', 'b'), ('c',))). PolicyError naming the
    flag on a value of no group or with an empty group or operator name (the names are
    checked against the model's operators at instrument)."""
    if value is None or value == "auto":
        return value
    groups = tuple(tuple(g.split("+")) for g in value.split(","))
    if not value.strip() or any(not n.strip() or n != n.strip() for g in groups for n in g):
        raise errors.PolicyError(
            f"--bagualu.compiled_recompute: {value!r} is neither None, 'auto' nor groups of "
            "operator names (groups separated by ',', a group's operators joined by '+', no "
            "empty name or space: 'moe.experts,attention+norm')")
    return groups


def check_config(cfg: BagualuConfig) -> None:
    """Refuses a bad ``[bagualu]`` value before anything is built, naming its flag
    (``--bagualu.capacity: ...``); torchtitan's parser (tyro) already refuses unknown keys and
    values of the wrong type. ValueError (PolicyError for the named choices)."""
    from .. import settings
    if not cfg.capacity:
        raise ValueError("--bagualu.capacity: required (the activation memory per rank, e.g. "
                         "512MiB)")
    if settings.parse_size(cfg.capacity, "--bagualu.capacity") <= 0:
        raise ValueError(f"--bagualu.capacity: must be above 0, got {cfg.capacity!r}")
    checks: List[Tuple[str, Callable[[str], str], str]] = [
        ("policy", settings.check_policy, cfg.policy),
        ("issue_order", settings.check_issue_order, cfg.issue_order),
        ("compiled_operators", settings.check_compiled_operators, cfg.compiled_operators)]
    for key, check, value in checks:
        try:
            check(value)
        except errors.PolicyError as e:
            raise errors.PolicyError(f"--bagualu.{key}: {e}") from None
    settings.check_governor_address(cfg.governor, "--bagualu.governor")
    try:
        settings.check_min_load_factor(cfg.min_load_factor, cfg.policy)
    except errors.PolicyError as e:
        raise errors.PolicyError(f"--bagualu.{e}") from None
    recompute_groups(cfg.compiled_recompute)
    if cfg.compiled_recompute is not None and cfg.compiled_operators != "operators":
        raise errors.PolicyError(
            f"--bagualu.compiled_recompute: {cfg.compiled_recompute!r} needs "
            f"--bagualu.compiled_operators operators (it is {cfg.compiled_operators!r}: each "
            "compiled block one operator, recomputed whole or not at all)")


class BagualuTrainer(Trainer):
    """torchtitan's Trainer with bagualu managing activation memory (module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        bagualu: BagualuConfig = field(default_factory=BagualuConfig)

    def __init__(self, config: "BagualuTrainer.Config") -> None:
        self._bgl_loop: Optional[Any] = None
        super().__init__(config)
        pp = self.parallel_dims.pp_enabled
        ep = self.parallel_dims.ep_enabled
        parts = self.model_parts
        if pp and len(parts) > 1:  # in stage order (the adapter's chunk order)
            stages = sorted(self.pp_schedule._stages, key=lambda st: st.stage_index)
            parts = [st.submod for st in stages]
        if len(parts) != self._bgl_chunks:
            raise bagualu.BagualuError(
                f"bagualu.torchtitan: {len(parts)} model parts on this rank, bagualu was "
                f"installed for {self._bgl_chunks} (from torchtitan's pipeline config)")
        # Several stages per rank (Interleaved1F1B): the rank's parts in stage order are
        # bagualu's chunks, each part's blocks one chunk's layers.
        model = parts[0] if len(parts) == 1 else torch.nn.ModuleList(parts)
        layers: Any = "layers" if len(parts) == 1 else \
            [f"{i}.layers" for i in range(len(parts))]
        try:
            bagualu.instrument(model, {"name": f"torchtitan-{config.model_spec.name}"},
                               layers=layers, ops=dict(TORCHTITAN_OPS),
                               dispatch=DISPATCH if ep else None)
        except errors.InstrumentError as e:
            if str(e).startswith("compiled_recompute:"):  # groups naming no operator etc.
                raise errors.InstrumentError(f"--bagualu.{e}") from None
            raise
        rt = bagualu.current()
        _compiled_now(rt)
        self._bgl_handles = _fsdp_units(rt, model, ep)
        if pp:
            self.pp_schedule = pipelining.wrap_schedule(self.pp_schedule)
        log.info("bagualu: managing torchtitan's activations (%s, %s, policy %s)",
                 f"pipeline rank {self._bgl_stage[0]} of {self._bgl_stage[1]}, "
                 f"{len(parts)} stage(s) on it" if pp
                 else f"{self._bgl_micro_batches} micro-batches per step",
                 "expert parallel" if ep else "no expert parallelism",
                 config.bagualu.policy)

    # -- before the model is built ----------------------------------------------------------
    def init_distributed(self) -> Any:
        cfg: BagualuConfig = self.config.bagualu
        check_config(cfg)  # before torchtitan starts the process group
        parallel_dims = super().init_distributed()
        training, parallelism = self.config.training, self.config.parallelism
        chunks = 1
        if parallel_dims.pp_enabled:
            stages = parallel_dims.pp
            rank = parallel_dims.get_mesh("pp").get_local_rank()
            micro_batches = training.local_batch_size // \
                parallelism.pipeline_parallel_microbatch_size
            chunks = _stages_per_rank(parallel_dims, parallelism, self.config)
        else:
            stages, rank = 1, 0
            degree = parallel_dims.dp_replicate * parallel_dims.dp_shard
            global_batch = training.global_batch_size
            if global_batch < 0:
                global_batch = training.local_batch_size * degree
            micro_batches = max(global_batch // (training.local_batch_size * degree), 1)
        self._bgl_stage = (rank, stages)
        self._bgl_chunks = chunks
        self._bgl_micro_batches = micro_batches
        # Every rank of this torchrun job is one job on the node's daemon.
        if "TORCHELASTIC_RUN_ID" in os.environ:
            os.environ.setdefault("BGL_JOB_ID",
                                  "torchtitan-" + os.environ["TORCHELASTIC_RUN_ID"])
        device = torch.device(f"cuda:{torch.cuda.current_device()}") \
            if torch.cuda.is_available() else torch.device("cpu")
        bagualu.install(capacity=cfg.capacity, policy=cfg.policy,
                        governor=cfg.governor or None, device=str(device),
                        pipeline_rank=rank, pipeline_stages=stages,
                        micro_batches=micro_batches, chunks=chunks,
                        issue_order=cfg.issue_order, allow_fp8=cfg.allow_fp8,
                        log_iterations=cfg.log_iterations,
                        compiled_operators=cfg.compiled_operators,
                        compiled_recompute=recompute_groups(cfg.compiled_recompute),
                        min_load_factor=cfg.min_load_factor)
        return parallel_dims

    # -- the steps --------------------------------------------------------------------------
    def train_step(self, data_iterator: Any) -> Any:
        if self.parallel_dims.pp_enabled:
            return super().train_step(data_iterator)  # the wrapped schedule plans each step
        self._bgl_loop = iter(micro_batches(self._bgl_micro_batches))
        try:
            out = super().train_step(data_iterator)
            for _ in self._bgl_loop:  # every micro-batch ran: this ends the iteration
                raise bagualu.BagualuError("bagualu.torchtitan: fewer forward-backward "
                                           "calls than micro-batches in a step")
        finally:
            self._bgl_loop = None
        return out

    def _forward_backward_body(self, inputs: torch.Tensor, labels: torch.Tensor,
                               global_valid_tokens: torch.Tensor,
                               extra_kwargs: Dict[str, Any]) -> torch.Tensor:
        """torchtitan's forward, loss and backward of one micro-batch, the forward (with the
        loss) inside bagualu's forward context and the backward inside its backward one."""
        if self._bgl_loop is None:
            raise bagualu.BagualuError("bagualu.torchtitan: a forward-backward outside "
                                       "train_step")
        mb = next(self._bgl_loop)
        loss_kwargs = {"positions": extra_kwargs["positions"]} \
            if "positions" in extra_kwargs else {}
        with self.train_context():
            with mb.forward():
                pred = self.model_parts[0](inputs, **extra_kwargs)
                loss, _ = self.loss_fn(pred, labels, global_valid_tokens, **loss_kwargs)
                del pred
            with mb.backward(), _no_typecheck():
                loss.backward()
        return loss

    def close(self) -> None:
        super().close()
        for h in getattr(self, "_bgl_handles", []):
            h.remove()
        from ..runtime import active
        if active() is not None:
            st = bagualu.stats()
            log.info("bagualu: done: planned by the %s planner (job %s)",
                     st["governor"] or "embedded", st["job_id"])
            rec = st.get("compiled", {}).get("recompute", {})
            if rec.get("groups"):
                log.info("bagualu: compiled recompute: groups %s, block calls per variant %s, "
                         "operators recomputed %d, nodes tagged per variant %s", rec["groups"],
                         rec["calls"], rec["operators_recomputed"], rec["tagged"])
        bagualu.uninstall()


def _stages_per_rank(parallel_dims: Any, parallelism: Any, config: Any) -> int:
    """The pipeline stages torchtitan will put on each rank (bagualu's chunks), as its
    pipeline_llm counts them: the explicit module split's parts over the ranks, else its
    metadata (2 per rank for a multi-stage schedule, or from the layers per stage)."""
    parts = parallelism.module_fqns_per_model_part
    if parts:
        total = len(parts)
    else:
        from torchtitan.distributed.pipeline_parallel import _get_pipeline_metadata
        total = _get_pipeline_metadata(parallel_dims, parallelism, config.model_spec.model)[0]
    return max(total // parallel_dims.pp, 1)


def _compiled_now(rt: Any) -> None:
    """torchtitan compiled the blocks before they are instrumented (``--compile.enable``):
    bagualu's compiled form of them (each block one operator, its inner operator hooks
    removed; capture/compiled.py) is set up now instead of at the first forward under
    bagualu, as the runtime's forward does it. Under PP torchtitan's pipeline stages run a
    forward before that one, outside bagualu's (the stage's metadata inference): that
    forward compiles the blocks, and with bagualu's inner hooks still on them dynamo guarded
    on them and compiled each block once more after their removal (one graph more per block
    structure and rank than torchtitan's own compiled run). Eager blocks: nothing changes."""
    auto = rt.auto
    if auto is not None and auto.before_forward():
        rt.layer_ops = auto.layer_ops()


def _fsdp_units(rt: Any, model: torch.nn.Module, expert_parallel: bool) -> List[Any]:
    """What torchtitan's FSDP2 units need beyond bagualu's FSDP2 support, returns the hooks:

    - Under expert parallelism the experts' weights are DTensors (sharded over the EP mesh)
      that FSDP2 all-gathers into new storages before each forward of their unit, and
      GroupedExperts saves views of their ``to_local()`` tensors (plain tensors, which the
      tracker's parameter check by type does not see): while a unit's forward runs, the local
      storages of its parameters are parameters' (``tracker.param_keys``), never activations.
    - An operator inside an FSDP2 unit of its own within a block (torchtitan shards the
      routed experts on their own mesh under EP) gets its parameters gathered at that unit's
      pre-backward, which can come after the block's backward needs its rerun: it is never
      recomputed (kept, or offloaded/cast as planned). So are the routed experts under expert
      parallelism: their gathered weights are still DTensors (sharded over the EP mesh), which
      the FSDP2 readiness check (discovery/sharding.py, Sharding.ready) takes for FSDP2's
      shards, so it refuses their rerun.

    Under ``--compile.enable`` torchtitan compiles each block in place (``block.compile``)
    before ``fully_shard``: the hooks of an FSDP2 unit that is a block run inside the compiled
    ``_call_impl``, where dynamo would compile each hook as a frame of its own (``fullgraph``:
    an error at the storages' ``nbytes``). They are dynamo-disabled, as FSDP2's own hooks are:
    they run in eager at the same place (after FSDP2's unshard, before its reshard), and dynamo
    traces nothing of them (no graph, no graph break)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    keys = rt.tracker.param_keys
    handles: List[Any] = []
    held: Dict[int, List[int]] = {}

    def storages(m: torch.nn.Module) -> List[int]:
        out = []
        for p in m.parameters():
            t = p.to_local() if isinstance(p, DTensor) else p
            try:
                st = t.untyped_storage()
                if st.nbytes() > 0:
                    out.append(st.data_ptr())
            except RuntimeError:
                continue
        return out

    def pre(m: torch.nn.Module, args: Any) -> None:
        ptrs = [k for k in storages(m) if k not in keys]
        keys.update(ptrs)
        held[id(m)] = ptrs

    def post(m: torch.nn.Module, args: Any, out: Any) -> None:
        keys.difference_update(held.pop(id(m), ()))

    pre_hook, post_hook = torch.compiler.disable(pre), torch.compiler.disable(post)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            handles.append(m.register_forward_pre_hook(pre_hook))
            handles.append(m.register_forward_hook(post_hook))
    auto = rt.auto
    if auto is not None:
        for li, sites in enumerate(auto.found.sites):
            block = auto.found.blocks[auto.found.planned[li]]
            units = [p for p, m in block.named_modules() if p and isinstance(m, FSDPModule)]
            for site in sites:
                if any(site.path == u or site.path.startswith(u + ".") for u in units) or \
                        (expert_parallel and site.kind in ("expert_linear", "expert_activation")):
                    auto.calls.no_replay.add(site.name)
    return handles


def _no_typecheck() -> Any:
    """torchtitan runs the backward outside spmd_types' type checks; the same here."""
    import spmd_types as spmd
    return spmd.no_typecheck()


def bagualu_config(base: Trainer.Config) -> BagualuTrainer.Config:
    """``base`` (any torchtitan trainer config) with BagualuTrainer and a ``bagualu`` section;
    torchtitan's activation checkpointing off."""
    values = {f.name: getattr(base, f.name) for f in dataclasses.fields(base) if f.init}
    values["activation_checkpoint"] = None
    return BagualuTrainer.Config(**values)


def _registry_function(name: str) -> Optional[Callable[[], Trainer.Config]]:
    """torchtitan's config function ``name`` from the model packages' config registries."""
    from torchtitan.models import _supported_models
    for model in sorted(_supported_models):
        try:
            module = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


def config_function(name: str) -> Callable[[], BagualuTrainer.Config]:
    """The config function ``--module bagualu.torchtitan --config NAME`` calls: torchtitan's
    ``NAME`` (e.g. deepseek_v3_debugmodel, qwen3_moe_debug) through ``bagualu_config``."""
    fn = _registry_function(name)
    if fn is None:
        raise AttributeError(f"bagualu.torchtitan: torchtitan has no config function '{name}' "
                             "(see torchtitan/models/*/config_registry.py)")

    def config() -> BagualuTrainer.Config:
        return bagualu_config(fn())

    config.__name__ = name
    return config


