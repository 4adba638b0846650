#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the normal build (C++ tests, the
# PyTorch integration's pytest suite, deploy checks), then an ASan+UBSan build, then a TSan build
# of the concurrent parts (allocator, enforcer, the service's handlers). Fails on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-python.sh
jobs=${BGL_JOBS:-$(nproc)}

allow=.ci/allowed-skips.txt

# check_skips SUITE XML...: fails when a test that should run here was skipped (ctest counts a
# GTEST_SKIP as passed, and a pytest run with skips is one passing ctest test).
check_skips() {
  local suite=$1 args=()
  shift
  for xml in "$@"; do
    case $xml in
      *pytest*) args+=(--pytest "$xml") ;;
      *) args+=(--ctest "$xml") ;;
    esac
  done
  python3 .ci/check_skips.py --suite "$suite" --allow "$allow" "${args[@]}"
}

# run_suite NAME DIR "CMAKE ARGS" "BUILD TARGETS (empty: all)" BESIDE CTEST ARGS...
# Writes DIR/ctest-junit.xml (and, where the Python suite runs, DIR/pytest-junit-*.xml: one per
# pytest ctest test, tests/python/CMakeLists.txt) and checks the skips in all. BESIDE (a function
# name, or empty) runs once the build is done, beside ctest (its output printed after ctest's):
# the suites keep a core or less busy each, so side by side they take less time than one after
# the other. Either failing fails the stage.
run_suite() {
  local name=$1 dir=$2 cmake_args=$3 targets=$4 beside=$5
  shift 5
  echo "=== ${name}: configure and build (${dir}) [${SECONDS} s]"
  # shellcheck disable=SC2086  # the argument strings are word lists on purpose
  cmake -S . -B "$dir" -G Ninja -DBGL_BUILD_TESTS=ON -DBGL_BUILD_BENCH=OFF $cmake_args >/dev/null
  # shellcheck disable=SC2086
  cmake --build "$dir" -j "$jobs" ${targets:+--target $targets}
  echo "=== ${name}: ctest${beside:+, and ${beside} beside it} [${SECONDS} s]"
  rm -f "$dir/ctest-junit.xml" "$dir"/pytest-junit*.xml
  local beside_pid="" beside_log="$dir/beside.log" status=0 beside_status=0
  if [[ -n $beside ]]; then
    ("$beside") >"$beside_log" 2>&1 &
    beside_pid=$!
  fi
  (cd "$dir" && PYTEST_ADDOPTS="-rs" \
    ctest --output-on-failure -j "$jobs" --output-junit "$PWD/ctest-junit.xml" "$@") || status=$?
  if [[ -n $beside_pid ]]; then
    wait "$beside_pid" || beside_status=$?
    echo "=== ${name}: ${beside}'s output (it ran beside ctest; status ${beside_status})"
    cat "$beside_log"
  fi
  ((status == 0)) || { echo "=== ${name}: ctest failed (status ${status})" >&2; return "$status"; }
  ((beside_status == 0)) || return "$beside_status"
  local results=("$dir/ctest-junit.xml") xml
  for xml in "$dir"/pytest-junit-*.xml; do [[ -f $xml ]] && results+=("$xml"); done
  check_skips "$name" "${results[@]}"
}

# The Python tests that load the C libraries, against the ASan+UBSan build's libraries and
# daemon: the uninstrumented Python needs the ASan runtime preloaded, and libstdc++ with it (else
# ASan's __cxa_throw interceptor finds no real one: a C++ exception through torch aborts);
# LeakSanitizer is off (the interpreter and torch keep memory on purpose until exit).
run_python_asan() {
  local dir=build-asan cxx asan_rt
  cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$dir/CMakeCache.txt")
  asan_rt="$("$cxx" -print-file-name=libasan.so) $("$cxx" -print-file-name=libstdc++.so.6)"
  # In-process tests of the files that drive the C libraries through every path (capture,
  # enforcement, the planner's C API, the governor client, the unmodified models): the torchrun
  # tests (several Python processes each) and the suites whose time is torch's own work
  # (compiled blocks, FSDP2, torchtitan, expert parallelism: the same C calls) stay in the
  # release suite, so the stage stays bounded; BGL_ASAN_PYTEST_ARGS overrides.
  local selection=(tests/python/test_tracker.py tests/python/test_example.py
    tests/python/test_planner_api.py tests/python/test_governor.py
    tests/python/test_governor_cases.py tests/python/test_unmodified.py
    tests/python/test_own_checkpointing.py tests/python/test_quiet_exit.py -k
    "not two_ranks and not four_ranks and not two_stage and not small_node_budget and not plans_hold and not routing_spike")
  # shellcheck disable=SC2206  # a word list on purpose
  [[ -n ${BGL_ASAN_PYTEST_ARGS:-} ]] && selection=($BGL_ASAN_PYTEST_ARGS)
  echo "=== asan+ubsan: the Python suite against ${dir}'s libraries (${asan_rt})"
  # The package looks in BGL_LIB_DIR first but falls back to build/: all must be here.
  local f
  for f in governor/planner/libbgl_planner.so allocator/libbgl_alloc.so enforcer/libbgl_enforce.so \
    governor/daemon/bgl-governord; do
    [[ -f $dir/$f ]] || { echo "run_python_asan: $dir/$f is missing" >&2; return 1; }
  done
  rm -f "$dir/pytest-junit.xml"
  BGL_LIB_DIR=$dir BGL_GOVERNORD=$dir/governor/daemon/bgl-governord PYTHONDONTWRITEBYTECODE=1 \
    LD_PRELOAD="$asan_rt" \
    ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    timeout 1800 .venv/bin/python -m pytest -q -rs -p no:cacheprovider \
    --junitxml="$dir/pytest-junit.xml" "${selection[@]}"
  check_skips asan-python "$dir/pytest-junit.xml"
}

run_suite "release" build "-DCMAKE_BUILD_TYPE=RelWithDebInfo" "" ""
# The Python suite against the ASan build runs beside that build's ctest.
run_suite "asan+ubsan" build-asan "-DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=address" "" \
  run_python_asan -LE no_asan
# bgl_tsan_suite is every test program registered with bgl_tsan_gtest (tests/CMakeLists.txt),
# and those are exactly the tests labelled tsan: what the TSan build compiles, it runs.
run_suite "tsan" build-tsan "-DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=thread" bgl_tsan_suite "" \
  -L tsan
# Fuzzing (issue 45, docs/operations.md section "Fuzzing"): the clang build of the libFuzzer
# targets (build-fuzz) and each target for BGL_FUZZ_SECONDS (default 20) over its seeds, after
# replaying fuzz/regressions/; any finding fails. About 320 s on a quiet 2-core machine from an
# empty build folder (the nine targets' clang build about 130 s): docs/operations.md, "Fuzzing".
echo "=== fuzz: libFuzzer targets, ${BGL_FUZZ_SECONDS:-20} s each [${SECONDS} s]"
BGL_JOBS=$jobs bash scripts/fuzz.sh "${BGL_FUZZ_SECONDS:-20}"
echo "=== all test suites passed [${SECONDS} s]"
