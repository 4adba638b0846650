"""A small fine-grained MoE language model written with bagualu.OpBlock layers, and a synthetic
corpus of token "domains" whose mixture drifts, so routing skews.

Expert parallelism is emulated: this process owns experts [0, experts/ep); tokens routed to
other experts leave the stage (their contribution is not computed here), so the local load
factor r = local token-slots / (tokens * top_k / ep) varies with routing, as on an EP rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import bagualu


@dataclass
class MoEConfig:
    """Model and data sizes (defaults: the tiny-moe demo, scaled for CPU)."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    experts: int = 16
    top_k: int = 4
    moe_hidden: int = 128
    shared_hidden: int = 64
    vocab: int = 512
    seq_len: int = 128
    micro_batch_size: int = 4
    ep: int = 4
    domains: int = 4

    def info(self) -> Dict[str, Any]:
        """Architecture fields for the planner's model document."""
        return {"name": "pytorch-tiny-moe", "hidden": self.hidden, "moe_hidden": self.moe_hidden,
                "experts": self.experts, "top_k": self.top_k,
                "head_dim": self.hidden // self.heads, "heads": self.heads,
                "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def swiglu(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b


class MoELayer(bagualu.OpBlock):
    """Attention + MoE (shared expert, top-k routed experts) as 14 planner operators."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.moe_norm = RMSNorm(h)
        self.router = nn.Linear(h, cfg.experts, bias=False)
        self.shared_fc1 = nn.Linear(h, 2 * cfg.shared_hidden, bias=False)
        self.shared_fc2 = nn.Linear(cfg.shared_hidden, h, bias=False)
        self.local = cfg.experts // cfg.ep
        self.expert_fc1 = nn.ModuleList(nn.Linear(h, 2 * cfg.moe_hidden, bias=False)
                                        for _ in range(self.local))
        self.expert_fc2 = nn.ModuleList(nn.Linear(cfg.moe_hidden, h, bias=False)
                                        for _ in range(self.local))
        self.spike: Optional[float] = None  # target load factor of the next forward

    def build_steps(self) -> List[bagualu.Step]:
        S = bagualu.Step
        return [
            S("attn_norm", "norm", self.attn_norm, ("x",), ("h1",)),
            S("qkv_proj", "linear", self.qkv, ("h1",), ("qkv",)),
            S("core_attn", "attention", self._attention, ("qkv",), ("a",)),
            S("out_proj", "linear", self._out_proj, ("a", "x"), ("h",)),
            S("moe_norm", "norm", self.moe_norm, ("h",), ("m",)),
            S("router", "router", self._route, ("m", "spike"), ("w", "idx", "load"), router=True),
            S("shared_fc1", "shared_linear", self.shared_fc1, ("m",), ("s1",)),
            S("shared_act", "shared_activation", swiglu, ("s1",), ("s2",)),
            S("shared_fc2", "shared_linear", self.shared_fc2, ("s2",), ("s3",)),
            S("dispatch", "dispatch", self._dispatch, ("m", "idx"), ("xd", "slots", "counts")),
            S("expert_fc1", "expert_linear", self._fc1, ("xd", "counts"), ("f1",)),
            S("expert_act", "expert_activation", swiglu, ("f1",), ("f2",)),
            S("expert_fc2", "expert_linear", self._fc2, ("f2", "counts"), ("f3",)),
            S("combine", "combine", self._combine, ("f3", "w", "slots", "h", "s3"), ("out",)),
        ]

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        b, s, _ = qkv.shape
        nh = self.cfg.heads
        q, k, v = qkv.view(b, s, 3, nh, -1).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, -1)

    def _out_proj(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(a)

    def block_env(self) -> Dict[str, Any]:
        return {"spike": self.spike}

    def _route(self, m: torch.Tensor, spike: Optional[float]
               ) -> Tuple[torch.Tensor, torch.Tensor, float]:
        cfg = self.cfg
        logits = self.router(m).view(-1, cfg.experts)
        if spike is not None and spike > 1.0:
            logits = logits + spike_bias(logits.shape[0], cfg, spike, logits)
        probs = torch.softmax(logits, dim=-1)
        w, idx = probs.topk(cfg.top_k, dim=-1)
        local = int((idx < self.local).sum())
        balanced = logits.shape[0] * cfg.top_k / cfg.ep
        return w, idx, local / balanced

    def _dispatch(self, m: torch.Tensor, idx: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor, List[int]]:
        flat = idx.reshape(-1)
        slots = torch.nonzero(flat < self.local).squeeze(1)
        experts = flat.index_select(0, slots)
        order = torch.argsort(experts, stable=True)
        slots = slots.index_select(0, order)
        counts = torch.bincount(experts, minlength=self.local).tolist()
        tokens = torch.div(slots, self.cfg.top_k, rounding_mode="floor")
        xd = m.reshape(-1, m.shape[-1]).index_select(0, tokens)
        return xd, slots, counts

    def _fc1(self, xd: torch.Tensor, counts: List[int]) -> torch.Tensor:
        parts = [fc(chunk) for fc, chunk in zip(self.expert_fc1, xd.split(counts))]
        return torch.cat(parts) if parts else xd.new_zeros(0, 2 * self.cfg.moe_hidden)

    def _fc2(self, f2: torch.Tensor, counts: List[int]) -> torch.Tensor:
        parts = [fc(chunk) for fc, chunk in zip(self.expert_fc2, f2.split(counts))]
        return torch.cat(parts) if parts else f2.new_zeros(0, self.cfg.hidden)

    def _combine(self, f3: torch.Tensor, w: torch.Tensor, slots: torch.Tensor, h: torch.Tensor,
                 s3: torch.Tensor) -> torch.Tensor:
        ws = w.reshape(-1).index_select(0, slots).unsqueeze(1)
        tokens = torch.div(slots, self.cfg.top_k, rounding_mode="floor")
        routed = torch.zeros(h.numel() // h.shape[-1], h.shape[-1], dtype=h.dtype,
                             device=h.device).index_add(0, tokens, f3 * ws)
        return h + s3 + routed.view_as(h)


def spike_bias(tokens: int, cfg: MoEConfig, target: float, like: torch.Tensor) -> torch.Tensor:
    """A logit bias sending enough tokens entirely to the local experts that the local load
    factor reaches about ``target`` (tokens not forced keep their natural routing)."""
    local = cfg.experts // cfg.ep
    per_forced = min(cfg.top_k, local)
    natural = cfg.top_k / cfg.ep
    n = int(math.ceil(tokens * (target - 1.0) * natural / max(per_forced - natural, 1e-9)))
    n = max(0, min(tokens, n))
    bias = torch.zeros(tokens, cfg.experts, dtype=like.dtype, device=like.device)
    bias[:n, :local] = 30.0
    return bias


class MoEStage(nn.Module):
    """Layers [first, last) of the model; the first stage embeds, the last one has the head."""

    def __init__(self, cfg: MoEConfig, first: int = 0, last: Optional[int] = None,
                 embed: bool = True, head: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        last = cfg.layers if last is None else last
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if embed else None
        self.layers = nn.ModuleList(MoELayer(cfg) for _ in range(first, last))
        self.final_norm = RMSNorm(cfg.hidden) if head else None
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False) if head else None

    def set_spike(self, target: Optional[float]) -> None:
        for layer in self.layers:
            layer.spike = target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers:
            h = layer(h)
        if self.lm_head is not None:
            h = self.lm_head(self.final_norm(h))
        return h


class DriftingCorpus:
    """Sequences from token domains (contiguous vocabulary ranges, each with its own simple
    transition rule) whose mixture drifts over iterations."""

    def __init__(self, cfg: MoEConfig, seed: int = 0, drift_period: int = 8) -> None:
        self.cfg = cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.period = drift_period
        self.size = cfg.vocab // cfg.domains

    def mixture(self, iteration: int) -> torch.Tensor:
        d = self.cfg.domains
        phase = 2 * math.pi * iteration / max(self.period, 1)
        w = torch.tensor([1.0 + 0.9 * math.sin(phase + 2 * math.pi * i / d) for i in range(d)])
        return w / w.sum()

    def batch(self, iteration: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape [micro_batch_size, seq_len]."""
        cfg = self.cfg
        b, s = cfg.micro_batch_size, cfg.seq_len + 1
        dom = torch.multinomial(self.mixture(iteration), b, replacement=True, generator=self.gen)
        start = torch.randint(0, self.size, (b,), generator=self.gen)
        steps = torch.arange(s)
        mult = (dom * 2 + 3).unsqueeze(1)
        local = (start.unsqueeze(1) + mult * steps.unsqueeze(0)) % self.size
        noise = torch.rand(b, s, generator=self.gen) < 0.1
        local = torch.where(noise, torch.randint(0, self.size, (b, s), generator=self.gen), local)
        tokens = local + (dom * self.size).unsqueeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
