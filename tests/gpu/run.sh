#!/usr/bin/env bash
# GPU suite: builds with CUDA, runs the CUDA-backend tests, the LD_PRELOAD and C ABI tests, the
# allocator benchmarks and bgl-replay of the shipped MoE traces on every backend (and cuda-vmm
# with larger pages), the enforcer tests and timing table (which also writes the planner's
# calibration), plus, when PyTorch with CUDA is installed, the same traces through PyTorch's
# native allocator, expandable segments, cudaMallocAsync and BaGuaLu's pluggable allocator,
# bagualu on CUDA (tests/gpu/test_bagualu_cuda.py) and the example's policies side by side.
# Writes everything to one results file (default out/gpu-results.txt). It took 215 s on one
# H200 from a prebuilt bundle (session 2).
#
# BGL_GPU_STEPS (an extended regular expression) runs only the steps whose label matches it, in
# the suite's order (a short lease: e.g. 'gpu-tests|bagualu cuda tests|same capacity'); the
# others are logged as skipped. BGL_GPU_REPEATS sets the same-capacity tables' alternating
# rounds (default 3, 2 under the spike).
#
# BGL_GPU_PREBUILT=1 skips setup, configure and build and uses the binaries already in
# $BGL_GPU_BUILD (tests/gpu/device.sh sets it after unpacking tests/gpu/bundle.sh's bundle).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-out/gpu-results.txt}
mkdir -p "$(dirname "$out")"
build=${BGL_GPU_BUILD:-build-gpu}
status=0
log() { echo "$*" | tee -a "$out"; }
run() {  # label, command...
  local label=$1; shift
  if [[ -n ${BGL_GPU_STEPS:-} && ! $label =~ $BGL_GPU_STEPS ]]; then
    echo "=== ${label}: skipped (BGL_GPU_STEPS)" >> "$out"; return 0
  fi
  log "=== ${label}: $*"
  local start=$SECONDS
  if "$@" 2>&1 | tee -a "$out"; then log "--- ${label}: ok ($((SECONDS - start)) s)"
  else log "--- ${label}: FAILED ($((SECONDS - start)) s)"; status=1; fi
}
: > "$out"
prebuilt=${BGL_GPU_PREBUILT:-0}
if [[ $prebuilt != 1 ]]; then
  bash scripts/setup.sh >/dev/null 2>&1 || echo "setup.sh failed; continuing with what is installed"
fi
log "bagualu GPU suite, $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$out"

if [[ $prebuilt != 1 ]]; then
run configure cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBGL_BUILD_BENCH=ON
wanted=(bgl_alloc_gpu_tests bgl_alloc_tests bgl_alloc_c_api_tests bgl_alloc_nccl_tests bgl_preload
  bgl_preload_probe bgl_alloc bgl_enforce_shared bgl-replay bgl_alloc_bench bgl_enforcer_gpu_tests
  bgl_enforcer_tests bgl_enforcer_c_api_tests bgl_enforcer_gpu_timing bgl_plan_bench)
# Targets that need something the machine may lack (NCCL) exist only when it was found.
available=$(ninja -C "$build" -t targets all 2>/dev/null | cut -d: -f1)
targets=()
for t in "${wanted[@]}"; do
  if grep -qx "$t" <<<"$available"; then targets+=("$t"); else log "(target $t not configured here)"; fi
done
run build cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
else
  log "prebuilt binaries in $build, built at commit ${BGL_GPU_COMMIT:-unknown}"
fi
run gpu-tests bash -c "cd '$build' && ctest --output-on-failure -L gpu --timeout 120"
run preload-tests bash -c "cd '$build' && ctest --output-on-failure -R 'alloc_preload|CApi'"
run bench "$build/bench/allocator/bgl_alloc_bench" --benchmark_min_time=0.2
# Enforcer: the host-backend suite, the CUDA-backend tests (label gpu above runs them too), the
# FP8 kernels against the host twin, and the timing table (offload/reload vs cudaMemcpyAsync of
# pinned memory, FP8 cast/uncast vs a D2D copy, overlap of offload with a compute kernel).
run enforcer-tests bash -c "cd '$build' && ctest --output-on-failure -R 'Enforcer|Fp8|StreamScheduler|EnforceCApi' --timeout 120"
# The timing bench also writes the planner's calibration from the measured rooflines; the
# planner must accept it.
# Named by the card (calibration-h200.json, calibration-h100.json, ...).
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 |
  grep -oiE 'gh200|h200|h100|b200|a100|l40s' | head -1 | tr 'A-Z' 'a-z')
