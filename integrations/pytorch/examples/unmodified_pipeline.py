"""An unmodified Hugging Face MoE model under torch.distributed.pipelining, with bagualu
attached by ``bagualu.pipelining.wrap_schedule`` and planned by the governor.

    torchrun --standalone --nproc_per_node 2 unmodified_pipeline.py --model qwen3_moe \\
        --schedule interleaved --governor unix:///run/bagualu/governor.sock

Every rank builds the same model (transformers' own class from a small config, random weights,
the same seed) and keeps its stages' decoder layers, as torchtitan splits a model: the layer
list is cut, the first stage keeps the embedding, the last the final norm and the LM head; the
model's code is not touched. ``--schedule 1f1b``: one stage per rank (``Schedule1F1B``);
``interleaved``: two (``ScheduleInterleaved1F1B``, stages ``rank`` and ``rank + world``).

Each rank then trains three times from the same weights and data: plain PyTorch; bagualu
keep-all with room (its peak of saved activations under this very schedule); bagualu at
``--fraction`` of that peak. The last rank prints each run's losses as exact hex, so runs can
be compared bit for bit, and every rank prints what bagualu did.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

import unmodified


class HFStage(nn.Module):
    """Some decoder layers of a Hugging Face causal LM: token ids (first stage) or hidden
    states in, hidden states or logits (last stage) out."""

    def __init__(self, lm: nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.lm, self.first, self.last = lm, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kw = {"input_ids": x} if self.first else {"inputs_embeds": x}
        h = self.lm.model(**kw, use_cache=False).last_hidden_state
        return self.lm.lm_head(h) if self.last else h


def build_stage(name: str, index: int, stages: int, layers: int, seed: int) -> HFStage:
    """Stage ``index`` of ``stages`` of the model (the same weights whatever the split)."""
    lm = unmodified.build(name, seed, layers=layers, ep_size=1)
    per = layers // stages
    inner = lm.model
    inner.layers = nn.ModuleList(list(inner.layers)[index * per:(index + 1) * per])
    first, last = index == 0, index == stages - 1
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = nn.Identity()
        lm.lm_head = None
    return HFStage(lm, first, last)


def shard_stages(modules: List[nn.Module], world: int) -> None:
    """FSDP2 inside each pipeline stage (torchtitan's PP x DP): ``fully_shard`` on every decoder
    block and then the stage, over this rank's data-parallel group of a (pp=world, dp=1) mesh
    (one data-parallel rank per stage on a machine with as many processes as stages)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dp = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))["dp"]
    for module in modules:
        for block in module.lm.model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(module, mesh=dp)


def loss_fn_for(micro_batches: int) -> Any:
    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                           target[:, 1:].flatten()) / micro_batches
    return loss_fn


