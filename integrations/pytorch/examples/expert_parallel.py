"""Real expert parallelism under bagualu: an MoE whose experts are sharded over the ranks of a
process group, tokens sent to the rank of their expert by an all-to-all with uneven splits
(``torch.distributed.all_to_all_single``), and back by the reverse one. bagualu takes each
layer's load factor from the dispatch: the tokens this rank's experts received over the
balanced count (``instrument(model, dispatch="moe.dispatch")``).

The inputs are hidden states of two token domains: a token of domain 0 carries +u on a fixed
direction u, one of domain 1 carries -u, and every router sends domain 0 to rank 0's experts
and domain 1 to rank 1's (2 ranks). A micro-batch with a fraction p of domain-0 tokens on every
rank gives rank 0 the load 2p and rank 1 the load 2(1 - p): the micro-batches are balanced (p = 0.5) but
one per iteration, of which ``--spike 1.0`` sends every token to rank 0 (load 2.0 there, 0.0
on rank 1).

    torchrun --standalone --nproc_per_node 2 expert_parallel.py --fraction 0.5

runs each rank three times from the same weights and data: plain PyTorch, bagualu keep-all
with room (its peak), and bagualu at ``--fraction`` of that peak; each rank prints its losses,
load factors and deferred replans, and whether its gradients equal plain PyTorch's.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-6)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.wqkv(x).view(b, s, 3, self.heads, -1).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, d))


class Dispatch(nn.Module):
    """Sends routed slots (sorted by expert) to the ranks of their experts: the counts first
    (``torch.distributed.all_to_all_single``), then the tokens (the same with uneven splits,
    differentiable: the backward sends the gradients back). Returns the received tokens (rank-major: every source
    rank's slots for this rank's experts in expert order) and the (ranks, local experts) counts."""

    def __init__(self, group: Any, ranks: int) -> None:
        super().__init__()
        self.group = group
        self.ranks = ranks
        self.received: List[int] = []  # tokens received per call (what bagualu must see)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor,
                                                                      torch.Tensor]:
        send = counts.view(self.ranks, -1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        out_splits = recv.sum(1).tolist()
        out = _all_to_all(x, out_splits, send.sum(1).tolist(), self.group)
        self.received.append(out.shape[0])
        return out, recv


def exchange_back(y: torch.Tensor, recv: torch.Tensor, send: torch.Tensor,
                  group: Any) -> torch.Tensor:
    """The combine's all-to-all: expert outputs back to the ranks their tokens came from."""
    return _all_to_all(y, send.sum(1).tolist(), recv.sum(1).tolist(), group)


def _all_to_all(x: torch.Tensor, out_splits: List[int], in_splits: List[int],
                group: Any) -> torch.Tensor:
    """``all_to_all_single`` with uneven splits, differentiable (torch's functional
    collective, as torchtitan's dispatcher uses), waited for."""
    out = funcol.all_to_all_single_autograd(x.contiguous(), out_splits, in_splits,
                                            group if group is not None else dist.group.WORLD)
    return funcol.wait_tensor(out)


