#!/usr/bin/env bash
# The demo: installs what is missing, builds the planner, and plans the GLM-423B-A30B stage of the
# paper's Table II (pipeline rank 0, 64 GB GPU) at balanced load and on a 2.6x MoE spike.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build -j "$(nproc)" --target bgl-plan
plan=build/tools/bgl-plan/bgl-plan
echo
echo "=== balanced load (r = 1.0): everything fits, nothing is mitigated"
"$plan" --model models/glm-423b-a30b.json --capacity 64GB --load 1.0 | head -6
echo
echo "=== a 2.6x spike on every micro-batch: the planner offloads, stores FP8 or recomputes"
"$plan" --model models/glm-423b-a30b.json --capacity 64GB --load 2.6 \
  --curve-csv build/demo-curve.csv
echo
echo "activation memory curve of the iteration written to build/demo-curve.csv"
