"""Trains the small fine-grained MoE model under bagualu and compares activation policies.

Single process (default): emulates one pipeline stage's 1F1B memory pattern (rank 0 of
--stages, so up to --stages micro-batches are in flight). Under torchrun (WORLD_SIZE > 1):
real pipeline parallelism, one stage per rank (gloo on CPU, NCCL on GPU), every rank talking
to the same governor daemon ($BGL_GOVERNOR); --pipeline torch drives the stages with
torch.distributed.pipelining's Schedule1F1B (or --torch-schedule gpipe; or interleaved:
ScheduleInterleaved1F1B, two stages per rank) through bagualu.pipelining.wrap_schedule.

  python integrations/pytorch/examples/moe_train.py --policy all --capacity 292MiB \
      --spike-size 2.6 --spike-every 16
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bagualu  # noqa: E402
from moe_model import DriftingCorpus, MoEConfig, MoEStage  # noqa: E402

POLICIES = ["keep-all", "static-under", "static-over", "bagualu"]


def spike_for(global_mb: int, every: int, size: float) -> Optional[float]:
    """The injected load factor of a micro-batch (None: natural routing)."""
    if every > 0 and size > 1.0 and global_mb % every == every - 1:
        return size
    return None


def train(cfg: MoEConfig, policy: str, iterations: int = 4, micro_batches: int = 8,
          stages: int = 4, capacity: Any = "24MiB", spike_size: float = 0.0,
          spike_every: int = 0, seed: int = 0, governor: Optional[str] = "none",
          device: str = "cpu", lr: float = 0.05, log_iterations: bool = True,
          collect_grads: bool = False, force: Optional[Dict[str, str]] = None,
          picture: str = "") -> Dict[str, Any]:
    """One single-process run; returns losses, times, per-iteration lines and stats.

    policy 'plain' runs plain PyTorch (no bagualu) for the overhead comparison. ``picture``:
    records the first iteration with a spike (the last one without) and draws its memory
    picture there (bagualu.plot_iteration; ``result["picture"]`` is the file written)."""
    use = policy != "plain"
    if use:  # before the model reaches the GPU: PyTorch's allocator is fixed at first use
        bagualu.install(capacity=capacity, policy=policy, device=device, governor=governor,
                        pipeline_stages=stages, micro_batches=micro_batches,
                        log_iterations=log_iterations)
    torch.manual_seed(seed)
    model = MoEStage(cfg).to(device)
    corpus = DriftingCorpus(cfg, seed=seed + 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if use:
        bagualu.instrument(model, cfg.info())
        if force is not None:
            bagualu.force_strategies(force)
    result: Dict[str, Any] = {"policy": policy, "losses": [], "iteration_s": [],
                              "iteration_cpu_s": [], "lines": [],
                              "finished": 0, "oom": None, "grads": []}
    gmb = 0
    recorded, recording = None, None
    if use and picture:
        spiked = [it for it in range(iterations) if any(
            spike_for(it * micro_batches + f, spike_every, spike_size) is not None
            for f in range(micro_batches))]
        recorded = spiked[0] if spiked else iterations - 1
        result.update(picture_iteration=recorded, picture_spike=bool(spiked))
    try:
        for it in range(iterations):
            t0, c0 = time.perf_counter(), time.process_time()
            data = [corpus.batch(it) for _ in range(micro_batches)]
            losses: Dict[int, torch.Tensor] = {}
            opt.zero_grad(set_to_none=True)
            if it == recorded:
                recording = bagualu.record_iteration()
            if use:
                bagualu.begin_iteration()
            for phase, f, b in bagualu.schedule.one_f_one_b(micro_batches, stages, 0):
                if use:
                    bagualu.step_point(phase, f, b)
                if f is not None:
                    x, y = (t.to(device) for t in data[f])
                    model.set_spike(spike_for(gmb + f, spike_every, spike_size))
                    if use:
                        with bagualu.forward(f):
                            logits = model(x)
                            losses[f] = torch.nn.functional.cross_entropy(
                                logits.view(-1, cfg.vocab), y.view(-1)) / micro_batches
                    else:
                        logits = model(x)
                        losses[f] = torch.nn.functional.cross_entropy(
                            logits.view(-1, cfg.vocab), y.view(-1)) / micro_batches
                    del logits
                if b is not None:
                    loss = losses[b]
                    if use:
                        with bagualu.backward(b):
                            loss.backward()
                    else:
                        loss.backward()
                    losses[b] = loss.detach()
            gmb += micro_batches
            total = torch.stack([losses[i] for i in range(micro_batches)]).sum()
            if collect_grads:
                result["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None})
            opt.step()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()  # the iteration's kernels belong to its time
            result["losses"].append(total.detach().clone())
            result["iteration_s"].append(time.perf_counter() - t0)
            result["iteration_cpu_s"].append(time.process_time() - c0)
            if use:
                result["lines"].append(bagualu.end_iteration())
            if recording is not None:
                result["picture"] = str(bagualu.plot_iteration(picture, recording.stop()))
                recording = None
            result["finished"] += 1
    except bagualu.OutOfMemoryError as e:
        result["oom"] = f"iteration {len(result['losses'])}: {e}"
        logging.getLogger("bagualu").error("%s: out of memory at %s", policy, result["oom"])
    finally:
        if recording is not None:  # the recorded iteration ran out of memory: drawn as far
            result["picture"] = str(bagualu.plot_iteration(picture, recording.stop()))
        if use:
            result["stats"] = bagualu.stats()
            losses = {}
            bagualu.uninstall()
    return result


def time_key(device: str) -> str:
    """Iteration time to compare: CPU time on CPU (the machine is shared and noisy), wall time
    on CUDA (the GPU works while the CPU waits)."""
    return "iteration_s" if torch.device(device).type == "cuda" else "iteration_cpu_s"


def summarize(results: List[Dict[str, Any]], iterations: int, key: str = "iteration_cpu_s"
              ) -> str:
    """A table comparing policies: finished iterations, OOM, median iteration time, peak."""
    what = "wall" if key == "iteration_s" else "CPU"
    rows = [f"| policy | finished | OOM | median iteration {what} time (s) | "
            "peak activation (MiB) | offloads | fp8 | recomputed ops |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        times = r[key][1:] or r[key]
        med = statistics.median(times) if times else float("nan")
        lines = r["lines"]
        peak = max((ln["peak_bytes"] for ln in lines), default=0) / (1 << 20)
        rows.append("| {} | {}/{} | {} | {:.3f} | {:.1f} | {} | {} | {} |".format(
            r["policy"], r["finished"], iterations, "yes" if r["oom"] else "no", med, peak,
            sum(ln["offloads"] for ln in lines), sum(ln["fp8_casts"] for ln in lines),
            sum(ln["recomputed_ops"] for ln in lines)))
    return "\n".join(rows)


def run_distributed(args: argparse.Namespace, cfg: MoEConfig) -> None:
    """One pipeline stage per rank under torchrun."""
    import torch.distributed as dist
    os.environ.setdefault("BGL_JOB_ID", "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "job"))
    backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if backend == "nccl" \
        else torch.device("cpu")
    if args.pipeline == "torch":
        return run_torch_pipeline(args, cfg, rank, world, device)
    policy = "bagualu" if args.policy in ("all", "plain") else args.policy
    bagualu.install(capacity=args.capacity, policy=policy, device=device,
                    governor=args.governor, pipeline_rank=rank, pipeline_stages=world,
                    micro_batches=args.micro_batches)
    stage = _build_stage(cfg, args.seed, rank, world, device)
    bagualu.instrument(stage, cfg.info())
    corpus = DriftingCorpus(cfg, seed=args.seed + 1)
    opt = torch.optim.SGD(stage.parameters(), lr=0.05)
    shape = (cfg.micro_batch_size, cfg.seq_len, cfg.hidden)
    runner = bagualu.schedule.P2PStage(rank, world, args.micro_batches, shape, device=device)
    gmb = 0
    for it in range(args.iterations):
        data = [corpus.batch(it) for _ in range(args.micro_batches)]

        def fwd(mb: int, x: Optional[torch.Tensor]) -> torch.Tensor:
            stage.set_spike(spike_for(gmb + mb, args.spike_every, args.spike_size))
            inp = data[mb][0].to(device) if rank == 0 else x
            out = stage(inp)
            if rank == world - 1:
                return torch.nn.functional.cross_entropy(
                    out.view(-1, cfg.vocab), data[mb][1].to(device).view(-1)) / args.micro_batches
            return out

        opt.zero_grad(set_to_none=True)
        bagualu.begin_iteration()
        losses = runner.run(fwd)
        opt.step()
        line = bagualu.end_iteration()
        gmb += args.micro_batches
        if rank == world - 1:
            print(f"rank {rank} iteration {it} loss {sum(losses.values()):.4f}", flush=True)
    st = bagualu.stats()
    print(f"rank {rank} finished {args.iterations} iterations governor={st['governor']} "
          f"ooms={st['ooms']}", flush=True)
    grant = st["grant_bytes"]
    enf = st["enforcer"]
    print(f"rank {rank} host grant {grant if grant is not None else 'none'} pinned capacity "
          f"{enf['pinned_capacity']} pinned peak {enf['pinned_peak']} offloads "
          f"{enf['offloads']}", flush=True)
    dist.barrier()  # every rank is still registered here
    if rank == 0 and st["governor"] == "remote":
        job = st["job_id"]
        ranks = sorted(int(s["pipeline_rank"]) for s in bagualu.sessions() if s["job_id"] == job)
        print(f"governor sessions of job {job}: pipeline ranks {ranks}", flush=True)
    dist.barrier()
    bagualu.uninstall()
    dist.barrier()
    dist.destroy_process_group()


def _build_stage(cfg: MoEConfig, seed: int, rank: int, world: int, device: torch.device
                 ) -> MoEStage:
    """This rank's layers of the full model (the same weights whatever the world size)."""
    per = cfg.layers // world
    first, last = rank * per, cfg.layers if rank == world - 1 else (rank + 1) * per
    torch.manual_seed(seed)
    full = MoEStage(cfg)
    stage = MoEStage(cfg, first, last, embed=rank == 0, head=rank == world - 1)
    stage.load_state_dict(_slice_state(full, first, last, rank == 0, rank == world - 1))
    return stage.to(device)


