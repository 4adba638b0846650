#!/usr/bin/env bash
# Reproduces the tables of docs/reproduction.md: runs bgl-sim over the paper's configurations
# (Table II), the ablation, the spike phase and the sweeps, and prints markdown tables.
#   tools/bgl-sim/reproduce.sh [BGL_SIM] [ITERATIONS] [extra bgl-sim flags...]
# e.g. tools/bgl-sim/reproduce.sh build/tools/bgl-sim/bgl-sim 1000
#      tools/bgl-sim/reproduce.sh build/tools/bgl-sim/bgl-sim 1000 --exec lockstep
set -euo pipefail
cd "$(dirname "$0")/../.."
sim=${1:-build/tools/bgl-sim/bgl-sim}
iters=${2:-1000}
shift $(($# < 2 ? $# : 2))
extra=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
configs="188b-a20b 319b-a30b 423b-a30b 629b-a30b 783b-a35b 835b-a30b 1041b-a35b-8192gpu
1041b-a35b-12288gpu"
for c in $configs; do
  "$sim" --model "models/glm-$c.json" --iterations "$iters" --policy all --json "${extra[@]}" \
    >"$tmp/main-$c.json"
done
for v in 4096 8192 16384; do
  "$sim" --model models/glm-423b-a30b.json --iterations "$iters" --policy baselines --json \
    --seq-len "$v" "${extra[@]}" >"$tmp/seq-$v.json"
done
for v in 2 4 6 8 10; do
  "$sim" --model models/glm-423b-a30b.json --iterations "$iters" --policy baselines --json \
    --top-k "$v" "${extra[@]}" >"$tmp/topk-$v.json"
done
for v in 0 0.029 0.1 0.3; do
  "$sim" --model models/glm-423b-a30b.json --iterations "$iters" --policy baselines --json \
    --spike-prob "$v" "${extra[@]}" >"$tmp/prob-$v.json"
done
for v in 1.6 2.0 2.6 3.2; do
  "$sim" --model models/glm-423b-a30b.json --iterations "$iters" --policy baselines --json \
    --spike-max "$v" "${extra[@]}" >"$tmp/max-$v.json"
done
for v in 0 284 1000; do
  "$sim" --model models/glm-423b-a30b.json --iterations "$iters" --policy baselines --json \
    --restart-cost "$v" "${extra[@]}" >"$tmp/restart-$v.json"
done
python3 - "$tmp" "$configs" <<'PY'
import json, statistics, sys
tmp, configs = sys.argv[1], sys.argv[2].split()
def load(name):
    d = json.load(open(f"{tmp}/{name}.json"))
    return d, {p["policy"]: p for p in d["policies"]}
pct = lambda x: f"{100 * x:.1f}%"
print("### End to end (paper Fig. 8): MFU with restarts, BaGuaLu (L4) speedup\n")
print("| config | GPUs | static-under | static-over | kuai-like | adapipe-like | BaGuaLu | "
      "PFLOP/s | vs kuai | vs adapipe | spike phase vs kuai / adapipe | OOMs kuai/adapipe/BaGuaLu |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
gk, ga, mfu, pk, pa = [], [], [], [], []
abl = {"L2": [], "L3": [], "L4": []}
for c in configs:
    d, p = load(f"main-{c}")
    s = d["bagualu_speedup_over"]
    gk.append(s["kuai-like"]["throughput"]); ga.append(s["adapipe-like"]["throughput"])
    pk.append(s["kuai-like"].get("spike_phase", 1)); pa.append(s["adapipe-like"].get("spike_phase", 1))
    mfu.append(p["L4"]["mfu"])
    for step in d.get("ablation", []):
        abl[step["to"]].append(step["speedup"])
    gpus = d["gpus"]
    print(f"| {c} | {gpus} | " + " | ".join(pct(p[k]["mfu"]) for k in
          ["static-under", "static-over", "kuai-like", "adapipe-like", "L4"]) +
          f" | {p['L4']['throughput_tflops'] / 1e3:.0f} | {gk[-1]:.3f}x | {ga[-1]:.3f}x | "
          f"{pk[-1]:.3f}x / {pa[-1]:.3f}x | {p['kuai-like']['ooms']}/{p['adapipe-like']['ooms']}/"
          f"{p['L4']['ooms']} |")
print(f"\nAverage over configurations: {statistics.mean(gk):.3f}x over kuai-like, "
      f"{statistics.mean(ga):.3f}x over adapipe-like, spike phase {statistics.mean(pk + pa):.3f}x, "
      f"BaGuaLu MFU {pct(statistics.mean(mfu))}.\n")
print("### Ablation (paper Fig. 11): step speedups, mean over configurations\n")
print("| step | paper | bgl-sim (mean) | bgl-sim GLM-423B-A30B |")
print("|---|---|---|---|")
d423, p423 = load("main-423b-a30b")
steps423 = {s["to"]: s["speedup"] for s in d423.get("ablation", [])}
for to, paper in [("L2", "1.16x"), ("L3", "1.05x"), ("L4", "1.13x")]:
    prev = {"L2": "L1", "L3": "L2", "L4": "L3"}[to]
    print(f"| {prev} -> {to} | {paper} | {statistics.mean(abl[to]):.3f}x | {steps423[to]:.3f}x |")
print("\n### Static provisioning, GLM-423B-A30B (paper II-B): MFU of normal iterations\n")
print("| policy | paper | bgl-sim normal | bgl-sim overall |")
print("|---|---|---|---|")
for k, paper in [("static-under", "30.0%"), ("static-over", "24.6%"), ("L4", "-")]:
    print(f"| {k} | {paper} | {pct(p423[k]['normal_mfu'])} | {pct(p423[k]['mfu'])} |")
def sweep(title, prefix, values, label):
    print(f"\n### {title}\n")
    print(f"| {label} | static-under | static-over | kuai-like | adapipe-like | BaGuaLu | "
          "best baseline | gain |")
    print("|---|---|---|---|---|---|---|---|")
    for v in values:
        d, p = load(f"{prefix}-{v}")
        base = max(p[k]["mfu"] for k in ["static-under", "static-over", "kuai-like", "adapipe-like"])
        print(f"| {v} | " + " | ".join(pct(p[k]["mfu"]) for k in
              ["static-under", "static-over", "kuai-like", "adapipe-like", "L4"]) +
              f" | {pct(base)} | {p['L4']['mfu'] / base:.3f}x |")
sweep("Sequence length, GLM-423B-A30B (paper Fig. 10b)", "seq", [4096, 8192, 16384], "seq_len")
sweep("Sparsity: experts per token, GLM-423B-A30B (paper Fig. 10a)", "topk", [2, 4, 6, 8, 10],
      "top_k")
sweep("Spike frequency, GLM-423B-A30B", "prob", ["0", "0.029", "0.1", "0.3"], "spike prob")
sweep("Spike size, GLM-423B-A30B", "max", ["1.6", "2.0", "2.6", "3.2"], "spike max")
sweep("Restart cost, GLM-423B-A30B", "restart", ["0", "284", "1000"], "restart s")
PY
