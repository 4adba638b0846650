"""Issue 41 item 2, measured: what recompute per operator inside compiled blocks would cost and
save, through a bounded set of compiled variants per block, against what bagualu does today
(per-operator keep/offload/FP8 and whole-block recompute).

Two parts, each per model (Qwen3-MoE and Mixtral from examples/unmodified.py):

``variants`` (torch only, no bagualu): every decoder layer compiled in place
(``fullgraph=True``, aot_eager, the min-cut partitioner). A variant is one recompute set (the
module paths, within a block, of the operators to recompute); its compiled graphs are told apart
by dynamo's guard on the identity of the saved-tensor hooks in effect
(``AUTOGRAD_SAVED_TENSORS_HOOKS``): each variant pushes its own pair of inlineable
graph-module hooks (identity here; bagualu's stash/unstash pair in a real implementation), and
a joint-graph pass run at compile time tags the forward nodes of that set's operators
``MUST_RECOMPUTE`` (the partitioner then saves the operators' inputs and recomputes the rest in
the backward). Reported per variant: the bytes a block's backward takes from its forward (the
backward graph's inputs other than gradients), the compile time of its first call, the CPU time
of later iterations, and dynamo's graph and recompile counts when the variants are switched
micro-batch by micro-batch (each variant compiles once; switching back hits the cache).

``planner``: the planner's own answer at one capacity (a fraction of keep-all's peak) for the
compiled per-operator layer graph bagualu registers (recompute not allowed inside a compiled
block, today's) and for the same graph with recompute allowed per operator (what the variants
would let it choose): predicted overhead and the strategy mix.

    cd integrations/pytorch/examples
    BGL_LIB_DIR=../../../build ../../../.venv/bin/python ../../../bench/python/compiled_recompute.py

Not thread-safe (one training thread)."""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

import torch
import torch.fx as fx
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import CheckpointPolicy

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))

import unmodified  # noqa: E402

VARIANTS: Dict[str, Tuple[str, ...]] = {
    "none": (),
    "experts": ("mlp.experts",),
    "act_fn": ("mlp.experts.act_fn",),
    "self_attn": ("self_attn",),
    "norms": ("input_layernorm", "post_attention_layernorm"),
    "mlp": ("mlp",),
}


def _identity(x: Any) -> Any:
    return x


def _hook() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(_identity, (x,)))
    return fx.GraphModule(nn.Module(), g)


_pairs: Dict[str, Tuple[fx.GraphModule, fx.GraphModule]] = {v: (_hook(), _hook())
                                                            for v in VARIANTS}
_by_pack = {id(p): v for v, (p, _) in _pairs.items()}
saved_bytes: Dict[str, int] = {}


def _module_path(entry: Any) -> str:
    import re
    s = entry[0] if isinstance(entry, tuple) else str(entry)
    s = re.sub(r"^L\['[^']*'\]", "", s).replace("._orig_mod", "").replace("._modules", "")
    s = re.sub(r"\[(\d+)\]|\['([^']*)'\]", lambda m: "." + (m.group(1) or m.group(2)), s)
    return s.strip(".").replace("..", ".")


def _variant_now() -> str:
    top = torch._functorch._aot_autograd.utils.top_saved_tensors_hooks()
    return _by_pack.get(id(top[0]), "none") if top else "none"


def tag_recompute(gm: fx.GraphModule, inputs: Any) -> fx.GraphModule:
    """The joint pass: the forward nodes of the variant's operators MUST_RECOMPUTE."""
    paths = VARIANTS[_variant_now()]
    if not paths:
        return gm
    backward = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            backward.add(n)
        elif any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in backward:
            continue
        stack = n.meta.get("nn_module_stack") or {}
        mods = [_module_path(e) for e in stack.values()]
        if any(m == p or m.startswith(p + ".") for m in mods for p in paths):
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = 1
    return gm


