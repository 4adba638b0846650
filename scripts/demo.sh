#!/usr/bin/env bash
# The main job: installs what is missing, builds, starts the governor daemon on a private socket,
# shows the planner's answer for a Table II stage, trains the MoE example under the four
# policies against the daemon (CPU by default, CUDA when present), and shows a bgl-top frame.
set -euo pipefail
cd "$(dirname "$0")/.."
# BGL_BUILD_DIR: the build folder (default build); BGL_DEMO_QUICK=1: fewer iterations.
build=${BGL_BUILD_DIR:-build}
bash scripts/setup.sh
bash scripts/setup-python.sh
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j "$(nproc)" --target bgl_python bgl-plan bgl-governord bgl-top bglctl

run_dir=$(mktemp -d /tmp/bagualu-demo.XXXXXX)
socket="unix://${run_dir}/governor.sock"
"$build"/governor/daemon/bgl-governord --listen "$socket" --metrics-port 0 \
  >"${run_dir}/governord.log" 2>&1 &
daemon=$!
cleanup() {
  kill -TERM "$daemon" 2>/dev/null && wait "$daemon" 2>/dev/null
  rm -rf "$run_dir"
}
trap cleanup EXIT
for _ in $(seq 50); do "$build"/tools/bglctl/bglctl --governor "$socket" health >/dev/null 2>&1 && break; sleep 0.1; done
echo "=== bgl-governord (pid $daemon) serving on $socket"
"$build"/tools/bglctl/bglctl --governor "$socket" health

echo
echo "=== the planner on GLM-423B-A30B (Table II), pipeline rank 0, 64 GB, a 2.6x MoE spike"
"$build"/tools/bgl-plan/bgl-plan --model models/glm-423b-a30b.json --capacity 64GB --load 2.6 |
  sed -n '1,8p'
echo "    ... (bgl-plan --help; the full table lists all 28 operators and the issue order)"

device=cpu
if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  device=cuda
fi
echo
echo "=== MoE training example on ${device}: keep-all, static-under, static-over and bagualu,"
echo "    an injected 2.6x routing spike, every stage planned by the daemon"
# BGL_DEMO_QUICK=1 (CI): the same steps with fewer iterations.
iterations=6
if [[ ${BGL_DEMO_QUICK:-0} == 1 ]]; then iterations=3; fi
# bagualu and static-over must finish every iteration under the spike (keep-all may run out of
# memory: that is the point); any other failure ends the demo with a non-zero status.
# bagualu's spike iteration is drawn, planned against actual, to $build/demo-memory.svg (the
# example's log says where).
BGL_LIB_DIR="$build" .venv/bin/python integrations/pytorch/examples/moe_train.py --policy all \
  --device "$device" --governor "$socket" --quiet --iterations "$iterations" \
  --picture "$build/demo-memory.svg" \
  --require-finish bagualu,static-over >"${run_dir}/example.log" 2>&1 &
example=$!
# While the example trains, take one dashboard frame of the daemon's view while bagualu's run
# holds memory: the example runs its policies in the order keep-all, static-under, static-over,
# bagualu, each a session of its own, so the fourth session seen is bagualu's (at most four
# minutes; the frame says so when none is there).
seen=""
for _ in $(seq 480); do
  sessions=$("$build"/tools/bglctl/bglctl --governor "$socket" sessions --json 2>/dev/null || true)
  for id in $(grep -o '"session_id": *"[^"]*"' <<<"$sessions" | sed 's/.*: *"//; s/"$//'); do
    [[ " $seen " == *" $id "* ]] || seen="$seen $id"
  done
  (($(wc -w <<<"$seen") >= 4)) && break
  kill -0 "$example" 2>/dev/null || break
  sleep 0.5
done
sleep 2  # a few plans into bagualu's run (its capture first)
echo "=== bgl-top --once, taken while the example trains"
"$build"/tools/bgl-top/bgl-top --governor "$socket" --once || true
echo
status=0
wait "$example" || status=$?
cat "${run_dir}/example.log"
if ((status != 0)); then
  echo "demo: the MoE example failed (exit status $status); its log is above" >&2
fi
exit "$status"
