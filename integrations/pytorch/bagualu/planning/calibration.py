"""The rooflines the planner plans with, for the machine at hand (issue 22 item 3): measured once
per machine and cached, or read from a calibration file the user gives.

A calibration is the planner's calibration document (docs/planner.md, "Calibration"): copy
bandwidth and launch floor per direction (``rooflines.offload`` device to host,
``rooflines.reload`` host to device), FP8 cast throughput (``rooflines.fp8_cast``, source bytes),
matmul and memory rates (``peak_tflops``, ``hbm_GBps``, their efficiencies 1: the measured rates
are the achieved ones), the dispatch floor of a small kernel (``kernel_launch_us``) and
``copy_overlap``, the fraction of compute time copies hide under: 1 on a GPU (copy engines run
beside the kernels), and on the host backend the part of the copies' cost its copy threads
really save on this machine, through the saved-tensor hooks beside matmuls (_host_overlap), 0
(copies planned as synchronous) below one half. ``gpu`` names the base profile
(``host`` on CPU, ``h200`` on CUDA); fields the file leaves out keep the profile's.

Where it comes from, first match: ``install(calibration=PATH)``, ``$BGL_CALIBRATION`` (a path;
``profile``: no calibration, the built-in profile as it is), else the cache
(``$BGL_CACHE_DIR`` or ``~/.cache/bagualu``, ``calibration-<machine>.json``, one file per
device kind, device name, CPU model, thread count and measuring method), else a measurement
(about a second) written to the cache. A file the user gives must exist and be valid: unknown
keys and values outside their range are CalibrationError naming the field (the planner's own
check, ``bgl_planner_calibrated_profile``); a bad cached file is measured again.

Not thread-safe: the training thread, once at registration.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import settings
from ..errors import BagualuError
from ..native import planner as native_planner

log = logging.getLogger("bagualu")

ENV = "BGL_CALIBRATION"
PROFILE_ONLY = "profile"  # $BGL_CALIBRATION=profile: the built-in profile, nothing measured
OVERLAP_THRESHOLD = 0.5   # below: the host backend's copies are planned as synchronous


class CalibrationError(BagualuError, ValueError):
    """A calibration file that is missing or bad (the message names the file and the field)."""


def overlaps(doc: Optional[Dict[str, Any]]) -> bool:
    """Whether the host backend's copies overlap compute under calibration ``doc`` (None: the
    host profile's 0)."""
    if not doc:
        return False
    return float(resolve(doc, "calibration")["copy_overlap"]) >= OVERLAP_THRESHOLD


def base_profile(device: torch.device) -> str:
    """The built-in profile a calibration of ``device`` starts from."""
    return "host" if device.type != "cuda" else "h200"


def resolve(doc: Dict[str, Any], where: str, gpu: Optional[str] = None) -> Dict[str, Any]:
    """The full profile ``doc`` makes (every field), checked by the planner itself;
    CalibrationError naming ``where`` and the field when it is bad."""
    lib = native_planner.load()
    ptr = lib.bgl_planner_calibrated_profile(json.dumps(doc).encode(),
                                             gpu.encode() if gpu else None)
    if not ptr:
        msg = lib.bgl_planner_last_error()
        raise CalibrationError(f"{where}: {msg.decode() if msg else 'invalid calibration'}")
    try:
        return json.loads(ctypes.string_at(ptr).decode())
    finally:
        lib.bgl_planner_free_string(ptr)