def _backend() -> Any:
    from functorch.compile import min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch._aot_autograd.utils import make_boxed_func

    def fw(gm: fx.GraphModule, example: Any) -> Any:
        variant = _variant_now()  # compiled under the variant's hooks
        run = make_boxed_func(gm.forward)

        def counted(args: List[Any]) -> Any:
            # The distinct storages of what the forward hands its backward, less those of its
            # inputs (parameters, the views of stacked expert weights, the block's input) and
            # of its first output (the block's output, the next block's input).
            inputs = {a.untyped_storage().data_ptr() for a in args
                      if isinstance(a, torch.Tensor)}
            outs = run(args)
            seen = set(inputs)
            seen.add(outs[0].untyped_storage().data_ptr())
            total = 0
            for o in outs[1:]:
                if isinstance(o, torch.Tensor):
                    st = o.untyped_storage()
                    if st.data_ptr() not in seen:
                        seen.add(st.data_ptr())
                        total += st.nbytes()
            saved_bytes[variant] = total
            return outs

        counted._boxed_call = True  # type: ignore[attr-defined]
        return counted

    return aot_autograd(fw_compiler=fw, bw_compiler=lambda gm, ex: make_boxed_func(gm.forward),
                        partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=True)


def variants(name: str, width: int, seq: int, layers: int, iterations: int) -> List[Dict]:
    torch._dynamo.reset()
    counters.clear()
    model = unmodified.build(name, 0, layers=layers, ep_size=1, width=width)
    backend = _backend()
    for blk in model.model.layers:
        blk.compile(fullgraph=True, backend=backend)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (1, seq))
    rows = []
    grads_ref = None
    old = torch._functorch.config.joint_custom_pass
    torch._functorch.config.joint_custom_pass = tag_recompute
    try:
        for v in VARIANTS:
            pack, unpack = _pairs[v]
            times = []
            for it in range(iterations + 1):
                model.zero_grad(set_to_none=True)
                t0, c0 = time.perf_counter(), time.process_time()
                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
                times.append((time.perf_counter() - t0, time.process_time() - c0))
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            if grads_ref is None:
                grads_ref = grads
            same = all(torch.equal(a, b) for a, b in zip(grads_ref, grads))
            later = sorted(c for _, c in times[1:])
            rows.append({"variant": v, "recompute": list(VARIANTS[v]),
                         "saved_bytes_per_block": saved_bytes.get(v),
                         "first_call_s": round(times[0][0], 3),
                         "later_cpu_ms": round(1e3 * later[len(later) // 2], 2),
                         "grads_equal_none": same})
        graphs_after_variants = counters["stats"]["unique_graphs"]
        # Switched micro-batch by micro-batch: nothing new compiles.
        order = list(VARIANTS) * 2
        for v in order:
            pack, unpack = _pairs[v]
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
        graphs_after_switching = counters["stats"]["unique_graphs"]
    finally:
        torch._functorch.config.joint_custom_pass = old
    rows.append({"graphs_after_variants": graphs_after_variants,
                 "graphs_after_switching": graphs_after_switching,
                 "graph_breaks": sum(counters["graph_break"].values()),
                 "recompiles": dict(counters["recompiles"]) if "recompiles" in counters
                 else {}})
    return rows


def _captured(name: str, width: int, seq: int, layers: int, compiled: bool) -> Tuple[Any, Any, int]:
    """(planner model, options, keep-all peak) of a keep-all run, blocks compiled or eager."""
    from bagualu.planning import embedded
    made = []
    real_init = embedded.EmbeddedPlanner.__init__

    def spy(p: Any, model: Any, options: Any = None) -> None:
        made.append((model, options))
        real_init(p, model, options)

    embedded.EmbeddedPlanner.__init__ = spy
    try:
        torch._dynamo.reset()
        full = unmodified.train(name, "keep-all", "4GiB", iterations=1, micro_batches=8,
                                stages=4, ep=False, width=width, seq=seq, layers=layers,
                                compiled="in-place" if compiled else None,
                                compile_options={"fullgraph": True, "backend": "aot_eager"},
                                spike_every=0)
    finally:
        embedded.EmbeddedPlanner.__init__ = real_init
    model, options = made[-1]
    return model, options, max(line["peak_bytes"] for line in full["lines"])


def planner(name: str, width: int, seq: int, layers: int, fractions: Sequence[float],
            fp8: bool, calibration: Any = None) -> List[Dict]:
    """The planner's answer for the compiled per-operator layer graph bagualu registers, each
    operator's times the eager capture's (a compiled graph's operators cannot be timed apart:
    bagualu shares the block's time by the bytes each saves), at ``fractions`` of the compiled
    keep-all peak: recompute allowed for the block only (whole-block recompute) and for every
    operator (what the variants would allow; the planner assumes a recomputed operator frees
    all it saves)."""
    from bagualu.planning import embedded
    eager, _, _ = _captured(name, width, seq, layers, compiled=False)
    times = {o["name"]: (o["forward_ms"], o["backward_ms"])
             for o in eager["layer_graph"]["operators"]}
    model, options, peak = _captured(name, width, seq, layers, compiled=True)
    block_ms = sum(f for f, _ in times.values())
    produced: Dict[str, int] = {}
    for t in model["layer_graph"]["tensors"]:
        who = t.get("producer", "(block input)")
        produced[who] = produced.get(who, 0) + t["bytes"]
    out: List[Dict] = [{"saved_bytes_by_operator": produced, "compiled_keep_all_peak": peak}]
    for fraction in fractions:
        for allowed in ("block", "operators"):
            m = copy.deepcopy(model)
            for o in m["layer_graph"]["operators"]:
                f, b = times.get(o["name"], (o["forward_ms"], o["backward_ms"]))
                if o["name"] == "block":  # rerunning it reruns every operator
                    f, b = block_ms, 2 * block_ms
                o["forward_ms"], o["backward_ms"] = f, b
                o["recompute_allowed"] = allowed == "operators" or o["name"] == "block"
            opts = dict(options or {}, capacity_bytes=int(peak * fraction), allow_offload=True,
                        allow_fp8=fp8)
            if calibration:
                opts["calibration"] = calibration
            p = embedded.EmbeddedPlanner(m, opts)
            plan = p.plan({"phase": "steady", "forward_micro_batch": 0, "load_factor": 1.0})
            p.close()
            mix: Dict[str, int] = {}
            for o in plan["operators"]:
                mix[o["strategy"]] = mix.get(o["strategy"], 0) + 1
            out.append({"fraction": fraction, "capacity": int(peak * fraction),
                        "recompute_allowed": allowed,
                        "overhead_ms": round(1e3 * plan["overhead_s"], 3),
                        "serial_ms": round(1e3 * plan["serial_s"], 3),
                        "predicted_bytes": plan["predicted_bytes"],
                        "keep_all_bytes": plan["keep_all_bytes"],
                        "infeasible": plan["infeasible"],
                        "recomputed": [o["name"] for o in plan["operators"]
                                       if o["strategy"] == "recompute"],
                        "mix": mix})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3_moe,mixtral")
    ap.add_argument("--width", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--fractions", default="0.5,0.3")
    ap.add_argument("--parts", default="variants,planner")
    ap.add_argument("--calibration", help="the planner's calibration document (e.g. an "
                    "emulated H200 link: python -m bagualu.planning.emulation)")
    ap.add_argument("--fp8", action="store_true", help="the planner may store in FP8")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    calibration = json.loads(Path(a.calibration).read_text()) if a.calibration else None
    result: Dict[str, Any] = {}
    for name in a.models.split(","):
        if "variants" in a.parts:
            result[f"{name}/variants"] = variants(name, a.width, a.seq, a.layers, a.iterations)
        if "planner" in a.parts:
            result[f"{name}/planner"] = planner(name, a.width, a.seq, a.layers,
                                                [float(f) for f in a.fractions.split(",")], a.fp8,
                                                calibration)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
