#!/usr/bin/env bash
# Creates .venv (Python 3.11) with PyTorch, transformers, accelerate (the Trainer needs it),
# matplotlib, numpy, pytest, grpcio(-tools) and the `bagualu` package in editable mode.
# Idempotent: a venv whose stamp matches this script is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_version=${BGL_TORCH_VERSION:-2.15.0}
# transformers 5.x needs torch >= 2.6; an older torch gets the last 4.x release.
if [[ -n ${BGL_TRANSFORMERS_VERSION:-} ]]; then
  transformers_version=$BGL_TRANSFORMERS_VERSION
elif python3 -c 'import sys; v=tuple(int(x) for x in sys.argv[1].split(".")[:2]); sys.exit(0 if v >= (2, 6) else 1)' "$torch_version"; then
  transformers_version=5.24.0
else
  transformers_version=4.57.6
fi
venv=${BGL_VENV:-.venv}
stamp="torch=${torch_version};transformers=${transformers_version};numpy;pytest;grpcio;grpcio-tools;scikit-build-core;bagualu-editable-v1;accelerate;matplotlib"

find_python() {
  local root candidates=()
  root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  for d in "$root"/versions/3.11*; do [[ -x $d/bin/python3 ]] && candidates+=("$d/bin/python3"); done
  candidates+=(python3.11 python3)
  for c in "${candidates[@]}"; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(0 if sys.version_info[:2] >= (3, 9) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  echo "setup-python: no Python >= 3.9 found" >&2; return 1
}

# .venv-torchtitan on top of the project venv (tests/python/test_torchtitan.py). Only on top of
# .venv: another venv (the minimum torch's .venv-min) must not rebuild it on its own torch.
torchtitan_on_top() {
  if [[ $venv == .venv ]]; then bash scripts/setup-torchtitan.sh; fi
}

if [[ -f $venv/.bgl-stamp && $(cat $venv/.bgl-stamp) == "$stamp" ]] &&
   $venv/bin/python -c 'import torch, transformers, accelerate, matplotlib, numpy, pytest, grpc, grpc_tools, scikit_build_core, bagualu' \
     2>/dev/null; then
  echo "setup-python: $venv is up to date"
  torchtitan_on_top
  exit 0
fi

# torch with its CUDA runtime wheels takes about 5.7 GiB installed. pip downloads every wheel of
# one command into $TMPDIR before it installs any (2.9 GiB for torch's), so one command needs
# about 8.8 GiB at its peak: the CI machine ran out of space there with 8 GiB free. The
# requirements are resolved once (a dry run: metadata only) and installed a few at a time, torch's
# large wheels one by one, so that at most one wheel waits in $TMPDIR (the peak 5.9 GiB, measured).
# Say so up front rather than fail with ENOSPC halfway through (BGL_MIN_FREE_GIB lowers the bar
# where the wheels are known to fit).
need_gib=${BGL_MIN_FREE_GIB:-7}
for dir in "$(dirname "$(realpath -m "$venv")")" "${TMPDIR:-/tmp}"; do
  free_gib=$(( $(df -Pk "$dir" | awk 'NR == 2 {print $4}') / 1048576 ))
  if (( free_gib < need_gib )); then
    echo "setup-python: $dir has ${free_gib} GiB free; installing torch needs about ${need_gib} GiB" \
      "(free some space, or set BGL_MIN_FREE_GIB to try with less)" >&2
    exit 2
  fi
done

start=$(date +%s)
py=$(find_python)
echo "setup-python: creating $venv with $py ($("$py" --version 2>&1))"
"$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
"${pip[@]}" --upgrade pip setuptools wheel
# The PyPI wheel of torch depends on the nvidia-* CUDA runtime wheels; it does not import on
# CPU-only machines without them, so it is installed with its dependencies.
# accelerate (transformers' Trainer) and matplotlib resolve with the pinned torch in one
# resolution, so pip picks versions that accept that torch and this Python.
requirements=("torch==${torch_version}" "transformers==${transformers_version}" accelerate matplotlib
              numpy pytest grpcio grpcio-tools
              scikit-build-core)  # the build backend of `pip install .` (tests/python/test_install.py)
report=$(mktemp "${TMPDIR:-/tmp}/bgl-pip-report.XXXXXX")
trap 'rm -f "$report"' EXIT
"${pip[@]}" --dry-run --ignore-installed --report "$report" "${requirements[@]}"
large=(); small=()
while read -r name version; do
  case ${name,,} in
    torch | triton | nvidia-* | cuda-*) large+=("$name==$version") ;;
    *) small+=("$name==$version") ;;
  esac
done < <("$venv/bin/python" -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    print(item["metadata"]["name"], item["metadata"]["version"])' "$report")
echo "setup-python: installing ${#large[@]} large wheels one by one, then ${#small[@]} others"
for r in "${large[@]}"; do "${pip[@]}" --no-deps "$r"; done
"${pip[@]}" --no-deps "${small[@]}"
"$venv/bin/python" -m pip check --disable-pip-version-check >/dev/null ||
  { "$venv/bin/python" -m pip check --disable-pip-version-check >&2; exit 1; }
# --no-deps: torch is pinned above (a venv below bagualu's minimum must not be upgraded)
"${pip[@]}" --no-deps -e integrations/pytorch
echo "$stamp" > $venv/.bgl-stamp
echo "setup-python: done in $(( $(date +%s) - start )) s"
torchtitan_on_top
