"""An emulated device link for the host backend (docs/planner.md, "An emulated device link"):
a calibration whose offload and reload rooflines are a GPU's copy link, scaled to this machine's
compute, with an ``emulated_link`` section that makes the enforcer's host copies take that time
(enforcer/emulated_link_ops.h). The planner and the copies read the same document, so they
cannot disagree.

The scale: a GPU's matmul rate over its link's rate is what decides whether a saved input's copy
hides behind its layer's compute (the copy of a linear layer's input over its compute is
``2 * flops_rate / (F * link_rate)`` for an output width F, on any machine). Keeping that ratio
here means the emulated link runs at ``link * (this machine's matmul rate / the GPU's)``: linear
layers of the same shape then see the GPU's copy-to-compute ratio. Memory-bound operators do not:
this machine's ratio of matmul rate to memory bandwidth differs from an H200's by one to two
orders of magnitude, so their copies come out that much too costly against their own compute
(they are cheap to recompute here, as on the GPU). The launch floor is this machine's measured
one: scaling the GPU's floor by the compute factor would make every small copy cost more than
the kernels around it, whose own launch floor is not emulated.

    python -m bagualu.planning.emulation --profile h200-pcie5 -o h200.json
    BGL_CALIBRATION=h200.json python train.py            # planned and copied over that link

Not thread-safe: a tool, run once.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from .. import settings
from . import calibration

# What each profile stands for: the GPU whose compute rate is the reference (a built-in planner
# profile: its peak_tflops times matmul_efficiency) and its link per direction in GB/s.
PROFILES: Dict[str, Dict[str, Any]] = {
    "h200-pcie5": {
        "stands_for": "H200 over PCIe Gen5 x16",
        "gpu": "h200",
        # Measured on an H200 (docs/gpu/calibration-h200.json, 2026-11-30): pinned copies.
        "offload_GBps": 54.9,
        "reload_GBps": 54.9,
    },
    "gh200-c2c": {
        "stands_for": "GH200 over NVLink-C2C",
        "gpu": "h200",
        # NVLink-C2C: 450 GB/s per direction nominal, taken at 90% (not measured here).
        "offload_GBps": 405.0,
        "reload_GBps": 405.0,
    },
}


class EmulationError(calibration.CalibrationError):
    """An unknown profile or a calibration that cannot be scaled (names what is wrong)."""


def _effective_tflops(profile: Dict[str, Any]) -> float:
    return float(profile["peak_tflops"]) * float(profile.get("matmul_efficiency", 1))


def emulate(measured: Dict[str, Any], profile: str) -> Dict[str, Any]:
    """The calibration for ``profile``'s link on the machine ``measured`` was measured on (a
    host calibration document: calibration.measure's, or a file of that format)."""
    if profile not in PROFILES:
        raise EmulationError(f"emulation profile '{profile}' unknown (known: "
                             f"{', '.join(sorted(PROFILES))})")
    if "emulated_link" in measured:
        raise EmulationError("the calibration given is an emulated one already "
                             f"({measured['emulated_link'].get('stands_for')}): give the "
                             "machine's own measurement")
    spec = PROFILES[profile]
    here = calibration.resolve(measured, "measured calibration", gpu="host")
    if measured.get("gpu", "host") != "host":
        raise EmulationError(f"the calibration given is of gpu '{measured.get('gpu')}': an "
                             "emulated link stands in for the host backend's copies only")
    gpu = calibration.resolve({"gpu": spec["gpu"]}, f"profile {spec['gpu']}")
    scale = _effective_tflops(here) / _effective_tflops(gpu)
    doc = copy.deepcopy(measured)
    roofs = doc.setdefault("rooflines", {})
    for direction in ("offload", "reload"):
        floor = float(here["rooflines"][direction]["launch_floor_us"])
        roofs[direction] = {"launch_floor_us": floor,
                            "peak_GBps": float(f"{spec[direction + '_GBps'] * scale:.6g}")}
    doc["copy_overlap"] = 1  # copies run on their own threads, beside compute, as on a GPU
    doc["emulated_link"] = {"stands_for": spec["stands_for"],
                            "compute_scale": float(f"{scale:.6g}")}
    doc["source"] = (f"bagualu.planning.emulation --profile {profile}: {spec['stands_for']} at "
                     f"this machine's compute ({_effective_tflops(here):.4g} TFLOP/s against "
                     f"{_effective_tflops(gpu):.4g})")
    calibration.resolve(doc, "emulated calibration")  # the planner's own check
    return doc


