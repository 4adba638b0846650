"""bagualu against torchtitan's activation checkpointing on CPU: torchtitan 0.3.0's own trainer
(torchtitan.train through the test harness, tests/python/torchtitan_cpu.py) on its deepseek_v3
debug model, one rank, the same seed and data in every run, under

- ``keep-all``: no activation checkpointing (``activation-checkpoint:none``);
- ``full`` and ``selective``: torchtitan's FullAC and SelectiveAC (its default, op-level);
- ``budget-B``: torchtitan's MemoryBudgetAC at budget B (``--activation-checkpoint.memory-budget
  B``), which needs the blocks compiled: ``--compile.enable --compile.backend aot_eager``
  (aot_eager's partitioner is the min-cut one the budget steers; no C++ build);
- ``bagualu``: ``--module bagualu.torchtitan --bagualu.capacity C`` (its plans at capacity C).

The runs alternate (one of each per round, ``--rounds`` rounds), one torchrun each; a run's time
is the median of its steps after the first (the first compiles, captures, warms up) but the
last, its peak the last step's heap peak (the harness's ``--measure``: glibc's in-use bytes
during the forward and backward above their start, sampled every 5 ms, which slows that
step: activations, temporaries and gradients; not the optimizer step). Printed: per
configuration the median over rounds and the min-max spread, the time ratio to keep-all, the
losses of the last step (bitwise equal for keep-all, full, selective and bagualu), and the
machine's load average before and after.

    .venv-torchtitan/bin/python bench/python/torchtitan_ac.py [--rounds 3] [--steps 4] \\
        [--capacity 24MiB] [--budgets 0.25,0.5,0.75] [--seq-len 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "python" / "torchtitan_cpu.py"
LINE = re.compile(r"HARNESS rank 0 step (\d+) ms ([\d.]+) heap_peak (-?\d+)")
LOSS = re.compile(r"HARNESS rank 0 step (\d+) loss (\S+) grad_norm (\S+)")


def configs(capacity: str, budgets: List[float]) -> Dict[str, List[str]]:
    tt = ["--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel"]
    compiled = ["--compile.enable", "--compile.backend", "aot_eager"]
    out = {"keep-all": tt + ["activation-checkpoint:none"],
           "full": tt + ["activation-checkpoint:full"],
           "selective": tt + ["activation-checkpoint:selective"]}
    for b in budgets:
        out[f"budget-{b:g}"] = tt + compiled + ["activation-checkpoint:memory-budget",
                                                "--activation-checkpoint.memory-budget",
                                                str(b)]
    out["bagualu"] = ["--module", "bagualu.torchtitan", "--config", "deepseek_v3_debugmodel",
                      "--bagualu.capacity", capacity, "--bagualu.governor", "none"]
    return out


def run_one(python: str, assets: Path, work: Path, args: List[str], steps: int,
            seq_len: int) -> Dict[str, object]:
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(work / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(HARNESS), str(assets), "--measure", "--dump_folder", str(work / "out"),
           "--training.local_batch_size", "2", "--training.seq_len", str(seq_len),
           "--training.steps", str(steps), "--training.disable_cuda_graphs",
           "--checkpoint.no-enable", "--debug.seed", "0", "--metrics.log_freq", "1", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=work)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        print(f"torchtitan_ac: run failed ({' '.join(args)}):\n{text[-2000:]}", flush=True)
        return {"ms": None, "heap_peak": None, "last_loss": None, "bagualu_peak_mib": None,
                "failed": True}
    steps_seen = {int(m[1]): (float(m[2]), int(m[3])) for m in LINE.finditer(text)}
    last = max(steps_seen)
    timed = [v[0] for s, v in sorted(steps_seen.items()) if 1 < s < last]
    losses = {int(m[1]): m[2] for m in LOSS.finditer(text)}
    bgl = [float(m) for m in re.findall(r"bagualu: iter \d+ .*? peak ([\d.]+)MiB", text)]
    return {"ms": statistics.median(timed), "heap_peak": steps_seen[last][1],
            "last_loss": losses.get(max(losses)) if losses else None,
            "bagualu_peak_mib": max(bgl) if bgl else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--capacity", default="24MiB")
    ap.add_argument("--budgets", default="0.25,0.5,0.75")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.rounds < 1 or args.steps < 3:
        print("torchtitan_ac: --rounds >= 1 and --steps >= 3", file=sys.stderr)
        return 2
    budgets = [float(b) for b in args.budgets.split(",") if b]
    cfgs = configs(args.capacity, budgets)
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in cfgs]
        if unknown:
            print(f"torchtitan_ac: unknown configurations {unknown} (known: {list(cfgs)})",
                  file=sys.stderr)
            return 2
        cfgs = {k: v for k, v in cfgs.items() if k in wanted}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        assets = tmp_path / "assets"
        subprocess.run([sys.executable, str(HARNESS), "--assets", str(assets)], check=True)
        results: Dict[str, List[Dict[str, object]]] = {k: [] for k in cfgs}
        for r in range(args.rounds):
            for name, cargs in cfgs.items():
                work = tmp_path / f"{name}-{r}"
                work.mkdir()
                res = run_one(sys.executable, assets, work, cargs, args.steps, args.seq_len)
                results[name].append(res)
                print(f"round {r} {name}: {res}", flush=True)
    load_after = os.getloadavg()
    ok = [x["ms"] for x in results.get("keep-all", []) if not x.get("failed")]
    base = statistics.median(ok) if ok else None
    print(f"load average before {load_before[0]:.2f} after {load_after[0]:.2f}")
    print(f"{'configuration':14} {'step ms (median, min-max)':28} {'x keep-all':>10} "
          f"{'heap peak MiB (median, min-max)':32} last loss")
    summary = {}
    for name, rs in results.items():
        rs = [x for x in rs if not x.get("failed")]
        if not rs:
            print(f"{name:14} failed")
            continue
        ms = [float(x["ms"]) for x in rs]
        hp = [int(x["heap_peak"]) / (1 << 20) for x in rs]
        ratio = statistics.median(ms) / base if base else float("nan")
        summary[name] = {"ms": ms, "heap_peak_mib": hp, "ratio": ratio,
                         "last_loss": rs[-1]["last_loss"],
                         "bagualu_peak_mib": rs[-1]["bagualu_peak_mib"]}
        print(f"{name:14} {statistics.median(ms):8.0f} ({min(ms):.0f}-{max(ms):.0f}){'':8} "
              f"{ratio:10.3f} {statistics.median(hp):8.1f} ({min(hp):.1f}-{max(hp):.1f}){'':12} "
              f"{rs[-1]['last_loss']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"load_before": load_before,
                                               "load_after": load_after,
                                               "args": vars(args), "summary": summary},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
