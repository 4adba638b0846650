"""One rank of test_expert_parallel.py's compiled test (torchrun, 2 gloo ranks): real expert
parallelism inside compiled blocks, planned per operator (issue 41). The MoE of
examples/expert_parallel.py written so that dynamo captures it whole (``fullgraph=True``): the
token counts go through a functional all-to-all, the splits are unbacked sizes
(``capture_scalar_outputs``, as torchtitan's MoE under compile), the tokens through
``all_to_all_single_autograd`` with the process group's name (a ProcessGroup object would be an
opaque value saved for the backward: refused per operator, docs/pytorch.md), and this rank's
experts run on every received token, masked (no data-dependent loop). Plain compiled, then
bagualu at half of keep-all's peak; writes DIR/rank<r>.json (DIR: the first argument)."""
from __future__ import annotations

import json
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))

import bagualu  # noqa: E402
from bagualu.capture import stash  # noqa: E402
from bagualu.planning import embedded  # noqa: E402
import expert_parallel as ep  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

FRACTIONS = [0.5, 0.5, 0.875, 0.5]  # micro-batch 2: 7 in 8 tokens to rank 0's experts
MICRO_BATCHES, ITERATIONS, LAYERS = 4, 2, 2
OPTIONS = {"fullgraph": True, "backend": "aot_eager"}


class Dispatch(nn.Module):
    """The routed slots (sorted by expert) to the ranks of their experts; returns the tokens
    this rank's experts receive and the (ranks, local experts) counts."""

    def __init__(self, group_name: str, ranks: int) -> None:
        super().__init__()
        self.group_name, self.ranks = group_name, ranks

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> Any:
        send = counts.view(self.ranks, -1)
        recv = funcol.wait_tensor(funcol.all_to_all_single(
            counts, None, None, self.group_name)).view(self.ranks, -1)
        out_splits = recv.sum(1).tolist()
        in_splits = send.sum(1).tolist()
        out = funcol.wait_tensor(funcol.all_to_all_single_autograd(
            x.contiguous(), out_splits, in_splits, self.group_name))
        return out, recv


