#!/usr/bin/env bash
# Reproduces the node-mode table of docs/reproduction.md (issue 14): the 8 GPUs of one node under
# per-process planning and under node arbitration, with synchronized and independent spikes, and
# with a smaller device, printed as markdown.
#   tools/bgl-sim/reproduce-node.sh [BGL_SIM] [ITERATIONS] [extra bgl-sim flags...]
# e.g. tools/bgl-sim/reproduce-node.sh build/tools/bgl-sim/bgl-sim 200
set -euo pipefail
cd "$(dirname "$0")/../.."
sim=${1:-build/tools/bgl-sim/bgl-sim}
iters=${2:-200}
shift $(($# < 2 ? $# : 2))
extra=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
node=tools/bgl-sim/examples/node-8gpu.yaml
run() {
  local name=$1
  shift
  "$sim" --model models/glm-423b-a30b.json --node "$node" --iterations "$iters" \
    --spike-prob 0.1 --json "$@" "${extra[@]}" >"$tmp/$name.json"
}
run synchronized
run independent --spikes independent
run small-device --capacity 52GB
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
gib = lambda b: f"{b / 2**30:.1f}"
print("| scenario | mode | host per GPU (GiB) | iteration mean / p99 (s) | mean without restarts (s) "
      "| OOMs | failed offloads | pinned peak / wanted / budget (GiB) | GPUs offloading per link, "
      "max / mean | slower than planned (s/iteration) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name, title in [("synchronized", "synchronized spikes"), ("independent", "independent spikes"),
                    ("small-device", "synchronized, 52 GB device")]:
    d = json.load(open(f"{tmp}/{name}.json"))
    for m in d["modes"]:
        print(f"| {title} | {m['mode']} | {gib(m['host_limit_bytes'])} | "
              f"{m['mean_s']:.2f} / {m['p99_s']:.2f} | {m['mean_run_s']:.2f} | {m['ooms']} | "
              f"{m['failed_offloads']} | {gib(m['host_pinned_peak_bytes'])} / "
              f"{gib(m['host_demand_peak_bytes'])} / {gib(m['host_budget_bytes'])} | "
              f"{m['link_offloaders_max']} / {m['link_offloaders_mean']:.2f} | "
              f"{m['overlap_lost_s'] / m['iterations']:.3f} |")
PY
