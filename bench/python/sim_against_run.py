"""bgl-sim against a same-capacity run (issue 42 item 3): predicts the rows of a
``bench_unmodified.py --same-capacity --sim-graphs DIR --json-out RUN.json`` run from the model
document each model's bagualu run registered (its captured operator graph and times) and the
calibration the run used (BGL_CALIBRATION: the emulated link's rates), with nothing fitted per
row, and prints predicted beside measured, as ratios to plain.

Rows bgl-sim has a policy for: plain (static-under at a capacity no plan needs: everything
kept), full recompute (static-over) and bagualu, at the capacity the run planned with, rank 0
of the document's pipeline, one load of 1.0 per micro-batch; bagualu twice: bgl-sim's own plans
(L4, always its own dual-batch order) and the plans the run was served (``plans``: the run's
MODEL.plans.json, its iterations from the run's warm-up on, at the loads they were planned for:
the cost model alone, the planner's choices taken from the run); in bgl-sim's serial, lockstep
and dual-batch execution models (--exec). Per row also the absolute ms per micro-batch of
plain and of the row's overhead, bgl-sim's beside the run's.

    python bench/python/sim_against_run.py --sim build/tools/bgl-sim/bgl-sim \\
        --graphs DIR --run RUN.json --calibration h200.json

Exit 2, naming what is wrong, on a missing file or a failed bgl-sim run."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List

ROWS = (("full recompute", "static-over"), ("bagualu", "L4"), ("bagualu", "plans"))
EXECS = ("serial", "lockstep", "dual-batch")


def predict(sim: str, model_json: str, calibration: str, capacity: int, micro_batches: int,
            iterations: int, execution: str, policy: str, plans: str = "") -> float:
    """bgl-sim's ms per iteration of ``policy`` (``plans``: replaying that file)."""
    argv = [sim, "--model", model_json, "--gpu", "host", "--calibration", calibration,
            "--policy", policy, "--capacity", str(capacity), "--ranks", "0", "--exec",
            execution, "--json"]
    loads = ""
    if plans:
        argv += ["--plans", plans]
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("".join(",".join(["1.0"] * micro_batches) + "\n" for _ in range(iterations)))
            loads = f.name
        argv += ["--loads", loads]
    try:
        out = subprocess.run(argv, capture_output=True, text=True)
    finally:
        if loads:
            os.unlink(loads)
    if out.returncode:
        raise ValueError(f"bgl-sim --policy {policy} --exec {execution} on {model_json}: "
                         f"{out.stderr.strip()}")
    p = json.loads(out.stdout)["policies"][0]
    if p["ooms"]:
        raise ValueError(f"bgl-sim: {policy} runs out of memory at {capacity} bytes")
    return 1e3 * p["total_s"] / p["iterations"]


def steady_plans(path: str, warmup: int, out_dir: str) -> str:
    """The run's served plans from iteration ``warmup`` on (the measured ones), as a file."""
    doc = json.load(open(path))
    doc["iterations"] = doc["iterations"][warmup:]
    if not doc["iterations"]:
        raise ValueError(f"{path}: no iteration after the warm-up's {warmup}")
    out = os.path.join(out_dir, os.path.basename(path))
    with open(out, "w") as f:
        json.dump(doc, f)
    return out


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sim", required=True, help="the bgl-sim binary")
    ap.add_argument("--graphs", required=True, help="bench_unmodified.py's --sim-graphs folder")
    ap.add_argument("--run", required=True, help="bench_unmodified.py's --json-out file")
    ap.add_argument("--calibration", required=True, help="the run's BGL_CALIBRATION file")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args(argv)
    try:
        run = json.load(open(args.run))
        tmp = tempfile.mkdtemp(prefix="sim_against_run.")
        print("| model | row | bgl-sim policy | measured vs plain, median (range of rounds) | "
              + " | ".join(f"bgl-sim {e}" for e in EXECS)
              + " | predicted / measured: " + ", ".join(EXECS)
              + " | ms per micro-batch, bgl-sim serial / run: plain, the row's overhead |")
        print("| --- | --- | --- | --- | " + " | ".join("---" for _ in EXECS) + " | --- | --- |")
        for name, table in run["models"].items():
            doc_path = os.path.join(args.graphs, name + ".json")
            capacity = int(open(os.path.join(args.graphs, name + ".capacity")).read())
            doc = json.load(open(doc_path))
            micro_batches = doc["micro_batches"]
            # bgl-sim's iteration is its stage's work stretched by the 1F1B bubble (its
            # micro-batches plus pp - 1 slots); the run's, its micro-batches one after another
            slots = micro_batches + int(doc.get("pp", 1)) - 1
            plans = steady_plans(os.path.join(args.graphs, name + ".plans.json"),
                                 int(table.get("warmup_iterations", 1)), tmp)
            runs = table["runs"]
            plain = runs["plain"]["ms"]
            base = {e: predict(args.sim, doc_path, args.calibration, 1 << 40, micro_batches,
                               args.iterations, e, "static-under") for e in EXECS}
            for row, policy in ROWS:
                if row not in runs or not runs[row]["ms"]:
                    continue
                ms = runs[row]["ms"]
                measured = [m / p for m, p in zip(ms, plain)]  # paired, same round
                predicted: Dict[str, float] = {}
                absolute: Dict[str, float] = {}
                for e in EXECS:
                    absolute[e] = predict(args.sim, doc_path, args.calibration, capacity,
                                          micro_batches, args.iterations, e, policy,
                                          plans if policy == "plans" else "")
                    predicted[e] = absolute[e] / base[e]
                med = statistics.median(measured)
                sim_plain = base["serial"] / slots
                run_plain = statistics.median(plain) / micro_batches
                print(f"| {name} | {row} | {policy} | {med:.2f}x ({min(measured):.2f}-"
                      f"{max(measured):.2f}) | "
                      + " | ".join(f"{predicted[e]:.2f}x" for e in EXECS) + " | "
                      + ", ".join(f"{predicted[e] / med:.2f}" for e in EXECS)
                      + f" | {sim_plain:.0f} / {run_plain:.0f}, "
                      f"+{(absolute['serial'] - base['serial']) / slots:.0f} / "
                      f"+{(statistics.median(ms) - statistics.median(plain)) / micro_batches:.0f}"
                      " |", flush=True)
    except (OSError, KeyError, ValueError) as e:
        print(f"sim_against_run: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
