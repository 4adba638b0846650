#!/usr/bin/env python3
"""bagualu on CUDA, one scenario per process (PyTorch's allocator is fixed at the first CUDA
allocation, so each scenario needs a fresh process). Prints one line `RESULT <json>`; the pytest
wrapper (test_bagualu_cuda.py) checks it. Run: python3 tests/gpu/bagualu_cuda.py <scenario>.

Scenarios:
  swap         install() makes libbgl_alloc.so PyTorch's allocator: CUDA tensors come from the
               pool, stats() and dump_snapshot() read it.
  late         install() after CUDA was initialised: InstallError (strict), else a logged error
               and training goes on with PyTorch's allocator.
  correctness  plain PyTorch against keep-all, offload-everything, recompute, static-over
               (gradients bitwise expected with deterministic algorithms) and FP8 storage
               (gradients within 1% relative L2) on the GPU.
  bench        keep-all, static-over and bagualu side by side on the example's model; median
               iteration wall time of each (printed, and written to --json-out).
  unmodified   transformers' Mixtral, Qwen3-MoE, DeepSeek-V3 and the plain fused MoE of
               examples/unmodified.py, unchanged, on the GPU: keep-all runs out of memory at
               half its peak and bagualu finishes there with keep-all's losses; offload and
               recompute mixed in a layer against plain PyTorch (gradients bitwise with
               deterministic kernels), FP8 gradients within 1% relative L2; the planner's
               keep-all bytes (its C API) against PyTorch's saved bytes at each load.
  overhead     the hook overhead with nothing to mitigate on the GPU: plain PyTorch and bagualu
               with room for everything, alternating, on wider unmodified models (--json-out).
  fsdp2        transformers' Qwen3-MoE and Mixtral under FSDP2 (fully_shard on every block and
               the root, a world of one rank: NCCL on the GPU), tests/python/fsdp_ranks.py's
               checks on the GPU: offload + recompute against plain FSDP2 (gradients bitwise
               with deterministic kernels), FP8 within 1%, the bagualu policy at half of
               keep-all's peak, the planner's keep-all bytes against PyTorch's saved bytes.
  compiled     transformers' Qwen3-MoE with every decoder layer compiled (inductor,
               fullgraph=True, block.compile()): dynamo's counters with bagualu against plain
               compile (the same graphs after a reset, nothing new after a plain run, no graph
               break), keep-all out of memory at half its peak and bagualu finishing there with
               plain compiled gradients bit for bit (deterministic kernels), the whole block
               offloaded, recomputed (bitwise) and in FP8 (within 10%); the first iteration
               (the compile) and later iterations of plain compile and bagualu with nothing to
               mitigate (--json-out).
  compiled-recompute
               the same model compiled per operator with the experts' recompute variant
               (issue 41 item 2, compiled_recompute="auto"): the planner's run at half of
               keep-all's peak and a forced mix (experts recomputed inside the graphs, the q
               projection offloaded): graphs within the variants used, no break, plain
               compiled gradients bit for bit; the mix again compiles nothing.
  torchtitan   torchtitan 0.3.0's own trainer (torchtitan.train, one rank) on its deepseek_v3
               debug model, through --module bagualu.torchtitan: keep-all (its run without
               activation checkpointing, deterministic), bagualu at half of keep-all's step
               peak (the CUDA allocator's) with keep-all's losses and gradient norms bit for
               bit, and torchtitan's full, selective and memory_budget (0.25, 0.5, 0.75;
               compiled with inductor) checkpointing: each one's step time (median after
               the first) and peak side by side (--json-out; docs/benchmarks/engines.md,
               section "torchtitan: bagualu against torchtitan's activation
               checkpointing"). --device
               cpu runs it through the CPU harness (tests/python/torchtitan_cpu.py), smaller.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import bagualu  # noqa: E402
from moe_model import MoEConfig  # noqa: E402
from moe_train import train  # noqa: E402

ALL_OPS = ("attn_norm", "qkv_proj", "core_attn", "out_proj", "moe_norm", "router", "shared_fc1",
           "shared_act", "shared_fc2", "dispatch", "expert_fc1", "expert_act", "expert_fc2",
           "combine")


DEVICE = "cuda"  # --device cpu runs correctness and bench without a GPU (a dry run of this file)


def small() -> MoEConfig:
    return MoEConfig(layers=2, hidden=64, heads=2, experts=16, top_k=4, moe_hidden=64,
                     shared_hidden=32, vocab=128, seq_len=32, micro_batch_size=2, ep=4)


def emit(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def scenario_swap() -> dict:
    rt = bagualu.install(capacity="1GiB", policy="bagualu", device="cuda", governor="none",
                         strict=True)
    x = torch.randn(1 << 22, device="cuda")  # 16 MiB
    y = x * 2
    torch.cuda.synchronize()
    st = bagualu.stats()
    alloc = st.get("allocator", {})
    snap_path = Path(tempfile.mkdtemp()) / "snapshot.pickle"
    bagualu.dump_snapshot(str(snap_path))
    with open(snap_path, "rb") as f:
        snap = pickle.load(f)
    ok_math = bool(torch.equal(y, x * 2))
    del x, y
    return {"allocator": alloc, "swapped": bagualu.installer.cuda_allocator_swapped(),
            "segments": len(snap.get("segments", [])), "math": ok_math,
            "device": str(rt.device)}


def scenario_late() -> dict:
    torch.zeros(1, device="cuda")
    message = ""
    try:
        bagualu.install(capacity="1GiB", device="cuda", governor="none", strict=True)
    except bagualu.InstallError as e:
        message = str(e)
    bagualu.uninstall()
    r = train(small(), "bagualu", iterations=2, micro_batches=4, stages=2, capacity="64MiB",
              device="cuda", log_iterations=False)
    return {"strict_message": message, "finished": r["finished"], "oom": r["oom"],
            "swapped": bagualu.installer.cuda_allocator_swapped()}


def _losses(r: dict) -> list:
    return [float(x) for x in r["losses"]]


def _rel_l2(ref: dict, got: dict) -> float:
    """Relative L2 distance of one iteration's gradients (all parameters together)."""
    names = sorted(ref)
    a = torch.cat([ref[n].detach().flatten().double().cpu() for n in names])
    b = torch.cat([got[n].detach().flatten().double().cpu() for n in names])
    return float((a - b).norm() / a.norm())


