"""One rank of test_expert_parallel.py (run under torchrun, gloo): the example's real-EP MoE
(examples/expert_parallel.py) trained plain, keep-all with room and bagualu at half of
keep-all's peak, with what the test checks written to DIR/rank<r>.json (DIR: the first argument): the
load factors bagualu saw per layer next to the tokens the dispatches received, the deferred
replans per micro-batch, the memory model's errors (the planner's own keep-all bytes through
the package's binding against what PyTorch saved), and whether the gradients equal plain
PyTorch's bit for bit."""
from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))

import bagualu  # noqa: E402
import expert_parallel as ep  # noqa: E402
from bagualu.planning import embedded  # noqa: E402

FRACTIONS = [0.5, 0.5, 0.875, 0.5]  # micro-batch 2: 7 in 8 tokens to rank 0's experts
MICRO_BATCHES, ITERATIONS = 4, 2


def main() -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, ranks = dist.get_rank(), dist.get_world_size()
    xs = ep.batches(MICRO_BATCHES * ITERATIONS, rank, FRACTIONS)
    made = []
    real_init = embedded.EmbeddedPlanner.__init__

    def spy(planner, model, options=None):
        made.append((model, options))
        real_init(planner, model, options)

    embedded.EmbeddedPlanner.__init__ = spy
    seen = []  # (micro-batch, bagualu's per-layer loads, deferred replans so far)

    def after(f: int) -> None:
        rt = bagualu.current()
        seen.append((f, list(rt.planning.loads.get(f, [])), rt.planning.deferred))

    def run(policy, capacity="1GiB"):
        seen.clear()
        # FP8 off: the gradients are compared bit for bit (keep, offload and recompute are
        # exact; a plan or the replan after the router may choose FP8 where it costs less).
        out = ep.train(ep.build(None, ranks, rank), xs, policy, capacity, ITERATIONS,
                       MICRO_BATCHES, after_forward=after if policy else None, allow_fp8=False)
        out["seen"] = list(seen)
        return out

    plain = run(None)
    full = run("keep-all", "4GiB")
    peak = max(line["peak_bytes"] for line in full["lines"])
    # The memory model: the planner of the keep-all run, asked at each observed load.
    model, options = made[-1]
    planner = embedded.EmbeddedPlanner(model, options)
    errors = []
    for load, _, captured in full["accuracy"]:
        planner.reset_iteration()
        plan = planner.plan({"phase": "steady", "forward_micro_batch": 0,
                             "load_factor": float(load)})
        errors.append(abs(plan["keep_all_bytes"] - captured) / captured)
    planner.close()
    r = run("bagualu", peak // 2)

    def same(a, b):
        return len(a["grads"]) == len(b["grads"]) and \
            all(torch.equal(a["grads"][n], g) for n, g in b["grads"].items())

    result = ({
        "rank": rank, "peak": peak, "capacity": peak // 2,
        "params": sum(1 for _ in ep.build(None, ranks, rank).parameters()),
        "received": r["received"], "bagualu_loads": [s[1] for s in r["seen"]],
        "keep_all_received": full["received"],
        "keep_all_loads": [a[0] for a in full["accuracy"]],
        "micro_batches": [s[0] for s in r["seen"]], "deferred_after": [s[2] for s in r["seen"]],
        "lines": [{k: line[k] for k in ("deferred", "offloads", "fp8_casts", "recomputed_ops",
                                          "evictions", "ooms", "max_load_factor")}
                  for line in r["lines"]],
        "drops": r["stats"]["tracker"]["drops"], "oom": r["oom"],
        "memory_model_errors": errors,
        "grads_plain_vs_keep_all": same(plain, full), "grads_plain_vs_bagualu": same(plain, r),
        "grads": len(r["grads"]), "losses_equal": plain["losses"] == r["losses"],
    })
    (Path(sys.argv[1]) / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
