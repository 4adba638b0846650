"""What ``bagualu.install`` was asked for: the Settings, the policies and issue orders, and
byte sizes as users write them. Immutable values; safe from any thread."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch

from .errors import PolicyError

POLICIES = ("keep-all", "static-under", "static-over", "bagualu")
ISSUE_ORDERS = ("dual-batch", "serial")


def parse_size(value: Any, what: str = "size") -> int:
    """Bytes from an int or a string like '512MiB', '2GiB', '1.5GB' (docs/operations.md,
    "Sizes": binary units for powers of 1024, decimal for powers of 1000; a bare 'G' is
    refused). ValueError naming ``what`` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: {value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: size must be non-negative, got {value}")
        return value
    if isinstance(value, float):
        if not value >= 0 or value != value or value == float("inf"):
            raise ValueError(f"{what}: size must be non-negative and finite, got {value}")
        return int(round(value))
    from .native import alloc
    return alloc.parse_bytes(str(value), what)


def show_size(n: int, exact: bool = False) -> str:
    """A byte count as people read it, by the C++ tools' rule (bgl::FormatBytes, base/units.h):
    binary units, at most three integer digits, three significant figures ('11.8 GiB', '0.98
    KiB', '399 MiB'); ``exact`` adds the count in parentheses ('11.8 GiB (12638097408 bytes)')
    where the exact figure matters."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    v, i = float(n), 0
    while abs(v) >= 1000 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    digits = 0 if i == 0 or abs(v) >= 100 else 1 if abs(v) >= 10 else 2
    text = f"{v:.{digits}f} {units[i]}"
    return f"{text} ({int(n)} bytes)" if exact and i else text


def check_policy(policy: str) -> str:
    """Returns the policy or raises PolicyError naming the known ones."""
    if policy not in POLICIES:
        raise PolicyError(f"unknown policy '{policy}' (known: {', '.join(POLICIES)})")
    return policy


def check_issue_order(order: str) -> str:
    """Returns the issue order or raises PolicyError naming the known ones."""
    if order not in ISSUE_ORDERS:
        raise PolicyError(f"unknown issue_order '{order}' (known: {', '.join(ISSUE_ORDERS)})")
    return order


GOVERNOR_OFF = ("none", "embedded", "off")  # the embedded planner only (planning/governor.py)


def check_min_load_factor(load: Any, policy: str) -> Optional[float]:
    """Returns install(min_load_factor=...) as a float, or None; PolicyError naming the value
    unless it is a number in [1, 64] under the bagualu policy (the planner's range of load
    factors)."""
    if load is None:
        return None
    if isinstance(load, bool) or not isinstance(load, (int, float)) or not 1.0 <= load <= 64.0:
        raise PolicyError(f"min_load_factor: {load!r} is not a load factor in [1, 64] (None: "
                          "plan each point for the load its recent forwards saw)")
    if policy != "bagualu":
        raise PolicyError(f"min_load_factor applies to policy 'bagualu' (its per-point plans), "
                          f"not to '{policy}'")
    return float(load)


def check_governor_address(address: str, what: str = "governor") -> str:
    """Returns ``address`` (a gRPC target: 'unix:///run/bagualu/governor.sock', 'host:port',
    or one of GOVERNOR_OFF; '' is the default) or raises ValueError naming ``what``: an address
    with spaces or control characters, or a unix address without a path, would only be found
    wrong at the first plan, then silently planned in-process."""
    if not isinstance(address, str):
        raise ValueError(f"{what}: {address!r} is not an address")
    if address == "" or address.lower() in GOVERNOR_OFF:
        return address
    if any(c.isspace() or not c.isprintable() for c in address):
        raise ValueError(f"{what}: {address!r} has spaces or control characters (an address is "
                         "unix:///PATH or HOST:PORT; 'none' plans in-process)")
    if address.startswith("unix:") and not address[len("unix:"):].lstrip("/"):
        raise ValueError(f"{what}: {address!r} names no socket path (unix:///PATH)")
    return address


JOB_ID_MAX_BYTES = 256  # the daemon's limit on RegisterRequest.job_id (governor/common)


def check_job_id(job_id: str, what: str = "job_id") -> str:
    """Returns ``job_id`` or raises ValueError naming ``what``: the daemon takes printable ASCII
    of at most 256 bytes (ValidateRegisterRequest) and would refuse any other at registration,
    after which the process would plan in-process."""
    if not isinstance(job_id, str):
        raise ValueError(f"{what}: {job_id!r} is not a string")
    if len(job_id.encode()) > JOB_ID_MAX_BYTES:
        raise ValueError(f"{what}: {len(job_id.encode())} bytes, over the daemon's limit of "
                         f"{JOB_ID_MAX_BYTES}")
    if any(not (0x20 <= ord(c) <= 0x7e) for c in job_id):
        raise ValueError(f"{what}: {job_id!r} must be printable ASCII")
    return job_id


def cache_dir() -> Path:
    """Where the package keeps what it measures or generates (calibrations, the governor's
    generated stubs): ``$BGL_CACHE_DIR`` (unset or empty: ``~/.cache/bagualu``; relative:
    against the working directory when first asked). ValueError naming the variable when it
    names something that is not a directory."""
    value = os.environ.get("BGL_CACHE_DIR", "")
    if not value:
        return Path.home() / ".cache" / "bagualu"
    if any(not c.isprintable() for c in value):
        raise ValueError(f"BGL_CACHE_DIR: {value!r} has control characters")
    path = Path(value).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"BGL_CACHE_DIR: '{value}' exists and is not a directory")
    return path


COMPILED_OPERATORS = ("operators", "block")  # how compiled blocks are planned


def check_compiled_operators(how: str) -> str:
    """Returns ``how`` or raises PolicyError naming the choices (capture/compiled.py)."""
    if how not in COMPILED_OPERATORS:
        raise PolicyError(f"unknown compiled_operators '{how}' (known: "
                          f"{', '.join(COMPILED_OPERATORS)})")
    return how


RecomputeGroups = Tuple[Tuple[str, ...], ...]


def check_compiled_recompute(groups: Any) -> Optional[Union[str, RecomputeGroups]]:
    """Returns ``install(compiled_recompute=)`` normalized (None, "auto", or a tuple of groups,
    each a tuple of operator names) or raises PolicyError naming what is wrong (the names are
    checked against the model's operators at instrument: capture/compiled.py)."""
    if groups is None or groups == "auto":
        return groups
    if isinstance(groups, str) or not isinstance(groups, (list, tuple)):
        raise PolicyError(f"compiled_recompute: {groups!r} is neither None, 'auto' nor a list of "
                          "recompute groups (each a list of operator names, as "
                          "bagualu.operators(model) names them)")
    out = []
    for g in groups:
        if isinstance(g, str):
            g = (g,)
        if not isinstance(g, (list, tuple)) or not g or \
                not all(isinstance(n, str) and n for n in g):
            raise PolicyError(f"compiled_recompute: group {g!r} is not a non-empty list of "
                              "operator names")
        out.append(tuple(g))
    if not out:
        raise PolicyError("compiled_recompute: an empty list of groups (None: no operator "
                          "inside a compiled block is recomputed alone)")
    return tuple(out)


@dataclass(frozen=True)
class Settings:
    """What ``bagualu.install`` was asked for (validated there); immutable."""

    device: torch.device
    capacity: int                  # bytes of activation memory
    policy: str
    pipeline_rank: int = 0
    pipeline_stages: int = 1
    micro_batches: int = 1
    log_iterations: bool = True
    fp8_block: int = 128
    pinned_capacity: int = 16 << 30
    chunks: int = 1                # local stages of an interleaved schedule
    gc_freeze: bool = True
    issue_order: str = "dual-batch"  # or "serial" (enforce/order.py)
    # Whether plans (and pressure eviction under the bagualu policy) may store activations
    # in FP8; False keeps training bit for bit reproducible (offload and recompute are exact).
    allow_fp8: bool = True
    # The host backend's copies on the training thread (the calibration's copy_overlap is 0:
    # they would not overlap compute; enforce/enforcer.py).
    sync_copies: bool = False
    # A calibration document (JSON text) with an "emulated_link" section: the host backend's
    # copies take that link's time (docs/planner.md, "An emulated device link"); None: they
    # take their own.
    emulated_link: Optional[str] = None
    # Compiled blocks: "operators" (their saved tensors placed per operator, torch 2.15) or
    # "block" (one operator each); capture/compiled.py.
    compiled_operators: str = "operators"
    # Recompute groups inside compiled blocks (capture/compiled.py's variants): None, "auto".
    compiled_recompute: Optional[Union[str, RecomputeGroups]] = None
    # Every point plans for at least this load factor (bagualu's plans sized for a known worst
    # load); None: for the median highest router load of the recent forwards (planning/plans.py).
    min_load_factor: Optional[float] = None

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_issue_order(self.issue_order)
        check_compiled_operators(self.compiled_operators)
        check_min_load_factor(self.min_load_factor, self.policy)
        if self.chunks < 1:
            raise ValueError(f"chunks must be at least 1, got {self.chunks}")