def _grads(ref: dict, got: dict) -> dict:
    """Gradients of ``got`` against ``ref`` (lists of per-iteration {name: grad}, or one dict):
    counts, whether the same parameters have them, bitwise equality, relative L2 per
    iteration."""
    ref_its = ref if isinstance(ref, list) else [ref]
    got_its = got if isinstance(got, list) else [got]
    same = len(ref_its) == len(got_its) and all(
        sorted(a) == sorted(b) for a, b in zip(ref_its, got_its))
    return {"count": [len(g) for g in got_its], "ref_count": [len(g) for g in ref_its],
            "same_parameters": same,
            "bitwise": same and all(torch.equal(a[k], b[k])
                                    for a, b in zip(ref_its, got_its) for k in a),
            "rel_l2": [_rel_l2(a, b) for a, b in zip(ref_its, got_its)] if same else None}


def _max_rel(a: dict, b: dict) -> float:
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(_losses(a), _losses(b)))


class _PlannerSpy:
    """The model document and options of the package's last planner, to ask the planner's C
    API (through the package's binding) for its keep-all bytes at each observed load."""

    def __init__(self) -> None:
        from bagualu.planning import embedded
        self.cls = embedded.EmbeddedPlanner
        self.made: list = []
        real = self.cls.__init__

        def init(planner, model, options=None):
            self.made.append((model, options))
            real(planner, model, options)

        self.cls.__init__ = init

    def errors(self, accuracy: list) -> list:
        """Relative errors against PyTorch's saved bytes, the capture's own sample left out."""
        planner = self.cls(*self.made[-1])
        out = []
        for load, _, captured in accuracy[1:]:
            planner.reset_iteration()
            plan = planner.plan({"phase": "steady", "forward_micro_batch": 0,
                                 "load_factor": float(load)})
            out.append(abs(plan["keep_all_bytes"] - captured) / captured)
        planner.close()
        return out