class Experts(nn.Module):
    """This rank's experts (stacked), each on every received token, masked by its expert."""

    def __init__(self, local: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.local = local
        self.w_in = nn.Parameter(torch.randn(local, dim, 2 * hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(local, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        # The received tokens are (source rank, expert) segments: each token's segment.
        ends = torch.cumsum(recv.reshape(-1), 0)
        eid = torch.searchsorted(ends, torch.arange(x.shape[0]), right=True) % self.local
        y = torch.zeros_like(x)
        for e in range(self.local):
            a, b = (x @ self.w_in[e]).chunk(2, dim=-1)
            y = y + (eid == e).unsqueeze(-1).to(x.dtype) * ((F.gelu(a) * b) @ self.w_out[e])
        return y


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, group_name: str,
                 ranks: int) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.ranks = experts, top_k, ranks
        self.group_name = group_name
        self.gate = nn.Linear(dim, experts, bias=False)
        self.dispatch = Dispatch(group_name, ranks)
        self.experts = Experts(experts // ranks, dim, hidden)

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
        send = counts.view(self.ranks, -1)
        y = funcol.wait_tensor(funcol.all_to_all_single_autograd(
            self.experts(received, recv), send.sum(1).tolist(), recv.sum(1).tolist(),
            self.group_name))
        out = torch.zeros_like(x).index_add(0, token, y * w.reshape(-1)[order].unsqueeze(-1))
        return out.view(b, s, d)


def build(ranks: int, rank: int, compiled: bool = True, dim: int = 64, heads: int = 4,
          experts: int = 4, top_k: int = 2, hidden: int = 128, seed: int = 0) -> nn.Module:
    """examples/expert_parallel.py's model (its weights) with this MoE, every block compiled."""
    torch.manual_seed(seed)
    name = dist.group.WORLD.group_name
    u = ep.direction(dim)
    blocks = []
    for _ in range(LAYERS):
        moe = MoE(dim, experts, top_k, hidden, name, ranks)
        with torch.no_grad():
            sign = torch.tensor([1.0 if e < experts // 2 else -1.0 for e in range(experts)])
            moe.gate.weight.mul_(0.1).add_(40.0 * sign[:, None] * u[None, :])
        blocks.append(ep.Block(dim, heads, moe))
    model = ep.Model(blocks, dim)
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(dim))
    g = torch.Generator().manual_seed(seed + 1000 + rank)
    with torch.no_grad():
        for block in model.layers:
            for p in block.moe.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    if compiled:
        for block in model.layers:
            block.compile(**OPTIONS)
    return model


def train(model: nn.Module, xs: List[torch.Tensor], policy: Any, capacity: Any = None
          ) -> Dict[str, Any]:
    """Stage 0 of a 4-stage 1F1B (examples/expert_parallel.train's loop): losses, gradients,
    per forward the loads bagualu planned with and its deferred replans so far, its lines and
    stats."""
    if policy is not None:
        bagualu.install(capacity=capacity, policy=policy, governor="none", pipeline_stages=4,
                        micro_batches=MICRO_BATCHES, log_iterations=False,
                        allow_fp8=False)  # gradients compared bit for bit
        bagualu.instrument(model, dispatch="moe.dispatch")
    out: Dict[str, Any] = {"losses": [], "lines": [], "seen": []}
    for it in range(ITERATIONS):
        model.zero_grad(set_to_none=True)
        losses: Dict[int, torch.Tensor] = {}
        if policy is not None:
            bagualu.begin_iteration()
        for phase, f, b in bagualu.schedule.one_f_one_b(MICRO_BATCHES, 4, 0):
            if policy is not None:
                bagualu.step_point(phase, f, b)
            if f is not None:
                x = xs[it * MICRO_BATCHES + f]
                if policy is not None:
                    with bagualu.forward(f):
                        losses[f] = model(x)
                    rt = bagualu.current()
                    out["seen"].append((f, list(rt.planning.loads.get(f, [])),
                                        rt.planning.deferred))
                else:
                    losses[f] = model(x)
            if b is not None:
                if policy is not None:
                    with bagualu.backward(b):
                        losses[b].backward()
                else:
                    losses[b].backward()
                out["losses"].append(float(losses.pop(b).detach()))
        if policy is not None:
            out["lines"].append(bagualu.end_iteration())
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()
                    if p.grad is not None}
    if policy is not None:
        out["stats"] = bagualu.stats()
        out["accuracy"] = out["stats"].get("memory_model", {}).get("points", [])
        bagualu.uninstall()
    return out


def received(xs: List[torch.Tensor], ranks: int, rank: int) -> List[List[float]]:
    """Per forward, the tokens each layer's experts received over the balanced count: the
    same model uncompiled, its experts' inputs counted by a hook (the routing is the same)."""
    model = build(ranks, rank, compiled=False)
    slots = xs[0].shape[0] * xs[0].shape[1] * model.layers[0].moe.top_k
    rows: List[float] = []
    for block in model.layers:
        block.moe.experts.register_forward_hook(
            lambda m, a, o: rows.append(a[0].shape[0] / slots))
    out = []
    with torch.no_grad():
        for it in range(ITERATIONS):
            for f in range(MICRO_BATCHES):
                model(xs[it * MICRO_BATCHES + f])
                out.append(rows[-LAYERS:])
    return out


def main() -> int:
    torch.set_num_threads(1)
    torch._dynamo.config.capture_scalar_outputs = True
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    xs = ep.batches(MICRO_BATCHES * ITERATIONS, rank, FRACTIONS)
    torch._dynamo.reset()
    counters.clear()
    plain = train(build(ranks, rank), xs, None)
    plain_dynamo = dynamo()
    # From a fresh dynamo bagualu compiles as many graphs as plain compile (keep-all, planned
    # per operator as bagualu's run is), and its run at half the peak nothing new.
    torch._dynamo.reset()
    counters.clear()
    made = []
    real_init = embedded.EmbeddedPlanner.__init__

    def spy(planner: Any, model: Any, options: Any = None) -> None:
        made.append((model, options))
        real_init(planner, model, options)

    embedded.EmbeddedPlanner.__init__ = spy
    try:
        full = train(build(ranks, rank), xs, "keep-all", "4GiB")
    finally:
        embedded.EmbeddedPlanner.__init__ = real_init
    keep_all_dynamo = dynamo()
    peak = max(line["peak_bytes"] for line in full["lines"])
    # The memory model: the keep-all run's planner asked at each observed load, against what
    # the compiled graphs saved (the tracker's count of the stashed tensors).
    planner = embedded.EmbeddedPlanner(*made[-1])
    errors = []
    for load, _, captured in full["accuracy"]:
        planner.reset_iteration()
        plan = planner.plan({"phase": "steady", "forward_micro_batch": 0,
                             "load_factor": float(load)})
        errors.append([load, abs(plan["keep_all_bytes"] - captured) / captured])
    planner.close()
    counters.clear()
    r = train(build(ranks, rank), xs, "bagualu", peak // 2)
    compiled = r["stats"]["compiled"]

    def same(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
        return len(a["grads"]) == len(b["grads"]) and \
            all(torch.equal(a["grads"][n], g) for n, g in b["grads"].items())

    result = {
        "rank": rank, "plain_dynamo": plain_dynamo, "keep_all_dynamo": keep_all_dynamo,
        "bagualu_dynamo": dynamo(),
        "received": received(xs, ranks, rank),
        "keep_all_loads": [x[1] for x in full["seen"]], "memory_model_errors": errors,
        "bagualu_loads": [x[1] for x in r["seen"]],
        "micro_batches": [x[0] for x in r["seen"]],
        "deferred_after": [x[2] for x in r["seen"]],
        "lines": [{k: line[k] for k in ("deferred", "offloads", "fp8_casts", "recomputed_ops",
                                          "evictions", "ooms")} for line in r["lines"]],
        "per_operator": compiled["per_operator"], "stashed": compiled["stashed"],
        "downgrades": compiled["downgrades"],
        "changed_without_downgrade": compiled["changed_without_downgrade"],
        "grads_plain_vs_keep_all": same(plain, full), "grads_plain_vs_bagualu": same(plain, r),
        "grads": len(r["grads"]), "losses_equal": plain["losses"] == r["losses"],
        "live_handles": stash.live_handles()}
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


def dynamo() -> List[int]:
    """(graphs compiled, graph breaks) since the counters were cleared."""
    return [counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())]


if __name__ == "__main__":
    sys.exit(main())
