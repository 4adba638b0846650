"""bagualu.install() and uninstall(): the allocator swap on CUDA, the simulated device on CPU,
the governor connection, and the runtime that composes them."""
from __future__ import annotations

import json
import os

import logging
from typing import Any, Optional, Union

import torch

from . import _active, runtime
from .enforce.enforcer import Enforcer
from .enforce.pool import DevicePool
from .errors import InstallError
from .native import libs as _lib
from .planning import calibration as calibrations
from .planning.governor import Governor
from .settings import (Settings, check_compiled_operators, check_compiled_recompute,
                       check_governor_address, check_issue_order, check_min_load_factor,
                       check_policy, parse_size)

log = logging.getLogger("bagualu")


def cuda_allocator_swapped() -> bool:
    """Whether libbgl_alloc.so is PyTorch's CUDA allocator in this process (a second
    install() keeps it: PyTorch cannot change its allocator back once it has been used)."""
    return _active.cuda_allocator_swapped


def swap_cuda_allocator() -> None:
    """Makes libbgl_alloc.so PyTorch's CUDA allocator; InstallError if CUDA is initialised."""
    if _active.cuda_allocator_swapped:
        return
    if torch.cuda.is_initialized():
        raise InstallError(
            "bagualu.install() must run before the first CUDA allocation: CUDA is already "
            "initialised in this process, so PyTorch's allocator cannot be replaced. Call "
            "bagualu.install() at the top of the program (before model.cuda()).")
    path = _lib.find_file("libbgl_alloc.so")
    if path is None:
        raise InstallError("libbgl_alloc.so not found (set BGL_LIB_DIR to the build directory)")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(str(path), "bgl_alloc", "bgl_free")
    torch.cuda.memory.change_current_allocator(alloc)
    _active.cuda_allocator_swapped = True