def run_torch_pipeline(args: argparse.Namespace, cfg: MoEConfig, rank: int, world: int,
                       device: torch.device) -> None:
    """A torch.distributed.pipelining schedule (--pipeline torch): one stage per rank
    (--torch-schedule 1f1b, gpipe) or two (interleaved: stages rank and rank + world of
    ScheduleInterleaved1F1B); bagualu is attached with bagualu.pipelining.wrap_schedule
    (--policy plain: not at all)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B)
    use = args.policy != "plain"
    chunks = 2 if args.torch_schedule == "interleaved" else 1
    n_stages = world * chunks
    if use:
        policy = "bagualu" if args.policy == "all" else args.policy
        bagualu.install(capacity=args.capacity, policy=policy, device=device,
                        governor=args.governor, pipeline_rank=rank, pipeline_stages=world,
                        micro_batches=args.micro_batches, chunks=chunks,
                        allow_fp8=not args.no_fp8)
    indices = [rank + c * world for c in range(chunks)]  # this rank's stages, chunk order
    modules = [_build_stage(cfg, args.seed, i, n_stages, device) for i in indices]
    stage = modules[0] if chunks == 1 else torch.nn.ModuleList(modules)
    if use:
        bagualu.instrument(stage, cfg.info())
    mbs, seq, n_mb = cfg.micro_batch_size, cfg.seq_len, args.micro_batches
    first, last = rank == 0, rank == world - 1  # this rank feeds x / computes the losses
    pstages = []
    for i, module in zip(indices, modules):
        # torch >= 2.6 takes requires_grad from the examples: a received activation and a
        # sent output need it, or no gradient flows between the stages
        example_in = torch.zeros(mbs, seq, dtype=torch.long) if i == 0 \
            else torch.zeros(mbs, seq, cfg.hidden, requires_grad=True)
        example_out = torch.zeros(mbs, seq, cfg.vocab) if i == n_stages - 1 \
            else torch.zeros(mbs, seq, cfg.hidden, requires_grad=True)
        pstages.append(PipelineStage(module, i, n_stages, device,
                                     input_args=(example_in.to(device),),
                                     output_args=(example_out.to(device),)))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab),
                                                 target.view(-1)) / n_mb

    if chunks > 1:
        schedule: Any = ScheduleInterleaved1F1B(pstages, n_mb, loss_fn=loss_fn)
    else:
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.torch_schedule]
        schedule = cls(pstages[0], n_mb, loss_fn=loss_fn)
    if use:
        schedule = bagualu.pipelining.wrap_schedule(schedule)
    else:
        bagualu.pipelining.fix_batch_p2p()  # plain torch 2.5.1 hangs on gloo without it
    # the k-th forward of a stage in an iteration is micro-batch k (every schedule)
    state: Dict[Any, int] = {"gmb": 0}

    def pre_forward(module: torch.nn.Module, inputs: Any) -> None:
        k = state.get(module, 0)
        module.set_spike(spike_for(state["gmb"] + k, args.spike_every, args.spike_size))
        state[module] = k + 1

    for module in modules:
        module.register_forward_pre_hook(pre_forward)
    corpus = DriftingCorpus(cfg, seed=args.seed + 1)
    opt = torch.optim.SGD(stage.parameters(), lr=0.05)
    phases: Dict[str, int] = {"warmup": 0, "steady": 0, "cooldown": 0}
    plans = 0
    for it in range(args.iterations):
        data = [corpus.batch(it) for _ in range(n_mb)]
        x = torch.cat([d[0] for d in data]).to(device)
        y = torch.cat([d[1] for d in data]).to(device)
        opt.zero_grad(set_to_none=True)
        for module in modules:
            state[module] = 0
        losses: List[torch.Tensor] = []
        if first:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        state["gmb"] += n_mb
        if use:
            for point in schedule.points:
                phases[point[0]] += 1
            plans += schedule.plans
        if last:
            total = torch.stack([loss.detach() for loss in losses]).sum()
            print(f"rank {rank} iteration {it} loss {float(total):.4f} "
                  f"exact {float(total).hex()}", flush=True)
    if use:
        st = bagualu.stats()
        print(f"rank {rank} finished {args.iterations} iterations governor={st['governor']} "
              f"ooms={st['ooms']} step points {sum(phases.values())} (warmup "
              f"{phases['warmup']} steady {phases['steady']} cooldown {phases['cooldown']}) "
              f"plans {plans}", flush=True)
        dist.barrier()
        bagualu.uninstall()
    else:
        print(f"rank {rank} finished {args.iterations} iterations plain", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _slice_state(full: MoEStage, first: int, last: int, embed: bool, head: bool
                 ) -> Dict[str, torch.Tensor]:
    out: Dict[str, torch.Tensor] = {}
    for k, v in full.state_dict().items():
        if k.startswith("layers."):
            idx = int(k.split(".")[1])
            if first <= idx < last:
                out["layers." + str(idx - first) + k[len("layers." + str(idx)):]] = v
        elif k.startswith("embed."):
            if embed:
                out[k] = v
        elif head:
            out[k] = v
    return out


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="all",
                   help="keep-all | static-under | static-over | bagualu | plain | all")
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--stages", type=int, default=4, help="pipeline stages emulated (1 process)")
    p.add_argument("--capacity", default="292MiB", help="activation memory of the device")
    p.add_argument("--spike-size", type=float, default=2.6, help="injected load factor")
    p.add_argument("--spike-every", type=int, default=16,
                   help="inject a spike every N micro-batches (0: never)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--governor", default=os.environ.get("BGL_GOVERNOR", "none"),
                   help="governor address (unix:///path); 'none': embedded planner")
    p.add_argument("--json-out", default="", help="write the results as JSON here")
    p.add_argument("--quiet", action="store_true", help="no per-iteration log lines")
    p.add_argument("--require-finish", default="",
                   help="comma-separated policies that must finish every iteration (exit "
                        "status 1 otherwise), e.g. bagualu,static-over")
    p.add_argument("--picture", default="",
                   help="bagualu's memory picture of its first spike iteration, planned "
                        "against actual (.svg, .png; bagualu.plot_iteration), written here")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--no-fp8", action="store_true",
                   help="--pipeline torch: plans never store activations in FP8, so the losses "
                        "are bit for bit plain PyTorch's (install(allow_fp8=False))")
    p.add_argument("--pipeline", choices=("p2p", "torch"), default="p2p",
                   help="under torchrun: bagualu.schedule.P2PStage (send/recv) or a "
                   "torch.distributed.pipelining schedule (--policy plain: without bagualu)")
    p.add_argument("--torch-schedule", choices=("1f1b", "gpipe", "interleaved"),
                   default="1f1b", help="the torch.distributed.pipelining schedule of "
                   "--pipeline torch (interleaved: ScheduleInterleaved1F1B, 2 stages per rank)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    cfg = MoEConfig(layers=args.layers, experts=args.experts, top_k=args.top_k,
                    seq_len=args.seq_len, hidden=args.hidden)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        run_distributed(args, cfg)
        return 0
    policies = POLICIES if args.policy == "all" else [args.policy]
    for pol in policies:
        if pol != "plain" and pol not in bagualu.POLICIES:
            print(f"error: unknown policy '{pol}' (known: {', '.join(bagualu.POLICIES)}, "
                  "plain, all)", file=sys.stderr)
            return 2
    results = []
    for pol in policies:
        print(f"=== policy {pol}", flush=True)
        results.append(train(cfg, pol, args.iterations, args.micro_batches, args.stages,
                             args.capacity, args.spike_size, args.spike_every, args.seed,
                             args.governor, args.device, log_iterations=not args.quiet,
                             picture=args.picture if pol == "bagualu" else ""))
    print()
    key = time_key(args.device)
    print(summarize(results, args.iterations, key))
    by = {r["policy"]: r for r in results}
    if "bagualu" in by and "static-over" in by and by["static-over"]["finished"] > 1:
        t_b = statistics.median(by["bagualu"][key][1:])
        t_o = statistics.median(by["static-over"][key][1:])
        what = "wall" if key == "iteration_s" else "CPU"
        print(f"\niteration {what} time static-over / bagualu: {t_o / t_b:.2f}x")
    for r in results:
        if r.get("picture"):
            what = "memory picture" if r["picture"].endswith((".svg", ".png", ".pdf")) else \
                "recorded memory series" + ("" if r["picture"] == args.picture else
                                            " (no matplotlib: no picture)")
            print(f"\nthe {what} of {r['policy']}'s iteration {r['picture_iteration']} "
                  f"({'its spike, ' if r['picture_spike'] else ''}planned against actual): "
                  f"{r['picture']}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k not in ("losses", "grads")} |
                       {"losses": [float(x) for x in r["losses"]]} for r in results], f,
                      indent=1, default=str)
    required = [x for x in args.require_finish.split(",") if x]
    failed = [x for x in required if by.get(x, {}).get("finished", 0) < args.iterations]
    if failed:
        print(f"error: {', '.join(failed)} did not finish all {args.iterations} iterations",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
