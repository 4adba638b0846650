#!/usr/bin/env bash
# Creates .venv-torchtitan for the torchtitan tests (tests/python/test_torchtitan.py): torchtitan
# 0.3.0 and what it imports, on top of the project venv (.venv, made by setup-python.sh), whose
# packages it sees through a .pth file (torch, transformers, bagualu: installed once).
#
# Why a second venv: torchtitan pins datasets<4.8, which needs an older huggingface_hub (1.33)
# and fsspec than .venv has. transformers 5.24 accepts that hub (>=1.31), so one venv would work,
# but downgrading .venv's packages under a running suite (and under every other user of .venv)
# is not this script's call: the torchtitan venv holds its own copies, which shadow .venv's for
# its interpreter only. wandb (a lazy import in torchtitan) is left out.
# Idempotent: a venv whose stamp matches this script is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${BGL_VENV:-.venv}
venv=${BGL_TORCHTITAN_VENV:-.venv-torchtitan}
stamp="torchtitan=0.3.0;datasets<4.8;tyro;torchdata;torch_checkpointing;spmd_types=0.2.3;v1"
if [[ -f $venv/.bgl-stamp && $(cat "$venv/.bgl-stamp") == "$stamp" ]] &&
   "$venv/bin/python" -c 'import torchtitan.train, transformers, bagualu' 2>/dev/null; then
  echo "setup-torchtitan: $venv is up to date"
  exit 0
fi
start=$(date +%s)
py=$("$base/bin/python" -c 'import sys; print(sys.base_prefix)')/bin/python3
site=$("$base/bin/python" -c 'import site; print(site.getsitepackages()[0])')
"$py" -m venv "$venv"
mine=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
# addsitedir: .venv's own .pth files (bagualu's editable install) apply too.
echo "import site; site.addsitedir('$(cd "$site" && pwd)')" > "$mine/bagualu-base-venv.pth"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-cache-dir)
# torchtitan's own requirements but wandb; torch, tokenizers, safetensors come from .venv.
"${pip[@]}" "datasets>=3.6.0,<4.8.0" torchdata torch_checkpointing tyro tensorboard einops \
  pillow spmd_types==0.2.3
# torchtitan last and without its dependencies: pip checks the requirements of what it installs
# (wandb, left out on purpose, would be an "ERROR: ... requires wandb" line) only with them.
"${pip[@]}" --no-deps torchtitan==0.3.0
echo "$stamp" > "$venv/.bgl-stamp"
echo "setup-torchtitan: done in $(( $(date +%s) - start )) s"
