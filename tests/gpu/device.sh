#!/usr/bin/env bash
# Runs the GPU suite on a GPU machine from the bundle that tests/gpu/bundle.sh made elsewhere:
# unpacks gpu-bundle/build.tar.gz into the build directory it came from, links this checkout to
# the path it was built at (CTest files hold absolute paths), points the loader at the packed
# libraries and the machine's own NCCL, and runs tests/gpu/run.sh on the prebuilt binaries.
#
#   bash tests/gpu/device.sh [results file]     (default out/gpu-results.txt)
set -uo pipefail
cd "$(dirname "$0")/../.."
here=$PWD
out=${1:-out/gpu-results.txt}
bundle=gpu-bundle/build.tar.gz
[[ -f $bundle ]] || { echo "device.sh: $bundle missing: run tests/gpu/bundle.sh first" >&2; exit 1; }
rm -rf gpu-bundle/unpacked && mkdir -p gpu-bundle/unpacked
tar -xzf "$bundle" -C gpu-bundle/unpacked
src=$(cat gpu-bundle/unpacked/SOURCE_ROOT)
build=$(cat gpu-bundle/unpacked/BUILD_DIR)
mkdir -p "$build" && cp -a "gpu-bundle/unpacked/$build/." "$build/"
# CTest files name the build machine's paths: point them here. Binaries that compiled in a
# source path (the replay tests' traces) get a link when that path is free.
if [[ "$here" != "$src" ]]; then
  grep -rlF "$src" "$build" --include='*.cmake' | xargs -r sed -i "s#$src#$here#g"
  [[ -e "$src" ]] || { mkdir -p "$(dirname "$src")" && ln -s "$here" "$src"; }
fi
# CTest files call the CMake that configured them (cmake -E env for the LD_PRELOAD test).
cmake_used=$(grep -rhoE '"/[^"]*/cmake"' "$build" --include=CTestTestfile.cmake | head -1 | tr -d '"')
if [[ -n $cmake_used && ! -x $cmake_used ]] && command -v cmake >/dev/null; then
  mkdir -p "$(dirname "$cmake_used")" && ln -sf "$(command -v cmake)" "$cmake_used"
fi
# The binding (bagualu._C) is built against one torch: where this machine's torch is another
# than the bundle's, build it here alone against this one (integrations/pytorch/csrc builds
# standalone; a minute on 16 cores) and put it where the package looks.
ext_dir="$build/integrations/pytorch"
bundled=$(cat "$ext_dir/_C.torch-version" 2>/dev/null || echo none)
here_torch=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
if [[ $here_torch != none && $here_torch != "$bundled" ]]; then
  echo "device.sh: the bundle's binding is for torch $bundled, this machine has $here_torch:" \
    "building the binding here (build-binding/)"
  mkdir -p build-binding
  built=$(cat build-binding/integrations/pytorch/_C.torch-version 2>/dev/null || echo none)
  if [[ $built == "$here_torch" ]] ||
    { cmake -S integrations/pytorch/csrc -B build-binding -G Ninja \
        -DBGL_PYTHON="$(command -v python3)" >build-binding/log 2>&1 &&
      cmake --build build-binding -j "$(nproc)" >>build-binding/log 2>&1; }; then
    rm -f "$ext_dir"/_C.*.so && cp build-binding/integrations/pytorch/_C.* "$ext_dir/"
  else
    echo "device.sh: building the binding failed (build-binding/log):" >&2; tail -20 build-binding/log >&2
  fi
fi
nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
# The build tree's own libraries too: the binaries' RUNPATH names the build machine's paths.
own=$(find "$here/$build" -name 'lib*.so' -printf '%h\n' | sort -u | paste -sd:)
export LD_LIBRARY_PATH="$here/gpu-bundle/unpacked/lib${own:+:$own}${nccl:+:$nccl}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export BGL_GPU_PREBUILT=1 BGL_GPU_BUILD=$build BGL_LIB_DIR="$here/$build"
export BGL_GPU_COMMIT=$(cat gpu-bundle/unpacked/COMMIT 2>/dev/null || echo unknown)
export PYTHONUNBUFFERED=1
exec bash tests/gpu/run.sh "$out"