def scenario_correctness() -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    kw = dict(iterations=3, micro_batches=4, stages=2, capacity="64MiB", spike_size=2.6,
              spike_every=3, device=DEVICE, log_iterations=False, collect_grads=True)
    cfg = small()
    runs = {}
    runs["keep-all"] = train(cfg, "keep-all", **kw)  # first: its install swaps the allocator
    runs["plain"] = train(cfg, "plain", **kw)  # plain PyTorch, the same seeds and data
    runs["offload"] = train(cfg, "bagualu", force={op: bagualu.OFFLOAD for op in ALL_OPS}, **kw)
    runs["recompute"] = train(cfg, "bagualu", force={
        op: bagualu.RECOMPUTE for op in ("expert_fc1", "expert_act", "expert_fc2", "shared_act",
                                         "core_attn", "attn_norm")}, **kw)
    runs["static-over"] = train(cfg, "static-over", **kw)
    runs["fp8"] = train(cfg, "bagualu", force={
        op: bagualu.FP8 for op in ("qkv_proj", "core_attn", "out_proj", "shared_act",
                                   "expert_fc1", "expert_act", "expert_fc2")}, **kw)
    base = runs["plain"]
    params = sum(1 for p in _stage_params(cfg) if p.requires_grad)
    out = {"swapped": bagualu.installer.cuda_allocator_swapped(), "parameters": params}
    for name, r in runs.items():
        grads = _grads(base["grads"], r["grads"])
        out[name] = {"finished": r["finished"], "oom": r["oom"], "losses": _losses(r),
                     "grads": grads,
                     "bitwise": _losses(r) == _losses(base) and grads["bitwise"],
                     "max_rel_loss": _max_rel(base, r),
                     "tracker": r.get("stats", {}).get("tracker", {}),
                     "enforcer": r.get("stats", {}).get("enforcer", {}),
                     "allocator_peak": r.get("stats", {}).get("allocator", {}).get(
                         "allocated_bytes_peak")}
        gc.collect()
    return out


def _stage_params(cfg: MoEConfig):
    from moe_model import MoEStage
    return list(MoEStage(cfg).parameters())