def install(capacity: Union[int, str] = "8GiB", policy: str = "bagualu",
            device: Optional[Union[str, torch.device]] = None, governor: Optional[str] = None,
            pipeline_rank: int = 0, pipeline_stages: int = 1, micro_batches: int = 8,
            log_iterations: bool = True, fp8_block: int = 128, strict: bool = False,
            deadline_s: float = 0.5, gc_freeze: bool = True,
            pinned_capacity: Union[int, str] = "16GiB", chunks: int = 1,
            issue_order: str = "dual-batch",
            calibration: Optional[str] = None,
            allow_fp8: bool = True,
            compiled_operators: str = "operators",
            compiled_recompute: Any = None,
            min_load_factor: Optional[float] = None) -> "runtime.Runtime":
    """Installs bagualu in this process and returns its runtime.

    capacity: activation memory of the (simulated) device, bytes or '256MiB'. On CPU the host
      backend of libbgl_alloc.so holds one block per saved activation, so the capacity and OOM
      are real. On CUDA, libbgl_alloc.so becomes PyTorch's allocator.
    policy: 'keep-all', 'static-under', 'static-over' or 'bagualu'.
    governor: the daemon address (default $BGL_GOVERNOR, else unix:///run/bagualu/governor.sock);
      'none' uses the embedded planner only.
    strict: raise instead of warning when the CUDA allocator cannot be swapped.
    gc_freeze: instrument() calls gc.freeze() so that the objects alive then (the model,
      torch internals) are not rescanned by every full collection the capture triggers;
      uninstall() and the interpreter's exit unfreeze them.
    chunks: local pipeline stages of this rank (interleaved schedules); forward/backward and
      step_point then name the chunk.
    pinned_capacity: page-locked host memory the enforcer may hold for offloaded activations
      (every offload goes to it).
    issue_order: 'dual-batch' (default): plans carry the dual-batch issue order and offloads,
      reloads and recomputes follow it; 'serial': the same plans in program order (for
      comparison).
    calibration: a calibration file (docs/planner.md, "Calibration") with this machine's
      rooflines; default $BGL_CALIBRATION, else measured once per machine and cached
      (planning/calibration.py; 'profile': the built-in profile). CalibrationError when the
      file is missing or bad.
    allow_fp8: False: no plan (and no pressure eviction) stores an activation in FP8, so that
      training stays bit for bit what PyTorch computes (offload and recompute are exact; FP8
      is within its tolerance, docs/pytorch.md).
    compiled_operators: how compiled blocks are planned (docs/pytorch.md, "Compiled blocks"):
      'operators' (default; torch 2.15 and later): each saved tensor of a compiled block is
      placed by its own operator's plan (keep, offload, FP8; none recomputed alone); 'block':
      each compiled block is one operator (all of its tensors offloaded, cast or recomputed
      together: the whole block reruns). Older torch always plans them as blocks.
    compiled_recompute: per operator, the operators of a compiled block that may be
      recomputed (docs/pytorch.md, "Compiled blocks"): None (default: none recomputed alone),
      'auto' (the experts' operators: one group), or a list of groups, each a list of operator
      names (bagualu.operators(model)). Each union of groups is one compiled variant
      of the blocks, picked per micro-batch from the plan; at most recompile_limit // 2
      variants (dynamo's recompile limit, 8: two groups).
    min_load_factor: policy 'bagualu': every point plans for at least this load factor, a
      number in [1, 64] (a worst load known in advance: its memory set aside at every point, no
      downgrade after a router up to it); None (default): each point plans for the median of
      the last 8 forwards' highest router loads, a spike is met by the downgrade after its
      router.
    """
    check_policy(policy)
    check_issue_order(issue_order)
    check_compiled_operators(compiled_operators)
    compiled_recompute = check_compiled_recompute(compiled_recompute)
    min_load_factor = check_min_load_factor(min_load_factor, policy)
    if governor is not None:
        check_governor_address(governor, "governor")
    else:
        check_governor_address(os.environ.get("BGL_GOVERNOR", ""), "BGL_GOVERNOR")
    if runtime.active() is not None:
        uninstall()
    dev = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    cap = parse_size(capacity, "capacity")
    pinned = parse_size(pinned_capacity, "pinned_capacity")
    pool = None
    if dev.type == "cuda":
        try:
            swap_cuda_allocator()
        except InstallError as e:
            if strict:
                raise
            log.error("bagualu: %s Continuing with PyTorch's allocator (plans still apply).", e)
    else:
        pool = DevicePool(cap)
    cal = None
    # Plans that mitigate need the rooflines; any policy takes a calibration the user named
    # (an emulated link applies to every policy's copies).
    named = calibration is not None or os.environ.get(calibrations.ENV) not in (
        None, "", calibrations.PROFILE_ONLY)
    if named or policy in ("bagualu", "static-under"):
        measured: list = []

        def measuring_enforcer(sync_copies: bool = False) -> Enforcer:
            measured.append(True)
            return Enforcer(dev, pinned, borrowed_free_is_safe=False, fp8_block=fp8_block,
                            sync_copies=sync_copies)

        cal = calibrations.for_machine(dev, measuring_enforcer, cap, calibration)
        if measured and pool is not None:
            # The measurement's reloads and casts took blocks of the simulated device: a fresh
            # pool, so that its pages are not left reserved (and fragmented) for the training.
            pool = DevicePool(cap)
    if cal and "emulated_link" in cal:
        link, roofs = cal["emulated_link"], cal.get("rooflines", {})
        log.warning("bagualu: the host backend's copies emulate %s (offload %s GB/s, reload %s "
                    "GB/s here: docs/planner.md, \"An emulated device link\")",
                    link.get("stands_for"), roofs.get("offload", {}).get("peak_GBps"),
                    roofs.get("reload", {}).get("peak_GBps"))
    gov = Governor(governor, deadline_s=deadline_s,
                   gpu_index=(dev.index or 0) if dev.type == "cuda" else pipeline_rank,
                   calibration=cal)
    settings = Settings(
        device=dev, capacity=cap, policy=policy, pipeline_rank=pipeline_rank,
        pipeline_stages=pipeline_stages, micro_batches=micro_batches,
        log_iterations=log_iterations, fp8_block=fp8_block,
        pinned_capacity=pinned, chunks=chunks, gc_freeze=gc_freeze,
        issue_order=issue_order, sync_copies=pool is not None and not calibrations.overlaps(cal),
        allow_fp8=bool(allow_fp8), compiled_operators=compiled_operators,
        compiled_recompute=compiled_recompute, min_load_factor=min_load_factor,
        emulated_link=json.dumps(cal) if cal and "emulated_link" in cal else None)
    rt = runtime.Runtime(settings, gov, pool)
    _active.runtime = rt
    return rt


def uninstall() -> None:
    """Removes hooks and closes the governor session (the allocator stays: it cannot be
    swapped back once used)."""
    rt = runtime.active()
    if rt is not None:
        drain_failed_backward()
        rt.close()
        _active.runtime = None


def drain_failed_backward() -> None:
    """Lets PyTorch drop what a failed backward left with it. When a backward stops with an
    error (a reload that failed, an out of memory), the autograd nodes that were ready to run
    stay in the calling thread's ready queue, each holding its part of the graph, the records
    saved there and so the enforcer and its blocks, until that thread runs another backward
    (PyTorch's engine; without bagualu the same graph's activations stay). An empty backward
    here lets them go before the runtime closes (issue 45); it touches no tensor of the
    caller's."""
    with torch.inference_mode(False), torch.enable_grad():
        torch.zeros((), requires_grad=True).backward()
