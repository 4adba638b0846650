"""Unmodified MoE models for bagualu's tests and benchmarks, and a training loop that runs one of
them as stage 0 of a pipeline (in one process: the points of ``one_f_one_b(n, stages, 0)`` over
the whole model) with or without bagualu.

Models, built from small configs with random weights (no download):
- ``mixtral``, ``qwen3_moe``, ``deepseek_v3``, ``qwen2_moe``: Hugging Face transformers' own
  classes, as they are (stacked expert weights in transformers 5, an nn.ModuleList of experts
  in 4.x; Qwen2-MoE adds a shared expert scaled by a sigmoid gate of its own);
- ``fused``: a plain nn.Module MoE written here in another style than the example's OpBlock
  model: fused QKV and grouped expert weights in one parameter, attention as functional calls
  in the block's own forward, dropout, its own top-k routing, and expert parallelism of its
  own (it computes only the experts of its EP rank, like a real EP layer).

    python unmodified.py --model mixtral --policy all    # keep-all vs bagualu at half the peak
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("mixtral", "qwen3_moe", "deepseek_v3", "fused")  # the tests' and tests/gpu's
# Every model build() makes: Qwen2-MoE is one of the same-capacity table's models
# (docs/benchmarks/same-capacity.md), not yet checked where MODELS are.
ALL_MODELS = MODELS + ("qwen2_moe",)


# -- a plain nn.Module MoE (not written for bagualu) ------------------------------------------
class FusedRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.scale, 1e-6)


class GroupedExperts(nn.Module):
    """The experts of one EP rank as two stacked weights; tokens for other ranks' experts are
    not computed here (another GPU's work)."""

    def __init__(self, experts: int, dim: int, hidden: int, ep_size: int, ep_rank: int) -> None:
        super().__init__()
        self.n_experts = experts
        self.local = range(ep_rank * experts // ep_size, (ep_rank + 1) * experts // ep_size)
        n = len(self.local)
        self.w_in = nn.Parameter(torch.randn(n, dim, 2 * hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(n, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j, e in enumerate(self.local):
            token, slot = torch.nonzero(idx == e, as_tuple=True)
            if token.numel() == 0:
                continue
            h = x.index_select(0, token) @ self.w_in[j]
            a, b = h.chunk(2, dim=-1)
            y = (F.gelu(a) * b) @ self.w_out[j]
            out = out.index_add(0, token, y * weights[token, slot].unsqueeze(-1))
        return out


class FusedBlock(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int, top_k: int, hidden: int,
                 ep_size: int, ep_rank: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.top_k, self.dropout = heads, top_k, dropout
        self.ln1 = FusedRMSNorm(dim)
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ln2 = FusedRMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, hidden, ep_size, ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(self.ln1(x)).view(b, s, 3, self.heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        att = F.dropout(att, self.dropout, self.training)
        x = x + self.wo(att.transpose(1, 2).reshape(b, s, d))
        h = self.ln2(x).reshape(b * s, d)
        probs = torch.softmax(self.router(h), dim=-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        return x + self.experts(h, weights / weights.sum(-1, keepdim=True), idx).view(b, s, d)


class FusedMoE(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 3, heads: int = 4,
                 experts: int = 16, top_k: int = 4, hidden: int = 64, ep_size: int = 4,
                 ep_rank: int = 0, dropout: float = 0.1) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(FusedBlock(dim, heads, experts, top_k, hidden, ep_size,
                                               ep_rank, dropout) for _ in range(layers))
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> Any:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x)
        logits = self.out(x)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


# -- Hugging Face models from small configs ---------------------------------------------------
def build(name: str, seed: int = 0, layers: int = 3, ep_size: int = 4, width: int = 1
          ) -> nn.Module:
    """A small model, random weights; the same seed gives the same weights (``ep_size``: the
    plain model's own expert parallelism; ``width``: hidden and expert sizes times this)."""
    torch.manual_seed(seed)
    w = width
    if name == "fused":
        return FusedMoE(layers=layers, ep_size=ep_size, dim=64 * w, hidden=64 * w)
    import transformers as tf
    common = dict(vocab_size=128, hidden_size=64 * w, intermediate_size=96 * w,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  num_hidden_layers=layers, attn_implementation="sdpa")
    if name == "mixtral":
        cfg = tf.MixtralConfig(**common, num_local_experts=16, num_experts_per_tok=4)
        model = tf.MixtralForCausalLM(cfg)
    elif name == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_experts=16, num_experts_per_tok=4,
                                moe_intermediate_size=64 * w, decoder_sparse_step=1,
                                head_dim=16 * w)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif name == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, num_experts=16, num_experts_per_tok=4,
                                moe_intermediate_size=64 * w, decoder_sparse_step=1,
                                shared_expert_intermediate_size=96 * w)
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif name == "deepseek_v3":
        common.update(num_key_value_heads=4, num_hidden_layers=layers + 1)
        cfg = tf.DeepseekV3Config(**common, moe_intermediate_size=48 * w, n_routed_experts=16,
                                  num_experts_per_tok=4, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=4, topk_group=2,
                                  q_lora_rank=32 * w, kv_lora_rank=16 * w,
                                  qk_rope_head_dim=8 * w, qk_nope_head_dim=8 * w,
                                  v_head_dim=16 * w)
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model '{name}' (known: {', '.join(ALL_MODELS)})")
    model.train()
    return model


def instrument_kwargs(name: str) -> Dict[str, Any]:
    """How this process stands for EP rank 0 of 4 in each model."""
    if name == "fused":
        return {"local_experts": list(range(4))}  # the model computes only these
    return {"expert_parallel": 4}                # bagualu skips the other ranks' experts


def batches(n: int, seed: int = 1, batch: int = 2, seq: int = 32, vocab: int = 128,
            spike_every: int = 0, spike_tokens: Optional[Sequence[int]] = None
            ) -> List[torch.Tensor]:
    """Token batches; every ``spike_every``-th repeats few tokens (``spike_tokens``, one per
    sequence in turn; default: random ones of the first four), so routing skews (a spike at
    some EP rank) and the load factor moves away from the capture's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if spike_every and i % spike_every == spike_every - 1:
            if spike_tokens:
                rows = [spike_tokens[j % len(spike_tokens)] for j in range(batch)]
                t = torch.tensor(rows).view(batch, 1).expand(batch, seq).contiguous()
            else:
                t = torch.randint(0, 4, (batch, seq), generator=g)
        else:
            t = torch.randint(0, vocab, (batch, seq), generator=g)
        out.append(t)
    return out


_SPIKES: Dict[Tuple[str, int, int, int, int], Tuple[int, List[int], List[float]]] = {}


def spike_rank(name: str, model: nn.Module, seed: int, width: int, seq: int,
               ep_size: int = 4) -> Tuple[int, List[int], List[float]]:
    """Where a routing spike lands: the EP rank (experts split evenly and in order, as
    ``expert_parallel`` splits them) and the two tokens that, each repeated over a sequence,
    send the most of their top-k choices to that rank's experts, summed over the layers; and
    the load factor per layer of a batch of them (1.0: balance). Measured on the model itself
    (every token alone through it, its routers' top-k), so the spike is what this model does
    with such a batch, not a number set here. Cached per model (its name, seed, width and
    number of layers: a model of other layers routes otherwise) and sequence length."""
    key = (name, seed, width, seq, model.config.num_hidden_layers)
    if key in _SPIKES:
        return _SPIKES[key]
    top_k = model.config.num_experts_per_tok
    routers = [m for n, m in model.named_modules()
               if n.endswith(".gate") and getattr(m, "weight", None) is not None]
    experts = routers[0].weight.shape[0]
    per_rank = experts // ep_size
    picked: List[torch.Tensor] = []

    def hook(mod: nn.Module, args: Tuple[Any, ...]) -> None:
        h = args[0].reshape(-1, args[0].shape[-1])[:1].float()  # every position is alike
        picked.append(torch.topk(h @ mod.weight.float().t(), top_k, dim=-1).indices[0])

    handles = [m.register_forward_pre_hook(hook) for m in routers]
    local = torch.zeros(model.config.vocab_size, ep_size, len(routers))
    device = routers[0].weight.device
    try:
        with torch.no_grad():
            for tok in range(model.config.vocab_size):
                picked.clear()
                model(input_ids=torch.full((1, seq), tok, device=device), use_cache=False)
                for layer, idx in enumerate(picked):
                    local[tok, :, layer] = torch.bincount(idx.cpu() // per_rank,
                                                          minlength=ep_size)
    finally:
        for h in handles:
            h.remove()
    score = local.sum(-1)  # [token, rank]
    rank = int(score.max(0).values.argmax())
    tokens = [int(t) for t in torch.argsort(score[:, rank], descending=True, stable=True)[:2]]
    loads = [float(v) for v in local[tokens, rank].mean(0) * ep_size / top_k]
    _SPIKES[key] = (rank, tokens, loads)
    return _SPIKES[key]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(model, FusedMoE):
        return model(x, x)
    return model(input_ids=x, labels=x, use_cache=False).loss


def train(name: str, policy: Optional[str], capacity: Any = "1GiB", iterations: int = 2,
          micro_batches: int = 8, stages: int = 4, forced: Optional[Dict[str, str]] = None,
          governor: str = "none", spike_every: int = 4, seed: int = 0,
          checkpoint_layers: bool = False, save_on_cpu: bool = False,
          ep: bool = True, width: int = 1, seq: int = 32, device: str = "cpu",
          issue_order: str = "dual-batch", layers: int = 3, compiled: Optional[str] = None,
          compile_options: Optional[Dict[str, Any]] = None,
          compile_after: bool = False, allow_fp8: bool = True,
          spike_on_rank: bool = False,
          compiled_operators: str = "operators", selective: bool = False,
          measure_saved: bool = False,
          seqs: Optional[Sequence[int]] = None,
          compiled_recompute: Any = None,
          calibration: Optional[str] = None,
          worst_load_plan: bool = False,
          min_load_factor: Optional[float] = None,
          after_iteration: Optional[Callable[[int], None]] = None) -> Dict[str, Any]:
    """Trains ``name`` as stage 0 of a ``stages``-stage 1F1B pipeline (all layers in this process)
    for ``iterations`` iterations of ``micro_batches``. ``policy`` None: plain PyTorch
    (``checkpoint_layers``: torch.utils.checkpoint around every block; ``save_on_cpu``:
    torch.autograd.graph.save_on_cpu with ``pin_memory=True``, which copies each saved tensor at
    its pack: pinned and asynchronous on CUDA, a plain copy on a CPU "device", where
    ``pin_memory=False`` would keep the tensor itself and copy nothing). Returns losses,
    gradients, bagualu's iteration lines and stats, and whether it ran out of memory
    (``issue_order``: bagualu's install option, dual-batch or serial). ``ep`` False: every expert
    is computed here (the model exactly as plain PyTorch runs it). ``width`` and ``seq``: a
    larger model (``build``) and longer micro-batches. ``compiled``: every block compiled
    (``compile_blocks``: "in-place" or "wrapped", with ``compile_options``), before
    ``bagualu.instrument`` or, ``compile_after``, after it. Per iteration: wall and CPU times
    (``device`` "cuda": wall time after a synchronize). ``spike_on_rank`` (with ``ep`` and
    ``spike_every``): this process stands for the EP rank the spike lands on, and the spike's
    batches repeat the tokens that put it there (``spike_rank``); else rank 0 and a batch of few
    random tokens. ``compiled_operators``: bagualu's install option. ``selective`` (with
    ``checkpoint_layers``): torch's selective checkpointing (matmul outputs saved, the rest
    recomputed). ``measure_saved`` (plain PyTorch): ``saved_peak``, the most bytes of saved
    activations (storages, parameters left out) held at once over the schedule. ``seqs``: the
    micro-batches' sequence length in each iteration (a shape change between iterations: dynamic
    shapes), in place of ``seq``. ``compiled_recompute``, ``calibration`` and
    ``min_load_factor``: bagualu's install options. ``after_iteration(it)`` runs after each
    iteration (outside its time). ``worst_load_plan`` (policy bagualu):
    ``out["worst_load_plan"]``, the plan a static policy sized for the highest load factor the
    run saw would force on every micro-batch (``bagualu.static_plan``) and that load."""
    import bagualu
    one_f_one_b = bagualu.schedule.one_f_one_b
    cuda = device.startswith("cuda")
    if policy is not None:  # first: on CUDA install() swaps the allocator before any tensor
        bagualu.install(capacity=capacity, policy=policy, governor=governor, device=device,
                        pipeline_stages=stages, micro_batches=micro_batches,
                        log_iterations=False, issue_order=issue_order, allow_fp8=allow_fp8,
                        compiled_operators=compiled_operators,
                        compiled_recompute=compiled_recompute, calibration=calibration,
                        min_load_factor=min_load_factor)
    model = build(name, seed, layers=layers, ep_size=4 if ep else 1, width=width).to(device)
    ep_kwargs = instrument_kwargs(name) if ep else {}
    tokens = None
    if spike_on_rank and ep and spike_every and name != "fused":
        rank, tokens, _ = spike_rank(name, model, seed, width, seq)
        ep_kwargs["ep_rank"] = rank
    if seqs is None:
        xs = [x.to(device) for x in batches(micro_batches * iterations,
                                            spike_every=spike_every, seq=seq,
                                            spike_tokens=tokens)]
    else:
        if len(seqs) != iterations or tokens is not None:
            raise ValueError("seqs: one sequence length per iteration, without spike_on_rank")
        xs = [x.to(device) for it, n in enumerate(seqs)
              for x in batches(micro_batches, seed=1 + it, spike_every=spike_every, seq=n)]
    out: Dict[str, Any] = {"losses": [], "oom": None, "lines": [], "times_ms": [],
                           "cpu_ms": []}
    if compiled is not None and not (compile_after and policy is not None):
        compile_blocks(model, compiled, **(compile_options or {}))
    if policy is not None:
        bagualu.instrument(model, **ep_kwargs)
        if forced is not None:
            bagualu.force_strategies(forced)
        if compiled is not None and compile_after:
            compile_blocks(model, compiled, **(compile_options or {}))
    elif checkpoint_layers:
        _checkpoint_blocks(model, selective)
    saved = _SavedPeak(model) if measure_saved and policy is None else None
    try:
        for it in range(iterations):
            t0, c0 = time.perf_counter(), time.process_time()
            model.zero_grad(set_to_none=True)  # gradients only: the weights stay
            losses: Dict[int, torch.Tensor] = {}
            if policy is not None:
                bagualu.begin_iteration()
            for phase, f, b in one_f_one_b(micro_batches, stages, 0):
                if policy is not None:
                    bagualu.step_point(phase, f, b)
                if f is not None:
                    x = xs[it * micro_batches + f]
                    if policy is not None:
                        with bagualu.forward(f):
                            losses[f] = loss_of(model, x)
                    elif save_on_cpu:
                        with torch.autograd.graph.save_on_cpu(pin_memory=True):
                            losses[f] = loss_of(model, x)
                    elif saved is not None:
                        with saved.forward(f):
                            losses[f] = loss_of(model, x)
                    else:
                        losses[f] = loss_of(model, x)
                if b is not None:
                    if policy is not None:
                        with bagualu.backward(b):
                            losses[b].backward()
                    else:
                        losses[b].backward()
                        if saved is not None:
                            saved.backward_done(b)
                    out["losses"].append(float(losses.pop(b).detach()))
            if policy is not None:
                out["lines"].append(bagualu.end_iteration())
            if cuda:
                torch.cuda.synchronize()
            out["times_ms"].append((time.perf_counter() - t0) * 1e3)
            out["cpu_ms"].append((time.process_time() - c0) * 1e3)
            if after_iteration is not None:
                after_iteration(it)
    except bagualu.OutOfMemoryError as e:
        out["oom"] = str(e)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
    if saved is not None:
        out["saved_peak"] = saved.peak
    if policy is not None:
        out["stats"] = bagualu.stats()
        out["description"] = bagualu.stage_graph()
        # what the planner was given (bgl-sim --model reads it) and the capacity it planned
        out["model_doc"] = bagualu.model_document()
        out["served_plans"] = bagualu.served_plans()  # what bgl-sim --plans replays
        out["plan_capacity"] = out["stats"]["planning"]["capacity_bytes"]
        # (load, predicted, captured) of every forward nothing was mitigated in
        out["accuracy"] = out["stats"].get("memory_model", {}).get("points", [])
        if worst_load_plan and out["lines"]:
            load = max(line["max_load_factor"] for line in out["lines"])
            out["worst_load_plan"] = {"load_factor": load,
                                      "strategies": bagualu.static_plan(max(load, 1.0))}
        bagualu.uninstall()
    return out


def mixed_strategies(name: str, with_fp8: bool) -> Dict[str, str]:
    """All four strategies in one layer of ``name``: attention and norms recomputed,
    projections and the experts offloaded, the expert activation in FP8 (or recomputed)."""
    import bagualu
    out = {}
    kinds = bagualu.operators(build(name))
    fp8_kind = "expert_activation" if "expert_activation" in kinds.values() else "expert_linear"
    for op, kind in kinds.items():
        if with_fp8 and kind == fp8_kind:
            out[op] = "fp8"
            continue
        if kind in ("attention", "norm", "shared_activation"):
            out[op] = "recompute"
        elif kind in ("linear", "expert_linear", "shared_linear"):
            out[op] = "offload"
        elif kind == "expert_activation":
            out[op] = "fp8" if with_fp8 else "recompute"
        elif op == "block" and name == "fused":  # the block's own code
            out[op] = "recompute"  # the block's own code has the dropout
    return out


def compile_blocks(model: nn.Module, form: str = "in-place", **options: Any) -> None:
    """Compiles every block of ``model`` as users do: ``block.compile(**options)`` in place
    ("in-place"), or ``torch.compile(block, **options)`` registered in the block's place in its
    list ("wrapped", torchtitan's way)."""
    import bagualu
    blocks = bagualu.layers(model)
    if form == "in-place":
        for blk in blocks:
            blk.compile(**options)
        return
    if form != "wrapped":
        raise ValueError(f"compile form '{form}' (in-place or wrapped)")
    for parent in model.modules():
        if isinstance(parent, nn.ModuleList):
            for i, m in enumerate(parent):
                if any(m is b for b in blocks):
                    parent[i] = torch.compile(m, **options)


def _checkpoint_blocks(model: nn.Module, selective: bool = False) -> None:
    """What users do today: torch.utils.checkpoint around every block (``selective``: torch's
    selective checkpointing, the outputs of matmuls saved and the rest recomputed, as
    torchtitan's 'op' policy)."""
    import functools

    from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                        create_selective_checkpoint_contexts)

    import bagualu
    saved_ops = {getattr(torch.ops.aten, name).default
                 for name in ("mm", "bmm", "addmm", "_grouped_mm")
                 if hasattr(torch.ops.aten, name)}  # torch 2.6 has no _grouped_mm

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved_ops else \
            CheckpointPolicy.PREFER_RECOMPUTE
    extra = {"context_fn": functools.partial(create_selective_checkpoint_contexts, policy)} \
        if selective else {}
    blocks = bagualu.layers(model)
    for blk in blocks:
        fwd = blk.forward

        def wrapped(*a: Any, _fwd: Callable = fwd, **k: Any) -> Any:
            return checkpoint(_fwd, *a, use_reentrant=False, **extra, **k)
        blk.forward = wrapped


class _SavedPeak:
    """Plain PyTorch's saved activation bytes over a schedule: each forward's distinct storages
    (parameters left out) counted by a saved-tensors hook, held until that micro-batch's
    backward ends; ``peak`` the most held at once."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.held: Dict[int, int] = {}
        self.peak = 0
        self._seen: Dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            st = t.untyped_storage()
        except RuntimeError:
            return t
        key = st.data_ptr()
        if key not in self.params and not isinstance(t, nn.Parameter):
            self._seen[key] = st.nbytes()
        return t

    def forward(self, mb: int) -> Any:
        import contextlib

        @contextlib.contextmanager
        def ctx() -> Any:
            self._seen = {}
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
            self.held[mb] = sum(self._seen.values())
            self.peak = max(self.peak, sum(self.held.values()))
        return ctx()

    def backward_done(self, mb: int) -> None:
        self.held.pop(mb, None)


def keep_all_peak(name: str, **kw: Any) -> int:
    """The keep-all activation peak of the training run (a large capacity, nothing planned;
    every storage its own block, so the peak is exact)."""
    r = train(name, "keep-all", capacity="4GiB", forced={}, **kw)  # main() prints its model
    return max(int(line["peak_bytes"]) for line in r["lines"])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=ALL_MODELS, default="mixtral")
    ap.add_argument("--policy", default="all", choices=("keep-all", "bagualu", "static-over",
                                                        "all"))
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--governor", default="none")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    full = train(args.model, "keep-all", capacity="4GiB", forced={},
                 micro_batches=args.micro_batches)
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    cap = peak // 2
    mm = full["stats"]["memory_model"]
    loads = [a[0] for a in full["accuracy"]]
    print(f"{args.model}: keep-all peak {peak / 2**20:.2f} MiB, capacity {cap / 2**20:.2f} MiB; "
          f"planner vs saved bytes: mean error {100 * mm['mean_error']:.3f}% (worst "
          f"{100 * mm['worst_error']:.3f}%) over {mm['samples']} micro-batches at loads "
          f"{min(loads):.2f}-{max(loads):.2f}")
    policies = (["keep-all", "bagualu", "static-over"] if args.policy == "all"
                else [args.policy])
    for p in policies:
        gc.collect()
        r = train(args.model, p, capacity=cap, iterations=args.iterations,
                  micro_batches=args.micro_batches, governor=args.governor)
        done = "OOM: " + r["oom"].splitlines()[0] if r["oom"] else "finished"
        strat = r["lines"][-1]["strategies"] if r["lines"] else {}
        print(f"  {p:<12} {done}; strategies {strat}; ms/iter "
              f"{[round(t) for t in r['times_ms']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