def load_file(path: str) -> Dict[str, Any]:
    """The calibration document in ``path``, checked; CalibrationError when the file is
    missing, not JSON or not a valid calibration (unknown field, value out of range)."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"calibration file {path}: not found")
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise CalibrationError(f"calibration file {path}: not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise CalibrationError(f"calibration file {path}: the top level must be an object")
    resolve(doc, f"calibration file {path}")
    return doc




# Bumped when what a measurement measures changes (2: the host backend's copies became streaming
# copies; 3: the copy overlap is measured on activation-sized offloads as training issues them):
# a cache of an older method is measured again, not planned with.
METHOD = 3


def machine_key(device: torch.device) -> str:
    """What a measurement holds for: the device kind and name, the CPU model, the threads, and
    the method (METHOD)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    text = f"{device.type}|{name}|{os.cpu_count()}|{torch.get_num_threads()}|{METHOD}"
    return f"{device.type}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def for_machine(device: torch.device, enforcer: Callable[[], Any], capacity: int,
                path: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The calibration to plan with (see the module docstring); None: the built-in profile.
    ``enforcer(sync_copies=False)`` makes an enforcer a measurement uses (over an empty device
    pool of ``capacity`` bytes), and is called only when one is needed; each is closed after."""
    from_env = not path and bool(os.environ.get(ENV))
    path = path or os.environ.get(ENV) or None
    if path == PROFILE_ONLY:
        return None
    if path is not None:
        try:
            return load_file(path)
        except CalibrationError as e:
            if from_env:  # name the variable: the user may not know it is set
                raise CalibrationError(f"{ENV}: {e}") from None
            raise
    cached = settings.cache_dir() / f"calibration-{machine_key(device)}.json"
    if cached.is_file():
        try:
            return load_file(str(cached))
        except CalibrationError as e:
            log.warning("bagualu: %s; measuring again", e)
    enf = enforcer() if device.type != "cuda" else None  # the host backend's copies
    try:
        doc = measure(device, enf, capacity, enforcer)
    finally:
        if enf is not None:
            enf.close()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(cached)
    except OSError as e:  # a read-only home: plan with it anyway
        log.warning("bagualu: cannot cache the calibration in %s (%s)", cached, e)
    return doc


# -- measurement ----------------------------------------------------------------------------
def _median_s(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    times: List[float] = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def roofline(small: Tuple[int, float], large: Tuple[int, float]) -> Dict[str, float]:
    """The roofline through two (bytes, seconds) points: the peak from the slope, the launch
    floor from the small size (both within the planner's ranges)."""
    (b0, t0), (b1, t1) = small, large
    peak = (b1 - b0) / max(t1 - t0, 1e-9)
    floor = max(t0 - b0 / peak, 1e-9)
    return {"launch_floor_us": round(min(max(floor * 1e6, 0.001), 1e6), 3),
            "peak_GBps": round(min(max(peak / 1e9, 0.01), 1e6), 3)}


def _compute_rates(device: torch.device, sync: Callable[[], None]) -> Dict[str, float]:
    cuda = device.type == "cuda"
    n = 4096 if cuda else 384
    dtype = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    mm = _median_s(lambda: torch.mm(a, b), 5, sync)
    x = torch.randn((64 if cuda else 4) << 20 >> 2, device=device)
    y, z = torch.empty_like(x), torch.empty_like(x)
    torch.add(x, x, out=y)
    add = _median_s(lambda: torch.add(x, y, out=z), 5, sync)
    one = torch.ones(1, device=device)
    launch = _median_s(lambda: torch.add(one, one), 21, sync)
    return {"peak_tflops": round(max(2 * n ** 3 / mm / 1e12, 0.001), 4), "matmul_efficiency": 1,
            "hbm_GBps": round(max(3 * x.nbytes / add / 1e9, 1), 3), "memory_efficiency": 1,
            "kernel_launch_us": round(min(max(launch * 1e6, 0.001), 1e6), 3)}


def _host_moves(enforcer: Any, largest: int, make_enforcer: Callable[..., Any],
                capacity: int) -> Dict[str, Any]:
    """Offload, reload and FP8 cast through the enforcer on the host backend (its pinned pool,
    its copy streams), at 16 KiB and ``largest`` bytes, and what its copy threads save
    (_host_overlap). Reloads and casts take blocks of the (empty) device pool of ``capacity``
    bytes: ``largest`` fits it."""
    mb = -(1 << 30)  # a micro-batch id no training uses
    points: Dict[str, List[Tuple[int, float]]] = {"offload": [], "reload": [], "fp8_cast": []}
    for nbytes in (16 << 10, largest):
        t_off, t_re, t_cast = [], [], []
        for _ in range(5):
            src = torch.randn(nbytes // 4)
            h = enforcer.register(src.untyped_storage(), src.dtype, 0, mb)
            t0 = time.perf_counter()
            enforcer.offload(h)
            t1 = time.perf_counter()
            st = enforcer.acquire(h, nbytes)
            t2 = time.perf_counter()
            del st
            enforcer.retire(h)
            t_off.append(t1 - t0)
            t_re.append(t2 - t1)
            src = torch.randn(nbytes // 4)
            h = enforcer.register(src.untyped_storage(), src.dtype, 0, mb)
            t0 = time.perf_counter()
            enforcer.store_fp8(h)
            st = enforcer.acquire(h, nbytes)
            t1 = time.perf_counter()
            del st
            enforcer.retire(h)
            t_cast.append((t1 - t0) / 2)  # a cast and an uncast
        points["offload"].append((nbytes, statistics.median(t_off)))
        points["reload"].append((nbytes, statistics.median(t_re)))
        points["fp8_cast"].append((nbytes, statistics.median(t_cast)))
    out: Dict[str, Any] = {"rooflines": {k: roofline(*v) for k, v in points.items()}}
    out["copy_overlap"] = _host_overlap(enforcer, make_enforcer, capacity)
    return out


def _host_overlap(enforcer: Any, make_enforcer: Callable[..., Any], capacity: int) -> float:
    """The fraction of the copies' cost that the host backend's copy threads hide, as training
    pays it: the saved-tensor hooks' own path (capture/tracker.py, strategy offload) packs 48
    activation-sized storages (256 KiB, less on a device pool of under 64 MiB ``capacity``),
    each beside a slice of matmuls, and unpacks them (the reloads) in the backward's order,
    once with ``enforcer``'s copy threads and once with an enforcer of
    ``make_enforcer(sync_copies=True)`` copying on this thread, alternating, 3 rounds each:
    (synchronous - threaded) / (synchronous - compute alone); 0 below OVERLAP_THRESHOLD. The
    threads' hand-offs and the work each copy costs this thread count against them: where they
    eat what the overlap saves, copies are planned as synchronous."""
    from ..capture.tracker import Tracker  # the hooks' path (capture does not import planning)
    from ..enforce.device import DeviceMemory
    from ..enforce.pool import DevicePool
    from ..vocabulary import OFFLOAD, Op

    n = 48
    size = max(min(256 << 10, capacity // 256), 4 << 10) // 4096 * 4096
    srcs = [torch.randn(size // 4) for _ in range(n)]
    a = torch.randn(128, 128)
    op = Op("calibration", "linear", 0)
    memory = DeviceMemory(torch.device("cpu"), DevicePool(size, configure=False), None)

    def compute(k: int) -> None:
        for _ in range(k):
            torch.mm(a, a)

    unit = 1 << 30  # a unit no training uses (the hooks skip negative ones)

    def train_like(tracker: Any, k: int) -> float:
        tracker.begin_forward(unit, capture=False)
        tracker.scope.append(op)
        t0 = time.perf_counter()
        packed = []
        for src in srcs:
            packed.append(tracker.pack(src))
            compute(k)
        tracker.end_forward()
        tracker.begin_backward(unit)
        tracker.scope.append(op)
        while packed:  # each reload released once used, as autograd does
            tracker.unpack(packed.pop())
            compute(k)
        tracker.end_backward(unit)
        t = time.perf_counter() - t0
        tracker.end_forward()
        return t

    sync_enf = make_enforcer(sync_copies=True)
    try:
        threaded = Tracker(memory, enforcer, lambda o, u: OFFLOAD)
        synchronous = Tracker(memory, sync_enf, lambda o, u: OFFLOAD)
        t_copy = statistics.median(train_like(synchronous, 0) for _ in range(3))
        t0 = time.perf_counter()
        compute(16)
        per = (time.perf_counter() - t0) / 16
        k = max(int(t_copy / (2 * n) / max(per, 1e-7)), 1)  # compute per hook: its copy's time
        t_comp = statistics.median(_median_s(lambda: compute(2 * n * k), 1, none_sync)
                                   for _ in range(3))
        t_sync: List[float] = []
        t_threads: List[float] = []
        for _ in range(3):
            t_sync.append(train_like(synchronous, k))
            t_threads.append(train_like(threaded, k))
    finally:
        enforcer.synchronize()
        sync_enf.close()
    sync_s, threads_s = statistics.median(t_sync), statistics.median(t_threads)
    hidden = (sync_s - threads_s) / max(sync_s - t_comp, 1e-9)
    overlap = min(max(hidden, 0.0), 1.0)
    return 0.0 if overlap < OVERLAP_THRESHOLD else round(overlap, 2)


def none_sync() -> None:
    return None


def _cuda_moves(device: torch.device) -> Dict[str, Any]:
    """D2H and H2D copies between the GPU and pinned host memory on a side stream (what the
    enforcer's copy streams do), at 64 KiB and 64 MiB; FP8 keeps the profile's roofline (the
    GPU suite measures the cast kernel: bgl_enforcer_gpu_timing)."""
    stream = torch.cuda.Stream(device)
    sync = torch.cuda.synchronize
    points: Dict[str, List[Tuple[int, float]]] = {"offload": [], "reload": []}
    for nbytes in (64 << 10, 64 << 20):
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

        def d2h() -> None:
            with torch.cuda.stream(stream):
                host.copy_(dev, non_blocking=True)
            stream.synchronize()

        def h2d() -> None:
            with torch.cuda.stream(stream):
                dev.copy_(host, non_blocking=True)
            stream.synchronize()

        d2h(), h2d()
        points["offload"].append((nbytes, _median_s(d2h, 5, sync)))
        points["reload"].append((nbytes, _median_s(h2d, 5, sync)))
    return {"rooflines": {k: roofline(*v) for k, v in points.items()}, "copy_overlap": 1}


def measure(device: torch.device, enforcer: Any, capacity: int = 64 << 20,
            make_enforcer: Optional[Callable[..., Any]] = None) -> Dict[str, Any]:
    """Measures this machine's rooflines (see the module docstring), with an enforcer whose
    device pool of ``capacity`` bytes is empty (and, on the host backend, one more from
    ``make_enforcer(sync_copies=True)`` for the copy overlap); about a second."""
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else none_sync
    doc: Dict[str, Any] = {"gpu": base_profile(device)}
    doc.update(_compute_rates(device, sync))
    largest = max(64 << 10, min(4 << 20, capacity // 4)) // 4096 * 4096
    if cuda:
        doc.update(_cuda_moves(device))
    else:
        if make_enforcer is None:
            raise BagualuError("calibration: measuring the host backend needs make_enforcer")
        doc.update(_host_moves(enforcer, largest, make_enforcer, capacity))
    doc["source"] = (f"measured by bagualu on {platform.node()} ({machine_key(device)}), "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')}, {time.perf_counter() - t0:.2f} s")
    resolve(doc, "the measured calibration")  # the planner takes it
    return doc