calibration="$(dirname "$out")/calibration-${card:-gpu}.json"
run enforcer-timing timeout 120 "$build/bench/enforcer/bgl_enforcer_gpu_timing" \
  --calibration-out "$calibration"
if [[ -s $calibration ]]; then
  cat "$calibration" | tee -a "$out"
  run calibration-check "$build/tools/bgl-plan/bgl-plan" --model models/glm-423b-a30b.json \
    --capacity 141GB --load 2.6 --calibration "$calibration"
fi

for backend in host cuda-vmm cuda-async; do
  for trace in traces/*.csv; do
    run "replay $backend $(basename "$trace")" timeout 120 "$build/tools/bgl-replay/bgl-replay" \
      --trace "$trace" --backend "$backend" --repeat 3 --json
  done
done

# Larger mapping pages on cuda-vmm: fewer cuMemCreate/cuMemMap calls while the pool grows, at
# the price of coarser reserved memory.
for page in 8MiB 32MiB; do
  for trace in traces/*.csv; do
    run "replay cuda-vmm page_size:$page $(basename "$trace")" timeout 120 \
      "$build/tools/bgl-replay/bgl-replay" --trace "$trace" --backend cuda-vmm \
      --conf "page_size:$page" --repeat 3 --json
  done
done

if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  for mode in native expandable cudaMallocAsync bgl; do
    for trace in traces/*.csv; do
      run "torch $mode $(basename "$trace")" timeout 120 python3 tests/gpu/torch_replay.py \
        --trace "$trace" --mode "$mode" --lib "$build/allocator/libbgl_alloc.so"
    done
  done
  # bagualu itself on CUDA: the allocator swap, install after CUDA init, enforcement against
  # keep-all, then the example's policies side by side (iteration wall time).
  export BGL_LIB_DIR=${BGL_LIB_DIR:-$PWD/$build}
  run "bagualu cuda tests" timeout 600 python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_bagualu_cuda.py -k "not torchtitan"
  # torchtitan's own trainer under bagualu and beside its activation checkpointing (7 runs,
  # inductor compiles for memory_budget): needs torchtitan (.venv-torchtitan or python3's).
  run "bagualu torchtitan" timeout 3000 python3 -m pytest -q -s -p no:cacheprovider \
    tests/gpu/test_bagualu_cuda.py -k torchtitan
  run "bagualu overhead unmodified" timeout 600 python3 tests/gpu/bagualu_cuda.py overhead \
    --iterations 4 --json-out "$(dirname "$out")/bagualu-overhead.json"
  # The plans' issue order against the same plans in program order (docs/benchmarks/package.md,
  # section "The plan's issue order against the serial order").
  run "bagualu issue order" timeout 600 python3 tests/gpu/bagualu_cuda.py issue-order \
    --iterations 4 --repeats 3 --json-out "$(dirname "$out")/bagualu-issue-order.json"
  # Issue 22's table on CUDA, where the copies overlap compute: every policy at half of
  # keep-all's peak, without and with a routing spike (docs/benchmarks/same-capacity.md).
  run "bagualu same capacity" timeout 600 env PYTHONPATH=integrations/pytorch python3 \
    integrations/pytorch/examples/bench_unmodified.py --same-capacity --device cuda \
    --models qwen3_moe,mixtral --seq 512 --repeats "${BGL_GPU_REPEATS:-3}" --iterations 8 \
    --warmup 3 --json-out "$(dirname "$out")/bagualu-same-capacity.json"
  run "bagualu same capacity spike" timeout 600 env PYTHONPATH=integrations/pytorch python3 \
    integrations/pytorch/examples/bench_unmodified.py --same-capacity --device cuda \
    --models qwen3_moe,mixtral --seq 512 --repeats "${BGL_GPU_REPEATS:-2}" --iterations 8 \
    --warmup 3 --spike 16 \
    --json-out "$(dirname "$out")/bagualu-same-capacity-spike.json"
  for config in default large; do
    run "bagualu bench $config" timeout 300 python3 tests/gpu/bagualu_cuda.py bench \
      --config "$config" --iterations 6 --json-out "$(dirname "$out")/bagualu-bench-$config.json"
  done
else
  log "=== torch comparison skipped: PyTorch with CUDA not importable"
fi
log "=== done, status $status"
exit $status