def train(args: argparse.Namespace, rank: int, world: int, policy: Optional[str],
          capacity: Any = "1GiB") -> Dict[str, Any]:
    """One training run of this rank's stages; ``policy`` None: plain PyTorch."""
    import bagualu
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B,
                                              ScheduleInterleaved1F1B)
    chunks = 2 if args.schedule == "interleaved" else 1
    n_stages = world * chunks
    n_mb = args.micro_batches
    if policy is not None:
        bagualu.install(capacity=capacity, policy=policy,
                        governor=args.governor if policy == "bagualu" else "none",
                        pipeline_rank=rank, pipeline_stages=world, micro_batches=n_mb,
                        chunks=chunks, log_iterations=False,
                        allow_fp8=not getattr(args, "no_fp8", False))
    indices = [rank + c * world for c in range(chunks)]  # this rank's stages, chunk order
    modules = [build_stage(args.model, i, n_stages, args.layers, args.seed) for i in indices]
    if getattr(args, "fsdp", False):
        shard_stages(modules, world)
    if policy is not None:
        bagualu.instrument(modules[0] if chunks == 1 else nn.ModuleList(modules))
        if policy == "keep-all":
            bagualu.force_strategies({})  # one block per storage: an exact peak
    cfg = modules[0].lm.config
    xs = unmodified.batches(n_mb * args.iterations, spike_every=args.spike_every,
                            vocab=cfg.vocab_size)
    mbs, seq = xs[0].shape
    hidden = cfg.hidden_size
    pstages = []
    for i, module in zip(indices, modules):
        # a received activation and a sent output need requires_grad, or no gradient flows
        example_in = xs[0] if i == 0 else torch.zeros(mbs, seq, hidden, requires_grad=True)
        example_out = torch.zeros(mbs, seq, cfg.vocab_size) if i == n_stages - 1 \
            else torch.zeros(mbs, seq, hidden, requires_grad=True)
        pstages.append(PipelineStage(module, i, n_stages, torch.device("cpu"),
                                     input_args=(example_in,), output_args=(example_out,)))
    if chunks > 1:
        schedule: Any = ScheduleInterleaved1F1B(pstages, n_mb, loss_fn=loss_fn_for(n_mb))
    else:
        schedule = Schedule1F1B(pstages[0], n_mb, loss_fn=loss_fn_for(n_mb))
    if policy is not None:
        schedule = bagualu.pipelining.wrap_schedule(schedule)
    else:
        bagualu.pipelining.fix_batch_p2p()  # plain torch < 2.8 hangs on gloo without it
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    out: Dict[str, Any] = {"losses": [], "plans": 0}
    first, last = rank == 0, rank == world - 1
    for it in range(args.iterations):
        x = torch.cat(xs[it * n_mb:(it + 1) * n_mb])
        opt.zero_grad(set_to_none=True)
        losses: List[torch.Tensor] = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=x, losses=losses)
        else:
            schedule.step()
        opt.step()
        if last:
            out["losses"].append(float(torch.stack([v.detach() for v in losses]).sum()))
        if policy is not None:
            out["plans"] += schedule.plans
    if policy is not None:
        history = bagualu.history()
        out["peak"] = max(line["peak_bytes"] for line in history)
        out["stats"] = bagualu.stats()
        out["strategies"] = history[-1]["strategies"]
        out["mitigated"] = sum(ln["offloads"] + ln["recomputed_ops"] + ln["fp8_casts"]
                               for ln in history)
        dist.barrier()  # every rank is still registered here
        bagualu.uninstall()
    dist.barrier()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("mixtral", "qwen3_moe"), default="qwen3_moe")
    p.add_argument("--schedule", choices=("1f1b", "interleaved"), default="1f1b")
    p.add_argument("--no-fp8", action="store_true",
                   help="plans never store activations in FP8: the losses are bit for bit "
                        "plain PyTorch's (install(allow_fp8=False))")
    p.add_argument("--governor", default="auto",
                   help="governor address for the bagualu run (auto, none, unix://...)")
    p.add_argument("--fraction", type=float, default=0.5,
                   help="capacity of the bagualu run as a fraction of keep-all's peak")
    p.add_argument("--layers", type=int, default=0,
                   help="decoder layers in all (default: two per stage)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--spike-every", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fsdp", action="store_true",
                   help="FSDP2 inside each stage (fully_shard on its blocks and the stage)")
    args = p.parse_args(argv)
    if not 0 < args.fraction <= 1:
        p.error(f"--fraction must be in (0, 1], got {args.fraction}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    stages = world * (2 if args.schedule == "interleaved" else 1)
    args.layers = args.layers or 2 * stages
    if args.layers % stages:
        p.error(f"--layers {args.layers} does not split into {stages} stages")
    try:
        plain = train(args, rank, world, None)
        keep = train(args, rank, world, "keep-all")
        capacity = max(int(keep["peak"] * args.fraction), 1 << 16)
        tight = train(args, rank, world, "bagualu", capacity)
    except Exception as e:  # a rank that fails says so before torchrun tears the group down
        print(f"rank {rank} failed: {type(e).__name__}: {e}", flush=True)
        raise
    for what, run in (("plain", plain), ("keep-all", keep), ("bagualu", tight)):
        for it, loss in enumerate(run["losses"]):
            print(f"rank {rank} {what} iteration {it} loss {loss:.4f} exact {loss.hex()}",
                  flush=True)
    st = tight["stats"]
    print(f"rank {rank} bagualu finished {args.iterations} iterations governor={st['governor']}"
          f" ooms={st['ooms']} capacity {capacity} of keep-all peak {keep['peak']} plans "
          f"{tight['plans']} mitigated {tight['mitigated']} strategies {tight['strategies']}",
          flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
