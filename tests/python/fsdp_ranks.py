"""One rank of the FSDP2 checks (test_fsdp.py runs it under torchrun, 2 gloo ranks): unmodified
transformers models from tiny configs (examples/unmodified.py), every decoder block and then the
root wrapped with ``fully_shard``, trained plain and with bagualu from the same weights and data
(each rank its own micro-batches), in the gradient-accumulation loop
(``bagualu.accumulate_gradients``) or as stage 0 of a 4-stage 1F1B pipeline in one process
(four forwards in flight). Writes one JSON file per rank with what test_fsdp.py asserts:
gradients of every parameter's local shard against plain FSDP2 (bitwise, or the relative L2
error), losses, peaks, counters, and the memory model (the planner's own keep-all bytes at each
micro-batch's load against the activation bytes PyTorch saved in the layers, counted here by a
saved-tensors hook of our own on the plain run).

    torchrun --nproc_per_node 2 tests/python/fsdp_ranks.py OUT_DIR [scenario ...]
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))
torch.set_num_threads(1)

import bagualu  # noqa: E402
import unmodified  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

MICRO_BATCHES = 4


def shard(model: torch.nn.Module, reshard: bool, prefetch: bool, device: str = "cpu"
          ) -> List[torch.nn.Module]:
    """fully_shard on every decoder block, then the root (torchtitan's way), over every rank
    of the default group on ``device``; ``prefetch``: explicit forward and backward prefetching
    of the next block's all-gather."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    blocks = bagualu.layers(model)
    for b in blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if prefetch:
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return blocks


class SavedBytes:
    """PyTorch's saved activation bytes in the decoder blocks of one forward, counted here
    (not by bagualu): unique storages saved while a block runs, leaving out parameters (and
    FSDP2's unsharded ones, views of nn.Parameter objects) and the tensors a block receives
    from outside besides its input (rotary tables, masks); storages that died before the
    forward ended (graph pieces leading nowhere) are left out."""

    def __init__(self, blocks: List[torch.nn.Module]) -> None:
        self.inside = 0
        self.external: set = set()
        self.seen: Dict[int, Any] = {}
        self.handles = []
        for b in blocks:
            self.handles.append(b.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(b.register_forward_hook(self._post))

    def _pre(self, m, args, kwargs) -> None:
        self.inside += 1
        tensors = [v for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
        for v in tensors[1:]:
            self.external.add(v.untyped_storage().data_ptr())

    def _post(self, m, args, out) -> None:
        self.inside -= 1

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.inside and t.numel() > 0 and not isinstance(t, torch.nn.Parameter) \
                and not isinstance(t._base, torch.nn.Parameter):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key not in self.external:
                hit = self.seen.get(key)
                if hit is None or hit[0]() is not st:
                    self.seen[key] = (weakref.ref(st), st.nbytes())
        return t

    def take(self) -> int:
        n = sum(nb for ref, nb in self.seen.values() if ref() is not None)
        self.seen.clear()
        self.external.clear()
        return n

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def train(name: str, policy: Optional[str], capacity: Any = "4GiB",
          forced: Optional[Dict[str, str]] = None, reshard: bool = True,
          prefetch: bool = False, loop: str = "accumulate", iterations: int = 2,
          same_data: bool = False, measure: bool = False, ddp: bool = False,
          device: str = "cpu", checkpoint: bool = False,
          allow_fp8: bool = True, compiled: bool = False,
          compiled_recompute: Any = None) -> Dict[str, Any]:
    """Trains ``name`` under FSDP2 (SGD, lr 0.1) for ``iterations`` steps of MICRO_BATCHES
    micro-batches; ``policy`` None: plain FSDP2. Returns what the checks need."""
    rank = dist.get_rank()
    t0 = time.perf_counter()
    n = MICRO_BATCHES
    stages = 4 if loop == "pipeline" else 1
    if policy is not None:
        bagualu.install(capacity=capacity, policy=policy, governor="none", device=device,
                        pipeline_stages=stages, micro_batches=n, log_iterations=False,
                        allow_fp8=allow_fp8, compiled_recompute=compiled_recompute)
    model = unmodified.build(name, seed=0).to(device)  # the same weights on every rank
    if ddp:
        from torch.nn.parallel import DistributedDataParallel
        blocks = bagualu.layers(model)
        model = DistributedDataParallel(model)
    else:
        if checkpoint:  # torch.utils.checkpoint around every block, then FSDP2 (torchtitan's order)
            unmodified._checkpoint_blocks(model)
        if compiled:  # every block compiled in place, then FSDP2 (torchtitan's order)
            unmodified.compile_blocks(model, "in-place", fullgraph=True, backend="aot_eager")
        blocks = shard(model, reshard, prefetch, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs = [x.to(device) for x in unmodified.batches(n * iterations, spike_every=0,
                                                   seed=1 + (0 if same_data else rank))]
    saved = SavedBytes(blocks) if measure else None
    out: Dict[str, Any] = {"losses": [], "oom": None, "lines": [], "saved": [], "ms": []}
    if policy is not None:
        bagualu.instrument(model)
        if forced is not None:
            bagualu.force_strategies(forced)

    def loss_of(i: int) -> torch.Tensor:
        if saved is not None:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                loss = unmodified.loss_of(model, xs[i]) / n
            out["saved"].append(saved.take())
            return loss
        return unmodified.loss_of(model, xs[i]) / n

    try:
        for it in range(iterations):
            t_it = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if loop == "accumulate" and policy is not None:
                losses = bagualu.accumulate_gradients(lambda mb: loss_of(it * n + mb), n)
                out["losses"] += [float(v) for v in losses]
                out["lines"].append(bagualu.history()[-1])
            elif loop == "accumulate":
                for mb in range(n):
                    loss = loss_of(it * n + mb)
                    loss.backward()
                    out["losses"].append(float(loss.detach()))
            else:  # stage 0 of a 4-stage 1F1B pipeline: up to four forwards in flight
                pending: Dict[int, torch.Tensor] = {}
                if policy is not None:
                    bagualu.begin_iteration()
                for phase, f, b in bagualu.schedule.one_f_one_b(n, stages, 0):
                    if policy is not None:
                        bagualu.step_point(phase, f, b)
                    if f is not None:
                        if policy is not None:
                            with bagualu.forward(f):
                                pending[f] = loss_of(it * n + f)
                        else:
                            pending[f] = loss_of(it * n + f)
                    if b is not None:
                        if policy is not None:
                            with bagualu.backward(b):
                                pending[b].backward()
                        else:
                            pending[b].backward()
                        out["losses"].append(float(pending.pop(b).detach()))
                if policy is not None:
                    out["lines"].append(bagualu.end_iteration())
            out["ms"].append((time.perf_counter() - t_it) * 1e3)
            if it == 0:
                out["grads0"] = grads_of(model)
            if it + 1 < iterations:
                opt.step()
    except bagualu.OutOfMemoryError as e:
        out["oom"] = str(e)
    out["grads"] = grads_of(model)
    if saved is not None:
        saved.remove()
    if policy is not None:
        st = bagualu.stats()
        out["stats"] = {"tracker": st["tracker"], "enforcer": st["enforcer"],
                        "compiled": st.get("compiled")}
        out["accuracy"] = st.get("memory_model", {}).get("points", [])
        out["keep_all"] = planner_keep_all([a[0] for a in out["accuracy"]]) \
            if out["accuracy"] else []
        bagualu.uninstall()
    out["seconds"] = time.perf_counter() - t0
    return out


def grads_of(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """This rank's shard of every parameter's gradient."""
    return {k: getattr(p.grad, "to_local", lambda: p.grad)().detach().clone()
            for k, p in model.named_parameters() if p.grad is not None}


def planner_keep_all(loads: List[float]) -> List[float]:
    """The planner's own keep-all bytes (bgl_planner_plan through the package's binding) of
    the registered model at each load."""
    from bagualu.planning.embedded import EmbeddedPlanner
    gov = bagualu.current().governor
    planner = EmbeddedPlanner(gov._model, gov._options)
    try:
        out = []
        for load in loads:
            planner.reset_iteration()
            plan = planner.plan({"phase": "steady", "forward_micro_batch": 0,
                                 "load_factor": float(load)})
            out.append(float(plan["keep_all_bytes"]))
        return out
    finally:
        planner.close()


def compare(ref: Dict[str, torch.Tensor], got: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Gradients of a run against plain FSDP2's: the names, how many differ bit for bit, and
    the relative L2 error over all of them (this rank's shards)."""
    names = sorted(ref)
    same = sorted(got) == names
    differ = [k for k in names if k in got and not torch.equal(ref[k], got[k])]
    a = torch.cat([ref[k].flatten().double() for k in names])
    b = torch.cat([got[k].flatten().double() for k in names]) if same else a * 0
    return {"count": len(names), "same_names": same, "differ": differ[:5],
            "n_differ": len(differ), "rel_l2": float((a - b).norm() / a.norm()),
            "ref_nonzero": bool(a.abs().sum() > 0)}


def summary(r: Dict[str, Any]) -> Dict[str, Any]:
    return {k: v for k, v in r.items() if k not in ("grads", "grads0")}


def scenario(name: str, reshard: bool, prefetch: bool, loop: str, device: str = "cpu"
             ) -> Dict[str, Any]:
    """Plain FSDP2, then bagualu: keep-all (peak, memory model), forced offload+recompute and
    FP8 mixes, and the bagualu policy at half of keep-all's peak (tests/gpu runs it on CUDA)."""
    kw = dict(reshard=reshard, prefetch=prefetch, loop=loop, device=device)
    res: Dict[str, Any] = {}
    plain = train(name, None, measure=True, **kw)
    res["plain"] = summary(plain)
    full = train(name, "keep-all", forced={}, **kw)  # records: every storage its own block
    res["keep_all"] = summary(full)
    res["keep_all"]["grads"] = compare(plain["grads"], full["grads"])
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    res["peak"] = peak
    for label, fp8 in (("mixed", False), ("fp8", True)):
        r = train(name, "keep-all", forced=unmodified.mixed_strategies(name, fp8),
                  iterations=1, **kw)
        res[label] = summary(r)
        res[label]["grads"] = compare(plain["grads0"], r["grads"])
    # Compared bit for bit with plain FSDP2: no plan may store an activation in FP8.
    r = train(name, "bagualu", capacity=peak // 2, allow_fp8=False, **kw)
    res["half"] = summary(r)
    res["half"]["grads"] = compare(plain["grads"], r["grads"])
    return res


def ddp_check(name: str) -> Dict[str, Any]:
    """DistributedDataParallel needs nothing of bagualu: offload and recompute mixed in a layer
    give plain DDP's gradients bit for bit."""
    plain = train(name, None, ddp=True, iterations=1)
    r = train(name, "keep-all", forced=unmodified.mixed_strategies(name, False), ddp=True,
              iterations=1)
    out = summary(r)
    out["grads"] = compare(plain["grads"], r["grads"])
    out["plain_losses"] = plain["losses"]
    return out


def bench(name: str = "qwen3_moe", repeats: int = 3) -> Dict[str, Any]:
    """Iteration wall times (ms, after the first iteration) of FSDP2 with bagualu at half of
    keep-all's peak against FSDP2 with torch.utils.checkpoint around every block (which keeps
    only the block inputs, well under that capacity), alternating, ``repeats`` pairs."""
    full = train(name, "keep-all", forced={}, iterations=1)
    cap = max(int(line["peak_bytes"]) for line in full["lines"]) // 2
    out: Dict[str, Any] = {"capacity": cap, "bagualu": [], "checkpoint": [], "plain": []}
    for _ in range(repeats):
        out["bagualu"] += train(name, "bagualu", capacity=cap, iterations=4)["ms"][1:]
        out["checkpoint"] += train(name, None, checkpoint=True, iterations=4)["ms"][1:]
        out["plain"] += train(name, None, iterations=4)["ms"][1:]
    return out


def pipeline_stages(name: str = "qwen3_moe") -> Dict[str, Any]:
    """FSDP2 inside the stages of torch's Schedule1F1B (examples/unmodified_pipeline.py
    --fsdp: a (pp=2, dp=1) mesh, fully_shard on each stage's blocks and the stage), plain,
    keep-all and bagualu at half of each rank's keep-all peak (the embedded planner), and
    keep-all without FSDP2: the last rank's losses, the peaks and what was mitigated."""
    import argparse
    import unmodified_pipeline as up
    args = argparse.Namespace(model=name, schedule="1f1b", governor="none", layers=4,
                              micro_batches=4, iterations=2, spike_every=3, seed=0, fsdp=True,
                              no_fp8=True)  # the losses are compared bit for bit
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    plain = up.train(args, rank, world, None)
    keep = up.train(args, rank, world, "keep-all")
    tight = up.train(args, rank, world, "bagualu", keep["peak"] // 2)
    unsharded = up.train(argparse.Namespace(**dict(vars(args), fsdp=False)), rank, world,
                         "keep-all")
    return {"plain": plain["losses"], "keep_all": keep["losses"], "bagualu": tight["losses"],
            "peak": keep["peak"], "peak_without_fsdp": unsharded["peak"],
            "ooms": tight["stats"]["ooms"],
            "mitigated": tight["mitigated"], "plans": tight["plans"],
            "seconds": time.perf_counter() - t0}


def oom_check(name: str) -> Dict[str, Any]:
    """keep-all at half its own peak runs out of memory. Both ranks train on the same data
    here, so they run out at the same operator of the same forward and no rank is left waiting
    in a collective."""
    full = train(name, "keep-all", forced={}, same_data=True, iterations=1)
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    r = train(name, "keep-all", capacity=peak // 2, same_data=True, iterations=1)
    return {"peak": peak, "oom": r["oom"]}


def compiled_blocks(name: str = "qwen3_moe") -> Dict[str, Any]:
    """Every block compiled, then fully_shard (torchtitan's order), placed per operator:
    plain compiled FSDP2, keep-all (its peak), the bagualu policy at half of it."""
    kw: Dict[str, Any] = dict(reshard=True, prefetch=False, loop="pipeline", compiled=True)
    torch._dynamo.reset()
    plain = train(name, None, **kw)
    full = train(name, "keep-all", forced={}, **kw)
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    r = train(name, "bagualu", capacity=peak // 2, allow_fp8=False, **kw)
    res = {"plain": summary(plain), "peak": peak, "half": summary(r)}
    res["half"]["grads"] = compare(plain["grads"], r["grads"])
    # Recompute per operator (install(compiled_recompute="auto"): the experts' group, two
    # compiled variants): layer 0's experts recomputed in every plan (its blocks run the
    # experts' variant), the other layers' blocks the plain one, the q projection offloaded.
    v = train(name, "bagualu", capacity="4GiB", allow_fp8=False, compiled_recompute="auto",
              forced={"L0.mlp.experts": "recompute", "self_attn.q_proj": "offload"}, **kw)
    res["recompute"] = summary(v)
    res["recompute"]["grads"] = compare(plain["grads"], v["grads"])
    return res


SCENARIOS = {
    # reshard_after_forward=False, FSDP2's implicit prefetching, gradient accumulation
    "qwen3_moe": lambda: scenario("qwen3_moe", False, False, "accumulate"),
    # reshard_after_forward=True, explicit forward and backward prefetching of the next
    # block's all-gather, four forwards in flight (stage 0 of a 4-stage 1F1B pipeline)
    "mixtral": lambda: scenario("mixtral", True, True, "pipeline"),
    "oom": lambda: oom_check("qwen3_moe"),
    "ddp": lambda: ddp_check("qwen3_moe"),
    "pipeline_stages": lambda: pipeline_stages(),
    "compiled": lambda: compiled_blocks(),
    # not a check: run by name (docs/benchmarks/engines.md, section "FSDP2: bagualu against
    # per-block checkpointing")
    "bench": lambda: bench(),
}


def main() -> int:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:] or [s for s in SCENARIOS if s != "bench"]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    result: Dict[str, Any] = {}
    for s in names:
        try:
            result[s] = SCENARIOS[s]()
        except Exception:  # reported per scenario; the other rank may hang: fail fast
            result[s] = {"error": traceback.format_exc()}
            (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
            print(f"[rank{rank}] {s} failed:\n{result[s]['error']}", flush=True)
            os._exit(1)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