class LocalExperts(nn.Module):
    """This rank's experts, stacked: a GELU-gated MLP each, applied per (source rank, expert)
    segment of the received tokens."""

    def __init__(self, local: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(local, dim, 2 * hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(local, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        start = 0
        for n, e in zip(counts.reshape(-1).tolist(), list(range(counts.shape[1])) *
                        counts.shape[0]):
            if n:
                a, b = (x[start:start + n] @ self.w_in[e]).chunk(2, dim=-1)
                outs.append((F.gelu(a) * b) @ self.w_out[e])
            start += n
        return torch.cat(outs) if outs else x[:0] @ self.w_in[0, :, :x.shape[-1]]


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, group: Any,
                 ranks: int, rank: int) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.ranks, self.group = experts, top_k, ranks, group
        self.gate = nn.Linear(dim, experts, bias=False)
        self.dispatch = Dispatch(group, ranks)
        self.experts = LocalExperts(experts // ranks, dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        x = x.reshape(-1, d)
        probs = F.softmax(self.gate(x), dim=-1)
        w, idx = probs.topk(self.top_k, dim=-1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        received, recv = self.dispatch(x[token], counts)
        y = exchange_back(self.experts(received, recv), recv,
                          counts.view(self.ranks, -1), self.group)
        out = torch.zeros_like(x).index_add(0, token, y * w.reshape(-1)[order].unsqueeze(-1))
        return out.view(b, s, d)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, moe: MoE) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.moe_norm = RMSNorm(dim)
        self.moe = moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class Model(nn.Module):
    def __init__(self, blocks: Sequence[Block], dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim, bias=False)  # the first layer's input: an activation
        self.layers = nn.ModuleList(blocks)
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(self.norm(x)).float().pow(2).mean()


def direction(dim: int) -> torch.Tensor:
    u = torch.ones(dim)
    return u / u.norm()


def build(group: Any, ranks: int, rank: int, layers: int = 4, dim: int = 64, heads: int = 4,
          experts: int = 4, top_k: int = 2, hidden: int = 128, seed: int = 0) -> Model:
    """The model of EP rank ``rank``: the same shared weights on every rank, and the experts of
    this rank (experts // ranks of them). Every router sends +u tokens to rank 0's experts and
    -u tokens to the last rank's."""
    torch.manual_seed(seed)
    u = direction(dim)
    blocks = []
    for _ in range(layers):
        moe = MoE(dim, experts, top_k, hidden, group, ranks, rank)
        with torch.no_grad():
            sign = torch.tensor([1.0 if e < experts // 2 else -1.0 for e in range(experts)])
            moe.gate.weight.mul_(0.1).add_(40.0 * sign[:, None] * u[None, :])
        blocks.append(Block(dim, heads, moe))
    model = Model(blocks, dim)
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(dim))
    # Each rank's experts differ; the rest is the same everywhere.
    g = torch.Generator().manual_seed(seed + 1000 + rank)
    with torch.no_grad():
        for block in model.layers:
            for p in block.moe.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    return model


def batches(n: int, rank: int, fractions: Sequence[float], batch: int = 2, seq: int = 64,
            dim: int = 64, seed: int = 1) -> List[torch.Tensor]:
    """``n`` micro-batches of this rank: micro-batch i has the fraction fractions[i % len] of
    domain-0 tokens (+u); the rest are domain 1 (-u)."""
    g = torch.Generator().manual_seed(seed + 100 * rank)
    u = direction(dim)
    out = []
    for i in range(n):
        p = fractions[i % len(fractions)]
        sign = -torch.ones(batch * seq)
        sign[torch.randperm(batch * seq, generator=g)[:round(p * batch * seq)]] = 1.0
        x = torch.randn(batch * seq, dim, generator=g) * 0.3 + 3.0 * sign[:, None] * u
        out.append(x.view(batch, seq, dim))
    return out


def train(model: Model, xs: Sequence[torch.Tensor], policy: Optional[str], capacity: Any = "1GiB",
          iterations: int = 2, micro_batches: int = 4, stages: int = 4,
          governor: str = "none",
          after_forward: Optional[Callable[[int], None]] = None,
          allow_fp8: bool = True) -> Dict[str, Any]:
    """Trains as stage 0 of a ``stages``-stage 1F1B pipeline (every layer here, ``stages``
    forwards in flight) for ``iterations`` of ``micro_batches``; ``policy`` None: plain
    PyTorch; ``after_forward(f)`` runs after each forward. Returns losses, gradients, the load factors bagualu saw per forward (mean over the
    layers) next to the tokens the dispatches received, and bagualu's lines and stats."""
    import bagualu
    if policy is not None:
        bagualu.install(capacity=capacity, policy=policy, governor=governor,
                        pipeline_stages=stages, micro_batches=micro_batches,
                        log_iterations=False, allow_fp8=allow_fp8)
        bagualu.instrument(model, dispatch="moe.dispatch")
    slots = xs[0].shape[0] * xs[0].shape[1] * model.layers[0].moe.top_k
    dispatches = [b.moe.dispatch for b in model.layers]
    for d in dispatches:
        d.received.clear()
    out: Dict[str, Any] = {"losses": [], "oom": None, "lines": [], "received": []}
    model.zero_grad(set_to_none=True)
    try:
        for it in range(iterations):
            model.zero_grad(set_to_none=True)
            losses: Dict[int, torch.Tensor] = {}
            if policy is not None:
                bagualu.begin_iteration()
            for phase, f, b in bagualu.schedule.one_f_one_b(micro_batches, stages, 0):
                if policy is not None:
                    bagualu.step_point(phase, f, b)
                if f is not None:
                    x = xs[it * micro_batches + f]
                    before = [len(d.received) for d in dispatches]
                    if policy is not None:
                        with bagualu.forward(f):
                            losses[f] = model(x)
                    else:
                        losses[f] = model(x)
                    out["received"].append([d.received[n] / slots
                                            for d, n in zip(dispatches, before)])
                    if after_forward is not None:
                        after_forward(f)
                if b is not None:
                    if policy is not None:
                        with bagualu.backward(b):
                            losses[b].backward()
                    else:
                        losses[b].backward()
                    out["losses"].append(float(losses.pop(b).detach()))
            if policy is not None:
                out["lines"].append(bagualu.end_iteration())
    except Exception as e:  # bagualu.OutOfMemoryError, reported per rank
        if policy is None or not isinstance(e, bagualu.OutOfMemoryError):
            raise
        out["oom"] = str(e)
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
    if policy is not None:
        out["stats"] = bagualu.stats()
        out["accuracy"] = out["stats"].get("memory_model", {}).get("points", [])
        bagualu.uninstall()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fraction", type=float, default=0.5,
                    help="bagualu's capacity as a fraction of keep-all's peak")
    ap.add_argument("--spike", type=float, default=1.0,
                    help="domain-0 share of the third micro-batch of each iteration (the "
                         "others: 0.5)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--governor", default="none")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    fractions = [0.5, 0.5, args.spike, 0.5]
    xs = batches(4 * args.iterations, rank, fractions)

    def run(policy: Optional[str], capacity: Any = "1GiB") -> Dict[str, Any]:
        return train(build(None, ranks, rank), xs, policy, capacity, args.iterations,
                     governor=args.governor)

    plain = run(None)
    full = run("keep-all", "4GiB")
    peak = max(line["peak_bytes"] for line in full["lines"])
    r = run("bagualu", int(peak * args.fraction))
    same = r["oom"] is None and all(torch.equal(plain["grads"][n], g)
                                    for n, g in r["grads"].items()) \
        and len(r["grads"]) == len(plain["grads"])
    print(json.dumps({"rank": rank, "peak": peak, "losses": r["losses"], "oom": r["oom"],
                      "loads": [round(sum(x) / len(x), 4) for x in r["received"]],
                      "deferred": [line["deferred"] for line in r["lines"]],
                      "grads_equal_plain": same}), flush=True)
    dist.destroy_process_group()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
