#!/usr/bin/env bash
# scripts/fuzz.sh [SECONDS]: builds the libFuzzer targets (BGL_FUZZ=ON, clang, in build-fuzz/)
# and runs each for SECONDS (default 60) over its seed corpus: the repo's real files (models/,
# tests/unit/planner/data/, docs/gpu/, traces/) and fuzz/corpus/<target>/. The corpora grow in a
# scratch folder, so the checkout is not modified. Every input in fuzz/regressions/<target>/ (a
# past finding) is replayed first. Fails on any finding (crash, sanitizer report, uncaught
# exception, abort, leak, an input slower than BGL_FUZZ_TIMEOUT seconds, default 10) and prints
# the executions per target. docs/operations.md, section "Fuzzing".
#
# Environment: BGL_FUZZ_BUILD (build folder, default build-fuzz), BGL_JOBS (build jobs),
# BGL_FUZZ_TARGETS (a space-separated subset), BGL_FUZZ_KEEP (a folder: the grown corpora and any
# finding's input are copied there), CXX/CC (default clang++-16 / clang-16, else clang++-14).
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
[[ $seconds =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS]" >&2; exit 2; }
dir=${BGL_FUZZ_BUILD:-build-fuzz}
jobs=${BGL_JOBS:-$(nproc)}
per_input_timeout=${BGL_FUZZ_TIMEOUT:-10}
all_targets=(model_json_fuzz model_yaml_fuzz calibration_fuzz alloc_conf_fuzz bytes_fuzz trace_fuzz
  governor_rpc_fuzz planner_capi_fuzz enforcer_capi_fuzz)
# shellcheck disable=SC2206  # a word list on purpose
targets=(${BGL_FUZZ_TARGETS:-${all_targets[@]}})

# clang with libFuzzer's runtime (Debian: clang-16 and libclang-rt-16-dev).
cxx=${CXX:-} cc=${CC:-}
if [[ -z $cxx ]]; then
  for v in 16 14; do
    if command -v "clang++-$v" >/dev/null; then cxx=clang++-$v cc=clang-$v; break; fi
  done
fi
[[ -n $cxx ]] || { echo "fuzz.sh: no clang++-16 or clang++-14 (apt-get install clang-16 libclang-rt-16-dev)" >&2; exit 1; }
cc=${cc:-${cxx/clang++/clang}}

echo "=== fuzz: configure and build ($dir, $cxx)"
start=$(date +%s)
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_CXX_COMPILER="$cxx" -DBGL_FUZZ=ON -DBGL_BUILD_TESTS=OFF -DBGL_BUILD_BENCH=OFF >/dev/null
cmake --build "$dir" -j "$jobs" --target "${targets[@]}"
echo "=== fuzz: built in $(($(date +%s) - start)) s"

# The corpora on disk; the file each target rewrites for every execution in /dev/shm when it
# exists (small: one input per target). Both go at the end, whatever the targets did.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/bgl-fuzz.XXXXXX")
shm=/dev/shm
[[ -w $shm ]] || shm=$scratch
BGL_FUZZ_SCRATCH=$(mktemp -d "$shm/bgl-fuzz-files.XXXXXX")
export BGL_FUZZ_SCRATCH
trap 'rm -rf "$scratch" "$BGL_FUZZ_SCRATCH"' EXIT

# seed TARGET FILE...: copies seed files into the target's scratch corpus.
seed() {
  local t=$1
  shift
  mkdir -p "$scratch/corpus/$t"
  local f
  for f in "$@"; do [[ -f $f ]] && cp "$f" "$scratch/corpus/$t/"; done
  return 0
}
for t in "${all_targets[@]}"; do seed "$t" fuzz/corpus/"$t"/*; done
seed model_json_fuzz models/*.json tests/unit/planner/data/*.json
seed model_yaml_fuzz models/*.yaml
seed calibration_fuzz docs/gpu/calibration-*.json
# The JSON models as YAML too (block style, as a user writes them), and the shipped traces cut
# to their first events (whole, they would make every mutation hundreds of kilobytes long).
python3 - "$scratch/corpus" models/*.json tests/unit/planner/data/*.json <<'EOF'
import json, os, sys
import yaml
out = sys.argv[1]
for path in sys.argv[2:]:
    name = os.path.splitext(os.path.basename(path))[0]
    with open(path) as f:
        doc = json.load(f)
    with open(os.path.join(out, "model_yaml_fuzz", name + ".yaml"), "w") as f:
        yaml.safe_dump(doc, f, sort_keys=False)
EOF
for f in traces/*.csv; do head -n 40 "$f" >"$scratch/corpus/trace_fuzz/$(basename "$f")"; done
python3 - "$scratch/corpus/trace_fuzz" traces/*.snapshot.json <<'EOF'
import json, os, sys
out = sys.argv[1]
for path in sys.argv[2:]:
    with open(path) as f:
        snap = json.load(f)
    snap["segments"] = []
    snap["device_traces"] = [events[:40] for events in snap["device_traces"]]
    with open(os.path.join(out, os.path.basename(path)), "w") as f:
        json.dump(snap, f)
EOF

# Every RPC's request (governor_rpc_fuzz): the target writes, per model file, a call sequence
# of real messages (Register with that model, Plan, Report, ListSessions, Snapshot, Watch,
# Unregister) in its input format. The C ABI targets' inputs are call choices, not files: their
# seeds are fuzz/corpus/<target>/ and a few seeded random sequences.
if [[ " ${targets[*]} " == *" governor_rpc_fuzz "* ]]; then
  BGL_FUZZ_WRITE_SEEDS=$scratch/corpus/governor_rpc_fuzz \
    BGL_FUZZ_SEED_MODELS="models/tiny-moe.json $(echo tests/unit/planner/data/*.json)" \
    "$dir/fuzz/governor_rpc_fuzz" 2>/dev/null
fi
python3 - "$scratch/corpus" <<'EOF'
import os, random, sys
rng = random.Random(45)
for t in ("planner_capi_fuzz", "enforcer_capi_fuzz"):
    for i in range(8):
        with open(os.path.join(sys.argv[1], t, f"random-{i}"), "wb") as f:
            f.write(bytes(rng.randrange(256) for _ in range(64 * (i + 1))))
EOF

# Symbolized stacks where an llvm-symbolizer is installed (Debian's llvm-16 or clang-14 bring one).
if [[ -z ${ASAN_SYMBOLIZER_PATH:-} ]]; then
  for s in llvm-symbolizer-16 llvm-symbolizer llvm-symbolizer-14; do
    if command -v "$s" >/dev/null; then export ASAN_SYMBOLIZER_PATH; ASAN_SYMBOLIZER_PATH=$(command -v "$s"); break; fi
  done
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

failed=()
summary=()
for t in "${targets[@]}"; do
  bin=$dir/fuzz/$t
  [[ -x $bin ]] || { echo "fuzz.sh: $bin was not built" >&2; exit 1; }
  # Past findings first: each must now pass.
  regressions=(fuzz/regressions/"$t"/*)
  if [[ -e ${regressions[0]} ]]; then
    echo "=== $t: ${#regressions[@]} regression inputs"
    if ! "$bin" -timeout="$per_input_timeout" "${regressions[@]}" >"$scratch/$t.regressions.log" 2>&1; then
      tail -n 40 "$scratch/$t.regressions.log"
      failed+=("$t (regression)")
      continue
    fi
  fi
  echo "=== $t: ${seconds} s over $(find "$scratch/corpus/$t" -type f | wc -l) seeds"
  mkdir -p "$scratch/artifacts/$t"
  log=$scratch/$t.log
  rc=0
  "$bin" -max_total_time="$seconds" -timeout="$per_input_timeout" -rss_limit_mb=2048 \
    -max_len=16384 -print_final_stats=1 -artifact_prefix="$scratch/artifacts/$t/" \
    "$scratch/corpus/$t" >"$log" 2>&1 || rc=$?
  # (|| true: a target that dies before its first line of stats still gets its report below)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1 || true)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1 || true)
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -n 1 | cut -d' ' -f2 || true)
  corpus=$(find "$scratch/corpus/$t" -type f | wc -l)
  summary+=("$(printf '%-18s %12s %10s %8s %8s  %s' "$t" "${execs:-?}" "${rate:-?}" \
    "${cov:-?}" "$corpus" "$([[ $rc -eq 0 ]] && echo ok || echo "FINDING (rc $rc)")")")
  if [[ $rc -ne 0 ]]; then
    grep -E 'ERROR|runtime error|terminate called|SUMMARY|Test unit written' "$log" | head -n 20 || true
    tail -n 30 "$log"
    failed+=("$t")
  fi
  if [[ -n ${BGL_FUZZ_KEEP:-} ]]; then
    mkdir -p "$BGL_FUZZ_KEEP/$t"
    cp -r "$scratch/corpus/$t" "$BGL_FUZZ_KEEP/$t/corpus"
    cp -r "$scratch/artifacts/$t" "$BGL_FUZZ_KEEP/$t/artifacts"
    cp "$log" "$BGL_FUZZ_KEEP/$t/"
  fi
done

echo "=== fuzz: executions per target (${seconds} s each)"
printf '%-18s %12s %10s %8s %8s  %s\n' target executions exec/s edges corpus result
for line in "${summary[@]}"; do echo "$line"; done
if ((${#failed[@]})); then
  echo "fuzz.sh: findings in ${failed[*]}; keep each input in fuzz/regressions/<target>/ once" \
    "fixed (BGL_FUZZ_KEEP=DIR keeps them)" >&2
  exit 1
fi
echo "=== fuzz: no findings"
