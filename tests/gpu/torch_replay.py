#!/usr/bin/env python3
"""Replays a CSV allocation trace (thread,time,action,pointer,size,stream) through PyTorch on
the GPU and prints peak live, peak reserved and their ratio as JSON. --mode picks the allocator:
native, expandable (expandable_segments:True), cudaMallocAsync, or bgl (libbgl_alloc.so through
CUDAPluggableAllocator). Each mode must run in a fresh process, since the allocator is fixed at
the first CUDA allocation."""
import argparse
import csv
import json
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--trace", required=True)
ap.add_argument("--mode", required=True, choices=["native", "expandable", "cudaMallocAsync", "bgl"])
ap.add_argument("--lib", default="build-gpu/allocator/libbgl_alloc.so")
args = ap.parse_args()
if args.mode == "expandable":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
elif args.mode == "cudaMallocAsync":
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
import torch  # noqa: E402  (after the environment is set)

if args.mode == "bgl":
    os.environ.setdefault("BGL_ALLOC_CONF", "backend:cuda-vmm")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(args.lib, "bgl_alloc", "bgl_free")
    torch.cuda.memory.change_current_allocator(alloc)

ops = []
with open(args.trace) as f:
    for row in csv.DictReader(f):
        ops.append((row["Action"], int(row["Pointer"], 0), int(row["Size"])))
live, cur, peak = {}, 0, 0
torch.cuda.synchronize()

def replay() -> float:
    """One pass over the trace; seconds."""
    global cur, peak
    t0 = time.perf_counter()
    for action, ptr, size in ops:
        if action == "allocate":
            live[ptr] = torch.empty(size, dtype=torch.uint8, device="cuda")
            cur += size
            peak = max(peak, cur)
        elif ptr in live:
            cur -= live.pop(ptr).numel()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    live.clear()
    cur = 0
    return elapsed


# The first pass grows the allocator's memory; the second reuses it, as every training iteration
# after the first does.
elapsed = replay()
warm = replay()
if args.mode == "bgl":
    import ctypes

    lib = ctypes.CDLL(args.lib)

    class Stats(ctypes.Structure):
        _fields_ = [(n, ctypes.c_int64) for n in (
            "allocated_bytes", "allocated_bytes_peak", "requested_bytes", "requested_bytes_peak",
            "active_bytes", "active_bytes_peak", "reserved_bytes", "reserved_bytes_peak")] + [
            ("rest", ctypes.c_uint64 * 40)]

    st = Stats()
    lib.bgl_alloc_get_stats(0, ctypes.byref(st))
    reserved = st.reserved_bytes_peak
else:
    reserved = torch.cuda.max_memory_reserved()
print(json.dumps({"trace": args.trace, "mode": args.mode, "ops": len(ops), "peak_live_bytes": peak,
                  "peak_reserved_bytes": reserved, "reserved_over_live": reserved / peak,
                  "us_per_op_python": elapsed / len(ops) * 1e6,
                  "warm_us_per_op_python": warm / len(ops) * 1e6}))
sys.exit(0)
