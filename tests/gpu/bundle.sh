#!/usr/bin/env bash
# Builds the GPU suite on a machine with the CUDA toolkit (no GPU needed) and packs what
# tests/gpu/run.sh needs into gpu-bundle/: the build tree's test, bench and tool binaries
# (stripped), their CTest files, and the shared libraries they need that a bare CUDA machine may
# lack (yaml-cpp, Google Benchmark, cudart). NCCL is not packed (hundreds of MiB): the GPU
# machine's own libnccl.so.2 is used. tests/gpu/device.sh unpacks the bundle and runs the suite,
# so a GPU machine without gRPC, GoogleTest or a compiler toolchain can still run it.
#
#   bash tests/gpu/bundle.sh            # here
#   bash tests/gpu/device.sh            # on the GPU machine (carry gpu-bundle/)
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
build=${BGL_GPU_BUILD:-build}
if [[ ! -f "$build/CMakeCache.txt" ]]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBGL_BUILD_TESTS=ON \
    -DBGL_BUILD_BENCH=ON
fi
grep -q '^CMAKE_CUDA_COMPILER:.*nvcc' "$build/CMakeCache.txt" ||
  { echo "bundle.sh: $build was configured without CUDA (nvcc not found?)" >&2; exit 1; }

targets=(bgl_alloc_gpu_tests bgl_alloc_tests bgl_alloc_c_api_tests bgl_alloc_concurrency_tests
  bgl_alloc_nccl_tests bgl_replay_tests bgl_preload bgl_preload_probe bgl_alloc bgl-replay
  bgl_alloc_bench bgl_enforcer_gpu_tests bgl_enforcer_tests bgl_enforcer_concurrency_tests
  bgl_enforcer_c_api_tests bgl_enforcer_gpu_timing bgl_enforcer_bench bgl_plan_bench bgl_planner
  planner_tests bgl-plan bgl_python)
available=$(ninja -C "$build" -t targets all 2>/dev/null | cut -d: -f1)
present=()
for t in "${targets[@]}"; do
  if grep -qx "$t" <<<"$available"; then present+=("$t"); else echo "(no target $t)"; fi
done
cmake --build "$build" -j "${BGL_JOBS:-2}" --target "${present[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/$build" "$stage/lib"
# Binaries and libraries of the build tree (not CMake's own probes), stripped.
mapfile -t files < <(find "$build" -type f \( -perm -u+x -o -name '*.so' -o -name '*.so.*' -o -name '*.torch-version' \) \
  ! -path '*/CMakeFiles/*' ! -name '*.sh' \
  \( -path "$build/tests/unit/allocator/*" -o -path "$build/tests/unit/enforcer/*" \
     -o -path "$build/tests/unit/planner/*" -o -path "$build/bench/*" -o -path "$build/allocator/*" \
     -o -path "$build/governor/planner/*" -o -path "$build/kernels/*" -o -path "$build/enforcer/*" \
     -o -path "$build/tools/bgl-replay/*" -o -path "$build/tools/bgl-plan/*" \
     -o -path "$build/integrations/pytorch/*" \))
for f in "${files[@]}"; do
  mkdir -p "$stage/$(dirname "$f")"
  strip --strip-debug -o "$stage/$f" "$f" 2>/dev/null || cp "$f" "$stage/$f"
done
# CTest's files, so that ctest -L gpu works there as here (same absolute paths: device.sh links
# the repository to this one's path).
find "$build" \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o -name '*_tests.cmake' \) \
  ! -path '*/CMakeFiles/*' -print0 | while IFS= read -r -d '' f; do
  mkdir -p "$stage/$(dirname "$f")"; cp "$f" "$stage/$f"; done
# Shared libraries outside glibc and the compiler runtime, except NCCL.
for f in "${files[@]}"; do { ldd "$f" 2>/dev/null || true; } | awk '$2 == "=>" && $3 ~ /^\// {print $3}'; done |
  sort -u | grep -v /site-packages/ | grep -Ev '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*|libgcc_s|libstdc\+\+|libnccl|libz|libssl|libcrypto|libbgl_[a-z]+)\.so' |
  while read -r lib; do cp -L "$lib" "$stage/lib/"; done
echo "$root" > "$stage/SOURCE_ROOT"
echo "$build" > "$stage/BUILD_DIR"
git rev-parse --short HEAD > "$stage/COMMIT" 2>/dev/null || true
mkdir -p gpu-bundle
tar -C "$stage" -czf gpu-bundle/build.tar.gz .
echo "gpu-bundle/build.tar.gz: $(du -h gpu-bundle/build.tar.gz | cut -f1), $(ls "$stage/lib" | wc -l) libraries:" \
  "$(ls "$stage/lib" | tr '\n' ' ')"
