#!/usr/bin/env python3
"""One rank of bagualu_cuda.py's torchtitan scenario on CUDA: torchtitan 0.3.0's own
``torchtitan.train`` with the CPU harness's exact loss lines, per-step time and the CUDA
allocator's peak (tests/python/torchtitan_cpu.py: ``print_exact_losses``,
``measure_steps(cuda=True)``) and none of its CPU adjustments (torchtitan runs as it is on a
GPU: its device, NCCL, its FlexAttention).

    torchrun --nproc-per-node 1 tests/gpu/torchtitan_cuda.py ASSETS [torchtitan.train args]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))

import torchtitan_cpu as harness  # noqa: E402


def main(argv: list) -> int:
    assets, args = Path(argv[0]), argv[1:]
    harness.print_exact_losses()
    harness.measure_steps(cuda=True)
    harness.train_on(assets, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
