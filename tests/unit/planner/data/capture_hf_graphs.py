"""Writes the layer graphs bagualu captures from unmodified Hugging Face models (Mixtral,
Qwen3-MoE, DeepSeek-V3 from the small configs of integrations/pytorch/examples/unmodified.py) as
the planner's model documents, for the planner's C++ tests (real_instances.h rescales them to
GPU magnitudes). Run from the repository root after building the libraries:

    BGL_LIB_DIR=build .venv/bin/python tests/unit/planner/data/capture_hf_graphs.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))

import torch  # noqa: E402

import bagualu  # noqa: E402

import unmodified  # noqa: E402

torch.set_num_threads(1)


def capture(name: str) -> dict:
    docs = []
    real_uninstall = bagualu.uninstall

    def keep_doc() -> None:
        docs.append(bagualu.model_document())
        real_uninstall()

    bagualu.uninstall = keep_doc
    try:
        unmodified.train(name, "bagualu", capacity="4GiB", iterations=1)
    finally:
        bagualu.uninstall = real_uninstall
    return docs[0]


def main() -> int:
    out = Path(__file__).resolve().parent
    for name in ("mixtral", "qwen3_moe", "deepseek_v3"):
        doc = capture(name)
        path = out / f"hf-{name.replace('_', '-')}.json"
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        graph = doc["layer_graph"]
        print(f"{path.name}: {len(graph['operators'])} operators, {len(graph['tensors'])} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
