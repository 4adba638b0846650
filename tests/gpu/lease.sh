#!/usr/bin/env bash
# The GPU suite for a short device lease (15 minutes of device time in all, at most 10 minutes a
# command): tests/gpu/device.sh's steps in phases, most wanted first, each under its own limit,
# the results packed into $OUT/results.tgz after every phase, so a phase cut off loses only
# itself. Here: `bash tests/gpu/bundle.sh`; there (the device tool, carrying gpu-bundle):
# `bash tests/gpu/lease.sh`. Phases: the package on CUDA (tests/gpu/test_bagualu_cuda.py), the
# same-capacity table on the real link, the C++ CUDA tests and the calibration, the table under
# a routing spike. About 560 s at most plus the binding's build where the machine's torch is
# not the bundle's.
set -u
cd "$(dirname "$0")/../.."
out=${OUT:-out}
res=$(mktemp -d)
pack() { mkdir -p "$out" && tar -czf "$out/results.tgz" -C "$res" .; }
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'
  echo "$(nproc) CPUs"
} 2>&1 | tee "$res/machine.txt"
phase() {  # name, limit in seconds, steps (an extended regular expression), env assignments...
  local name=$1 limit=$2 steps=$3; shift 3
  echo "##### phase $name ($(date +%T)), limit $limit s"
  env BGL_GPU_STEPS="$steps" "$@" timeout "$limit" bash tests/gpu/device.sh "$res/$name.txt" \
    >"$res/$name.log" 2>&1
  echo "##### phase $name: exit $? ($(date +%T))"
  grep -E '^(---|=== done)' "$res/$name.txt" | tail -12
  [[ -f build-binding/log ]] && cp build-binding/log "$res/binding-build.log"
  pack
}
phase cuda-tests 260 '^bagualu cuda tests$'
phase same-capacity 170 '^bagualu same capacity$' BGL_GPU_REPEATS=2
phase cpp 80 '^(gpu-tests|enforcer-tests|enforcer-timing|calibration-check)$'
phase spike 100 '^bagualu same capacity spike$' BGL_GPU_REPEATS=1
echo "phases done ($(date +%T)): $out/results.tgz"
