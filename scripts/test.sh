#!/usr/bin/env bash
# Installs what is missing, builds, and runs every test: the normal build, then an ASan+UBSan
# build, then a TSan build of the concurrent parts (allocator, service). Fails on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-python.sh
jobs=${BGL_JOBS:-$(nproc)}

run_suite() {  # name, build dir, cmake args..., then ctest args after --
  local name=$1 dir=$2; shift 2
  local cmake_args=() ctest_args=()
  while (($#)) && [[ $1 != -- ]]; do cmake_args+=("$1"); shift; done
  (($#)) && shift
  ctest_args=("$@")
  echo "=== ${name}: configure and build (${dir})"
  cmake -S . -B "$dir" -G Ninja -DBGL_BUILD_TESTS=ON -DBGL_BUILD_BENCH=OFF "${cmake_args[@]}" >/dev/null
  cmake --build "$dir" -j "$jobs"
  echo "=== ${name}: ctest"
  (cd "$dir" && ctest --output-on-failure -j "$jobs" "${ctest_args[@]}")
}

run_suite "release" build -DCMAKE_BUILD_TYPE=RelWithDebInfo --
run_suite "asan+ubsan" build-asan -DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=address -- -LE no_asan
run_suite "tsan" build-tsan -DCMAKE_BUILD_TYPE=Debug -DBGL_SANITIZE=thread -- -L tsan
echo "=== all test suites passed"
