#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the normal build (C++ tests, the
# PyTorch integration's pytest suite, deploy checks), then an ASan+UBSan build, then a TSan build
# of the concurrent parts (allocator, enforcer, the service's handlers). Fails on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-python.sh
jobs=${BGL_JOBS:-$(nproc)}

# run_suite NAME DIR "CMAKE ARGS" "BUILD TARGETS (empty: all)" CTEST ARGS...
run_suite() {
  local name=$1 dir=$2 cmake_args=$3 targets=$4
  shift 4
  echo "=== ${name}: configure and build (${dir})"
  # shellcheck disable=SC2086  # the argument strings are word lists on purpose
  cmake -S . -B "$dir" -G Ninja -DBGL_BUILD_TESTS=ON -DBGL_BUILD_BENCH=OFF $cmake_args >/dev/null
  # shellcheck disable=SC2086
  cmake --build "$dir" -j "$jobs" ${targets:+--target $targets}
  echo "=== ${name}: ctest"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "$@")
}

run_suite "release" build "-DCMAKE_BUILD_TYPE=RelWithDebInfo" ""
run_suite "asan+ubsan" build-asan "-DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=address" "" -LE no_asan
run_suite "tsan" build-tsan "-DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=thread" \
  "bgl_alloc_tests bgl_alloc_concurrency_tests bgl_enforcer_concurrency_tests bgl_enforcer_issue_order_tests governor_concurrency_tests" \
  -L tsan
echo "=== all test suites passed"