def scenario_bench(config: str, iterations: int, json_out: str) -> dict:
    if config == "large":
        cfg = MoEConfig(layers=8, experts=16, top_k=4, seq_len=512, hidden=1024)
        capacity = "4672MiB"  # the default example's 292 MiB scaled with hidden x seq_len
    else:
        cfg = MoEConfig(layers=8, experts=16, top_k=4, seq_len=128, hidden=256)
        capacity = "292MiB"
    out = {"config": config, "capacity": capacity, "policies": {}}
    # keep-all first: its install swaps the allocator, so every policy, plain PyTorch included,
    # then runs on libbgl_alloc.so and the comparison measures the hooks and plans alone.
    for pol in ("keep-all", "plain", "static-over", "bagualu"):
        r = train(cfg, pol, iterations=iterations, micro_batches=8, stages=4, capacity=capacity,
                  spike_size=2.6, spike_every=16, device=DEVICE, log_iterations=False)
        times = r["iteration_s"][1:] or r["iteration_s"]
        out["policies"][pol] = {"finished": r["finished"], "oom": r["oom"],
                                "median_s": statistics.median(times) if times else None,
                                "offloads": sum(ln["offloads"] for ln in r["lines"]),
                                "recomputed_ops": sum(ln["recomputed_ops"] for ln in r["lines"]),
                                "enforcer": r.get("stats", {}).get("enforcer", {}).get(
                                    "offloads")}
        gc.collect()
    p = out["policies"]
    if p["bagualu"]["median_s"] and p["static-over"]["median_s"]:
        out["static_over_over_bagualu"] = p["static-over"]["median_s"] / p["bagualu"]["median_s"]
    if p["plain"]["median_s"] and p["keep-all"]["median_s"]:
        out["keep_all_over_plain"] = p["keep-all"]["median_s"] / p["plain"]["median_s"]
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def scenario_unmodified() -> dict:
    import unmodified as u
    torch.use_deterministic_algorithms(True, warn_only=True)
    out = {"swapped": None, "models": {}, "skipped": []}
    try:
        import transformers  # noqa: F401
        names = list(u.MODELS)
    except ImportError:  # the GPU machine may lack it: the plain model still runs
        names = ["fused"]
        out["skipped"] = [n for n in u.MODELS if n != "fused"]
    spy = _PlannerSpy()
    for name in names:
        one: dict = {"parameters": sum(1 for p in u.build(name).parameters() if p.requires_grad)}
        full = u.train(name, "keep-all", capacity="4GiB", forced={}, device=DEVICE)
        out["swapped"] = bagualu.installer.cuda_allocator_swapped()
        peak = max(int(line["peak_bytes"]) for line in full["lines"])
        one["peak"] = peak
        errors = spy.errors(full["accuracy"])
        one["memory_model"] = {"samples": len(errors), "mean_error": statistics.mean(errors),
                               "worst_error": max(errors)}
        keep = u.train(name, "keep-all", capacity=peak // 2, device=DEVICE)
        one["keep_all_oom_at_half"] = keep["oom"] is not None
        half = u.train(name, "bagualu", capacity=peak // 2, device=DEVICE)
        one["bagualu_oom_at_half"] = half["oom"]
        one["bagualu_same_losses"] = half["losses"] == full["losses"]
        one["bagualu_grads"] = _grads(full["grads"], half["grads"])  # the same routing
        one["bagualu_moved"] = sum(ln["offloads"] + ln["fp8_casts"] + ln["recomputed_ops"]
                                   for ln in half["lines"]) + half["stats"]["tracker"]["drops"]
        plain = u.train(name, None, ep=False, device=DEVICE)
        mixed = u.train(name, "keep-all", forced=u.mixed_strategies(name, False), ep=False,
                        device=DEVICE)
        t = mixed["stats"]["tracker"]
        one["mixed_moved"] = {k: t[k] for k in ("offloads", "drops", "recomputes")}
        one["mixed_oom"] = mixed["oom"]
        one["mixed_grads"] = _grads(plain["grads"], mixed["grads"])
        one["mixed_bitwise"] = (mixed["losses"] == plain["losses"]
                                and one["mixed_grads"]["bitwise"])
        one["mixed_max_rel_loss"] = max(abs(a - b) / max(abs(a), 1e-12)
                                        for a, b in zip(plain["losses"], mixed["losses"]))
        fp8 = u.train(name, "keep-all", forced=u.mixed_strategies(name, True), ep=False,
                      device=DEVICE)
        one["fp8_casts"] = fp8["stats"]["tracker"]["fp8_casts"]
        one["fp8_oom"] = fp8["oom"]
        one["fp8_grads"] = _grads(plain["grads"], fp8["grads"])
        one["fp8_max_rel_loss"] = max(abs(a - b) / max(abs(a), 1e-12)
                                      for a, b in zip(plain["losses"], fp8["losses"]))
        out["models"][name] = one
        gc.collect()
    return out


def scenario_compiled(json_out: str) -> dict:
    import unmodified as u
    from torch._dynamo.utils import counters
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict = {"skipped": []}
    try:
        import transformers  # noqa: F401
    except ImportError:  # the GPU machine may lack it
        out["skipped"] = ["qwen3_moe"]
        return out
    base = dict(layers=2, ep=False, spike_every=0, device=DEVICE, compiled="in-place",
                compile_options={"fullgraph": True}, compiled_operators="block")

    def run(policy, fresh: bool, **kw) -> dict:
        if fresh:
            torch._dynamo.reset()
        counters.clear()
        r = u.train("qwen3_moe", policy, **{**base, **kw})
        r["dynamo"] = [counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())]
        return r

    def times(r: dict) -> dict:
        return {"first_s": r["times_ms"][0] / 1e3,
                "later_ms": statistics.median(r["times_ms"][1:])}

    # bagualu first: install() swaps the allocator before the first CUDA allocation.
    full = run("keep-all", True, capacity="4GiB", forced={})
    out["swapped"] = bagualu.installer.cuda_allocator_swapped()
    plain = run(None, True)  # iterations and data as every run below: the same gradients
    out["parameters"] = len(plain["grads"])
    out["dynamo"] = {"plain": plain["dynamo"], "keep_all_fresh": full["dynamo"]}
    out["keep_all_grads"] = _grads(plain["grads"], full["grads"])
    out["operators"] = sorted(o["name"] for o in full["description"]["operators"])
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    out["peak"] = peak
    keep = run("keep-all", False, capacity=peak // 2)
    out["keep_all_oom_at_half"] = keep["oom"] is not None
    half = run("bagualu", False, capacity=peak // 2)
    out["half"] = {"oom": half["oom"], "dynamo": half["dynamo"],
                   "same_losses": half["losses"] == plain["losses"],
                   "tracker": half["stats"]["tracker"],
                   "grads": _grads(plain["grads"], half["grads"])}
    for strategy in ("offload", "recompute", "fp8"):
        f = run("bagualu", False, capacity="4GiB", forced={"block": strategy})
        out[strategy] = {"oom": f["oom"], "dynamo": f["dynamo"],
                         "tracker": f["stats"]["tracker"],
                         "grads": _grads(plain["grads"], f["grads"])}
    # Per operator (the default; issue 41): the stash ops in the blocks' graphs, each saved
    # tensor placed by its operator's plan, its copies on the enforcer's streams.
    per_op = dict(compiled_operators="operators")
    full_op = run("keep-all", True, capacity="4GiB", forced={}, **per_op)
    peak_op = max(int(line["peak_bytes"]) for line in full_op["lines"])
    half_op = run("bagualu", True, capacity=peak_op // 2, allow_fp8=False, **per_op)
    out["per_operator"] = {
        "operators": sorted(o["name"] for o in full_op["description"]["operators"]),
        "peak": peak_op, "oom": half_op["oom"], "dynamo": half_op["dynamo"],
        "same_losses": half_op["losses"] == plain["losses"],
        "tracker": half_op["stats"]["tracker"], "compiled": half_op["stats"].get("compiled"),
        "grads": _grads(plain["grads"], half_op["grads"])}
    # Timing, with inductor's caches warm for both (the first runs above filled them).
    timing = {"plain": times(run(None, True, iterations=4)),
              "bagualu": times(run("bagualu", True, capacity="4GiB", iterations=4)),
              "bagualu_per_operator": times(run("bagualu", True, capacity="4GiB", iterations=4,
                                                compiled_operators="operators"))}
    out["timing"] = timing
    if json_out:
        Path(json_out).write_text(json.dumps(timing, indent=1))
    return out


def scenario_compiled_recompute() -> dict:
    """Issue 41 item 2 on the GPU: every decoder layer of Qwen3-MoE compiled with inductor
    (fullgraph=True, in place), per operator with the experts' recompute variant
    (install(compiled_recompute="auto")): the planner's own run at half of the per-operator
    keep-all peak, and a forced mix (the experts recomputed inside the compiled graphs, the
    q projection offloaded, the rest kept) that uses the variant whatever the GPU's plans
    choose, each from a fresh dynamo: graphs, breaks, the variants' calls, operators
    recomputed, tracker counts, the points' bytes and gradients against plain compiled
    (deterministic kernels); then the forced mix again on the warm dynamo (nothing
    compiled: each variant hits its cache entry)."""
    import unmodified as u
    from torch._dynamo.utils import counters
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict = {"skipped": []}
    try:
        import transformers  # noqa: F401
    except ImportError:  # the GPU machine may lack it
        out["skipped"] = ["qwen3_moe"]
        return out
    base = dict(layers=2, ep=False, spike_every=0, device=DEVICE, compiled="in-place",
                compile_options={"fullgraph": True}, compiled_operators="operators")

    def run(policy, fresh: bool, **kw) -> dict:
        if fresh:
            torch._dynamo.reset()
        counters.clear()
        r = u.train("qwen3_moe", policy, **{**base, **kw})
        r["dynamo"] = [counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())]
        return r

    def brief(r: dict) -> dict:
        return {"oom": r["oom"], "dynamo": r["dynamo"],
                "same_losses": r["losses"] == plain["losses"],
                "tracker": r["stats"]["tracker"],
                "recompute": r["stats"]["compiled"]["recompute"],
                "mixed_blocks": r["stats"]["compiled"]["mixed_blocks"],
                "points": [(p["predicted_bytes"], p["actual_bytes"]) for line in r["lines"]
                           for p in line["points"]
                           if p.get("predicted_bytes") and p.get("actual_bytes")],
                "grads": _grads(plain["grads"], r["grads"])}

    full = run("keep-all", True, capacity="4GiB", forced={})  # first: the allocator swap
    out["swapped"] = bagualu.installer.cuda_allocator_swapped()
    plain = run(None, True)
    out["parameters"] = len(plain["grads"])
    out["plain_dynamo"] = plain["dynamo"]
    peak = max(int(line["peak_bytes"]) for line in full["lines"])
    out["peak"] = peak
    out["planned"] = brief(run("bagualu", True, capacity=peak // 2, allow_fp8=False,
                               compiled_recompute="auto"))
    forced = dict(capacity="4GiB", compiled_recompute="auto",
                  forced={"mlp.experts": "recompute", "self_attn.q_proj": "offload"})
    out["forced"] = brief(run("bagualu", True, **forced))
    out["again"] = brief(run("bagualu", False, **forced))
    return out


def scenario_fsdp2() -> dict:
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import fsdp_ranks
    torch.use_deterministic_algorithms(True, warn_only=True)
    out: dict = {"skipped": []}
    try:
        import transformers  # noqa: F401
    except ImportError:  # the GPU machine may lack it
        out["skipped"] = ["qwen3_moe", "mixtral"]
        return out
    if DEVICE == "cuda":  # the allocator first: FSDP2's first all-gather initialises CUDA
        bagualu.install(capacity="1GiB", governor="none", log_iterations=False)
        out["swapped"] = bagualu.installer.cuda_allocator_swapped()
        bagualu.uninstall()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1)
    try:
        out["qwen3_moe"] = fsdp_ranks.scenario("qwen3_moe", False, False, "accumulate",
                                               device=DEVICE)
        out["mixtral"] = fsdp_ranks.scenario("mixtral", True, True, "pipeline", device=DEVICE)
    finally:
        dist.destroy_process_group()
    return out


def _timing_models() -> list:
    """The models the timing scenarios run: two Hugging Face MoE models, or the package's own
    example where transformers is not installed."""
    try:
        import transformers  # noqa: F401
        return ["qwen3_moe", "mixtral"]
    except ImportError:
        return ["fused"]


def scenario_overhead(iterations: int, repeats: int, json_out: str) -> dict:
    import unmodified as u
    out: dict = {"runs": {}}
    for name in _timing_models():
        for width in (4, 8):
            plain, hooked, ratios = [], [], []
            for _ in range(repeats):
                one = {}
                for pol in ("keep-all", None):  # keep-all first: its install swaps
                    r = u.train(name, "bagualu" if pol else None, capacity="64GiB",
                                iterations=iterations, ep=False, width=width, seq=512,
                                device=DEVICE)
                    assert r["oom"] is None, r["oom"]
                    one[pol] = statistics.median(r["times_ms"][1:])
                    gc.collect()
                plain.append(one[None])
                hooked.append(one["keep-all"])
                ratios.append(one["keep-all"] / one[None] - 1)
            out["runs"][f"{name} width {width}"] = {
                "plain_ms": statistics.median(plain), "bagualu_ms": statistics.median(hooked),
                "overhead_median": statistics.median(ratios), "overhead_min": min(ratios),
                "overhead_max": max(ratios)}
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def scenario_issue_order(iterations: int, repeats: int, json_out: str) -> dict:
    """The plans' dual-batch issue order carried out against the same plans in program order
    (serial), bagualu at half of keep-all's peak, alternating: on a GPU the copies overlap
    compute for real."""
    import unmodified as u
    out: dict = {"runs": {}}
    for name in _timing_models():
        kw = dict(ep=False, width=4, seq=512, device=DEVICE)
        cap = u.keep_all_peak(name, **kw) // 2
        times = {"dual-batch": [], "serial": []}
        ratios, issued, losses = [], 0, {}
        for _ in range(repeats):
            one = {}
            for order in ("dual-batch", "serial"):
                r = u.train(name, "bagualu", capacity=cap, iterations=iterations,
                            issue_order=order, **kw)
                assert r["oom"] is None, r["oom"]
                one[order] = statistics.median(r["times_ms"][1:])
                times[order].append(one[order])
                losses[order] = r["losses"]
                if order == "dual-batch":
                    issued = r["stats"]["enforcer"]["scheduled_issued"]
                gc.collect()
            ratios.append(one["dual-batch"] / one["serial"])
        out["runs"][name] = {
            "capacity_bytes": cap, "dual_batch_ms": statistics.median(times["dual-batch"]),
            "serial_ms": statistics.median(times["serial"]),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "scheduled_issued": issued,
            "same_losses": losses["dual-batch"] == losses["serial"]}
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def scenario_torchtitan(json_out: str) -> dict:
    import re
    import subprocess
    out: dict = {"skipped": []}
    try:
        import tokenizers  # noqa: F401
        import torchtitan  # noqa: F401
    except ImportError as e:  # the GPU machine may lack them (scripts/setup-torchtitan.sh)
        out["skipped"] = [str(e)]
        return out
    sys.path.insert(0, str(ROOT / "tests" / "python"))
    import torchtitan_cpu as harness
    work = Path(tempfile.mkdtemp(prefix="bgl-torchtitan-"))
    assets = work / "assets"
    harness.write_assets(assets)
    cuda = DEVICE == "cuda"
    runner = ROOT / "tests" / ("gpu/torchtitan_cuda.py" if cuda else "python/torchtitan_cpu.py")
    shape = ["--training.local_batch_size", "4" if cuda else "2",
             "--training.seq_len", "2048" if cuda else "64"]
    steps = 4 if cuda else 3
    tt = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"]

    def launch(name: str, args: list) -> dict:
        d = work / name
        d.mkdir()
        env = dict(os.environ, BGL_CACHE_DIR=str(d / "cache"),
                   PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
        if not cuda:
            env["OMP_NUM_THREADS"] = "1"
        extra = [] if cuda else ["--measure"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", str(runner), str(assets), *extra,
               "--dump_folder", str(d / "out"), *shape, "--training.steps", str(steps),
               "--checkpoint.no-enable", "--debug.seed", "0", "--debug.deterministic",
               "--metrics.log_freq", "1", "--training.disable_cuda_graphs", *args]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=d)
        text = r.stdout + r.stderr
        steps_seen = {int(m[1]): (float(m[2]), int(m[3])) for m in re.finditer(
            r"HARNESS rank 0 step (\d+) ms ([\d.]+) heap_peak (-?\d+)", text)}
        later = [v for k, v in sorted(steps_seen.items()) if k > 1]
        res = {"rc": r.returncode,
               "losses": [(m[2], m[3]) for m in re.finditer(
                   r"HARNESS rank 0 step (\d+) loss (\S+) grad_norm (\S+)", text)],
               "ms": statistics.median(v[0] for v in later) if later else None,
               "peak_bytes": max(v[1] for v in later) if later else None,
               "lines": re.findall(r"bagualu: iter \d+ .*", text)}
        if r.returncode != 0:
            res["tail"] = text[-3000:]
        return res

    runs = {"keep-all": launch("keep-all", tt + ["activation-checkpoint:none"])}
    peak = runs["keep-all"]["peak_bytes"] or 0
    capacity = f"{max(peak // 2, 1 << 20)}B"
    runs["bagualu"] = launch("bagualu", ["--module", "bagualu.torchtitan", "--config",
                                         "deepseek_v3_debugmodel", "--bagualu.capacity",
                                         capacity, "--bagualu.governor", "none"])
    runs["full"] = launch("full", tt + ["activation-checkpoint:full"])
    runs["selective"] = launch("selective", tt + ["activation-checkpoint:selective"])
    backend = ["--compile.enable"] + ([] if cuda else ["--compile.backend", "aot_eager"])
    for b in (0.25, 0.5, 0.75):
        runs[f"budget-{b:g}"] = launch(f"budget-{b:g}", tt + backend + [
            "activation-checkpoint:memory-budget", "--activation-checkpoint.memory-budget",
            str(b)])
    out.update({"capacity": capacity, "keep_all_peak": peak, "runs": runs,
                "same_losses": runs["bagualu"]["losses"] == runs["keep-all"]["losses"]})
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", choices=["swap", "late", "correctness", "bench", "unmodified",
                                         "overhead", "issue-order", "fsdp2", "compiled",
                                         "compiled-recompute", "torchtitan"])
    ap.add_argument("--config", default="default", choices=["default", "large"])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--json-out", default="")
    ap.add_argument("--repeats", type=int, default=5,
                    help="overhead, issue-order: alternating pairs")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cpu" and args.scenario in ("swap", "late"):
        print(f"scenario {args.scenario} needs CUDA", file=sys.stderr)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 77
    if args.scenario == "swap":
        emit(scenario_swap())
    elif args.scenario == "late":
        emit(scenario_late())
    elif args.scenario == "correctness":
        emit(scenario_correctness())
    elif args.scenario == "unmodified":
        emit(scenario_unmodified())
    elif args.scenario == "fsdp2":
        emit(scenario_fsdp2())
    elif args.scenario == "compiled":
        emit(scenario_compiled(args.json_out))
    elif args.scenario == "compiled-recompute":
        emit(scenario_compiled_recompute())
    elif args.scenario == "torchtitan":
        emit(scenario_torchtitan(args.json_out))
    elif args.scenario == "overhead":
        emit(scenario_overhead(args.iterations, args.repeats, args.json_out))
    elif args.scenario == "issue-order":
        emit(scenario_issue_order(args.iterations, args.repeats, args.json_out))
    else:
        emit(scenario_bench(args.config, args.iterations, args.json_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