def _measured_here() -> Dict[str, Any]:
    """This machine's cached host calibration at this process's thread count, measured (by
    installing bagualu once, about a second) when there is none."""
    import torch
    device = torch.device("cpu")
    cached = settings.cache_dir() / f"calibration-{calibration.machine_key(device)}.json"
    if not cached.is_file():
        from .. import api
        api.install(capacity="256MiB", governor="none", log_iterations=False)
        api.uninstall()
    if not cached.is_file():
        raise EmulationError(f"no calibration of this machine in {cached}: pass --calibration")
    return calibration.load_file(str(cached))


def matmul_tflops(reps: int = 15) -> float:
    """This machine's matmul rate now, at this process's thread count: the calibration's
    product (calibration._compute_rates), its fastest of ``reps`` runs. The fastest, not the
    median: a calibration measured while other work shares the cores (a median of 5) can come
    out an order of magnitude below what the same cores do for the training, and the emulated
    link would be that much too slow (issue 42: 0.0094 TFLOP/s cached at 2 threads on the
    2-core VM against 0.17-0.20 at the benchmark's 1)."""
    import time

    import torch
    n = 384
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return round(max(2 * n ** 3 / best / 1e12, 0.001), 4)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bagualu.planning.emulation",
        description="Writes a calibration that emulates a GPU's copy link on the host backend.")
    ap.add_argument("--profile", required=True, help=f"one of {', '.join(sorted(PROFILES))}")
    ap.add_argument("--calibration", help="this machine's measured calibration (default: the "
                    "cached one, measured if missing)")
    ap.add_argument("--threads", type=int, default=0,
                    help="PyTorch threads of the runs it is for (bench_unmodified.py: 1); the "
                    "matmul rate is this machine's at that count (default: this process's)")
    ap.add_argument("-o", "--output", required=True, help="where to write the calibration")
    args = ap.parse_args(argv)
    import torch
    if args.threads < 0:
        print(f"bagualu.planning.emulation: --threads {args.threads}: give a positive count",
              file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        measured = (calibration.load_file(args.calibration) if args.calibration
                    else _measured_here())
        if not args.calibration:
            # The rate the link scales with: measured now, fastest of several (matmul_tflops);
            # the cached one may come from a loaded machine.
            cached = float(measured.get("peak_tflops", 0))
            measured = dict(measured, peak_tflops=max(matmul_tflops(), cached),
                            matmul_efficiency=1)
            if cached < 0.5 * measured["peak_tflops"]:
                print(f"bagualu.planning.emulation: the cached calibration's matmul rate "
                      f"({cached:g} TFLOP/s) is under half of this machine's now "
                      f"({measured['peak_tflops']:g}): measured under load? using the latter",
                      file=sys.stderr)
        doc = emulate(measured, args.profile)
        if not args.calibration:
            doc["source"] += f", {torch.get_num_threads()} PyTorch thread(s)"
    except calibration.CalibrationError as e:
        print(f"bagualu.planning.emulation: {e}", file=sys.stderr)
        return 2
    Path(args.output).write_text(json.dumps(doc, indent=1) + "\n")
    link = doc["rooflines"]
    print(f"{doc['emulated_link']['stands_for']}: offload {link['offload']['peak_GBps']} GB/s, "
          f"reload {link['reload']['peak_GBps']} GB/s on this machine (compute factor "
          f"{doc['emulated_link']['compute_scale']}); written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
