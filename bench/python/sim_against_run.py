"""bgl-sim against a same-capacity run (issue 42 item 3): predicts the rows of a
``bench_unmodified.py --same-capacity --sim-graphs DIR --json-out RUN.json`` run from the model
document each model's bagualu run registered (its captured operator graph and times) and the
calibration the run used (BGL_CALIBRATION: the emulated link's rates), with nothing fitted per
row, and prints predicted beside measured, as ratios to plain.

Rows bgl-sim has a policy for: plain (static-under at a capacity no plan needs: everything
kept), full recompute (static-over) and bagualu (L4), at the capacity the run planned with,
one load of 1.0 per micro-batch, rank 0 of the document's pipeline; in bgl-sim's serial and
lockstep execution models (--exec; L4 always runs its own dual-batch order).

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

ROWS = (("full recompute", "static-over"), ("bagualu", "L4"))
EXECS = ("serial", "lockstep")


def predict(sim: str, model_json: str, calibration: str, capacity: int, micro_batches: int,
            iterations: int, execution: str, policy: str) -> float:
    """bgl-sim's ms per iteration of ``policy``."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("".join(",".join(["1.0"] * micro_batches) + "\n" for _ in range(iterations)))
        loads = f.name
    try:
        out = subprocess.run([sim, "--model", model_json, "--gpu", "host", "--calibration",
                              calibration, "--loads", loads, "--policy", policy, "--capacity",
                              str(capacity), "--ranks", "0", "--exec", execution, "--json"],
                             capture_output=True, text=True)
    finally:
        os.unlink(loads)
    if out.returncode:
        raise ValueError(f"bgl-sim --policy {policy} --exec {execution} on {model_json}: "
                         f"{out.stderr.strip()}")
    p = json.loads(out.stdout)["policies"][0]
    if p["ooms"]:
        raise ValueError(f"bgl-sim: {policy} runs out of memory at {capacity} bytes")
    return 1e3 * p["total_s"] / p["iterations"]


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
        print("| model | row | measured vs plain, median (range of rounds) | "
              + " | ".join(f"bgl-sim {e}" for e in EXECS) + " | predicted / measured |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in EXECS) + " | --- |")
        for name, table in run["models"].items():
            doc_path = os.path.join(args.graphs, name + ".json")
            capacity = int(open(os.path.join(args.graphs, name + ".capacity")).read())
            micro_batches = json.load(open(doc_path))["micro_batches"]
            runs = table["runs"]
            plain = runs["plain"]["ms"]
            for row, policy in ROWS:
                if row not in runs or not runs[row]["ms"]:
                    continue
                ms = runs[row]["ms"]
                measured = [m / p for m, p in zip(ms, plain)]  # paired, same round
                predicted: Dict[str, float] = {}
                for e in EXECS:
                    base = predict(args.sim, doc_path, args.calibration, 1 << 40,
                                   micro_batches, args.iterations, e, "static-under")
                    predicted[e] = predict(args.sim, doc_path, args.calibration, capacity,
                                           micro_batches, args.iterations, e, policy) / base
                med = statistics.median(measured)
                print(f"| {name} | {row} | {med:.2f}x ({min(measured):.2f}-{max(measured):.2f}) | "
                      + " | ".join(f"{predicted[e]:.2f}x" for e in EXECS)
                      + f" | {predicted['serial'] / med:.2f} |", flush=True)
    except (OSError, KeyError, ValueError) as e:
        print(f"sim_against_run: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
