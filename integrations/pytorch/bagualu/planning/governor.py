"""The governor as seen from a training process: the daemon over gRPC (unix socket) with short
deadlines, or the embedded planner (libbgl_planner.so) when no daemon answers in time. Either
way the same calls: register, plan, plan_after_gate, report, reset_iteration, close.

While the daemon is unreachable, plan points retry it with exponential backoff (Backoff) and,
once it answers, register the same model again (and end the session held before); nothing
waits on the daemon in between. What each failed call does is one table, docs/operations.md
"Failed calls", which the C++ RemoteGovernor follows too (tests/governor_client_cases.json)."""
from __future__ import annotations

import logging
import math
import os
import random
import time
from typing import Any, Callable, Dict, List, Optional

from . import embedded as plannermod
from . import static
from ..errors import PlannerError
from ..settings import check_job_id, show_size
from .remote import RemoteGovernor, error_kind

log = logging.getLogger("bagualu")
DEFAULT_ADDRESS = "unix:///run/bagualu/governor.sock"

RETRY_INITIAL_S = 0.1   # first retry after the daemon failed
RETRY_MAX_S = 2.0       # the delay doubles up to this
RETRY_JITTER = 0.2      # each delay is drawn from [1 - jitter, 1] x the nominal one
PROBE_TIMEOUT_S = 0.05  # a retry's first, cheap call (the registration after it has 2 s)


class Backoff:
    """Exponential backoff: ``next_delay()`` gives initial, 2x, 4x, ... up to ``maximum``
    seconds, each shortened by up to ``jitter`` (a fraction) so that processes that lost the
    same daemon do not all come back at once; ``reset()`` starts again at ``initial``."""

    def __init__(self, initial: float = RETRY_INITIAL_S, maximum: float = RETRY_MAX_S,
                 jitter: float = RETRY_JITTER,
                 rand: Callable[[], float] = random.random) -> None:
        if not 0 < initial <= maximum:
            raise ValueError(f"backoff: need 0 < initial <= maximum, got {initial}, {maximum}")
        if not 0 <= jitter < 1:
            raise ValueError(f"backoff: jitter must be in [0, 1), got {jitter}")
        self.initial, self.maximum, self.jitter, self._rand = initial, maximum, jitter, rand
        self._nominal = initial

    def next_delay(self) -> float:
        nominal = self._nominal
        self._nominal = min(nominal * 2, self.maximum)
        return nominal * (1 - self.jitter * self._rand())

    def reset(self) -> None:
        self._nominal = self.initial


class Governor:
    """Plans for one stage: remote when a daemon answers, else embedded."""

    def __init__(self, address: Optional[str] = None, deadline_s: float = 0.5,
                 job_id: str = "", gpu_index: int = 0, backoff: Optional[Backoff] = None,
                 clock: Callable[[], float] = time.monotonic,
                 calibration: Optional[Dict[str, Any]] = None) -> None:
        self.address = address if address is not None else os.environ.get(
            "BGL_GOVERNOR", DEFAULT_ADDRESS)
        self.deadline_s = deadline_s
        if job_id:
            self.job_id = check_job_id(job_id)
        else:  # the variable's errors name it: the user may not know it is set
            self.job_id = check_job_id(os.environ.get("BGL_JOB_ID") or f"pid-{os.getpid()}",
                                       "BGL_JOB_ID")
        self.gpu_index = gpu_index
        self.embedded: Optional[plannermod.EmbeddedPlanner] = None
        self.remote: Any = None
        self.description: Optional[Dict[str, Any]] = None
        self.kind: Optional[str] = None
        self.backoff = backoff or Backoff()
        self.clock = clock
        self._retry_at = math.inf  # when a plan point may next try the daemon
        self.registrations = 0     # successful registrations with a daemon (first and again)
        # The session held when the daemon failed, which it may still hold (a missed deadline,
        # an internal error): ended once registered again, so one model has one session.
        self._stale_session = ""
        # The node's arbitration (issue 14): this process's pinned host grant and its share of
        # its host link's bandwidth, as the daemon last said; None: no grant (no daemon yet).
        self.grant: Optional[int] = None
        self.share = 1.0
        # The machine's rooflines both planners plan with (planning/calibration.py); None:
        # the built-in profile of the model document.
        self.calibration = calibration
        self._model: Optional[Dict[str, Any]] = None
        self._options: Dict[str, Any] = {}

    @property
    def ready(self) -> bool:
        return self.kind is not None

    @property
    def uses_daemon(self) -> bool:
        return bool(self.address) and self.address.lower() not in ("none", "embedded", "off")

    def _to_embedded(self, what: str, retry_in: Optional[float]) -> None:
        """Plans in-process from now on; the first plan point ``retry_in`` seconds from now
        tries the daemon again (None: never, the daemon refused the model itself). ``what``:
        the address and why, e.g. "unix:///x.sock is unavailable (UNAVAILABLE: ...)"."""
        if retry_in is not None:
            log.warning("bagualu: governor unreachable: %s; planning in-process (the embedded "
                        "planner), retrying with backoff", what)
        else:
            log.warning("bagualu: governor at %s; planning in-process (the embedded planner) "
                        "for good", what)
        if self.grant is not None and self.kind == "remote":
            log.warning("bagualu: keeping the node's last host grant (%s) and bandwidth "
                        "share (%.2f) while planning in-process", show_size(self.grant, True),
                        self.share)
        self._drop_remote()
        self.kind = "embedded"
        self._retry_at = math.inf if retry_in is None else self.clock() + retry_in

    def _drop_remote(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _connect(self, wait_s: Optional[float]) -> None:
        """Registers the model with the daemon on a new channel: after waiting up to
        ``wait_s`` for the channel (at start), or after one fail-fast probe (a retry). On
        success the daemon plans from now on; any failure propagates."""
        remote = RemoteGovernor(self.address, self.deadline_s)
        try:
            if wait_s is not None:
                remote.wait_ready(wait_s)
            else:
                remote.probe(PROBE_TIMEOUT_S)
            remote.register(self._model, self._options["capacity_bytes"],
                            self._options["pipeline_rank"], self.job_id, self.gpu_index,
                            budget_step_bytes=self._options["budget_step_bytes"],
                            dual_batch=self._options["dual_batch"],
                            calibration=self._options.get("calibration"),
                            allow_offload=self._options["allow_offload"],
                            allow_fp8=self._options["allow_fp8"],
                            warm_spike_bound=self._warm_spike_bound,
                            replaces_session_id=self._stale_session)
        except BaseException:
            remote.close()
            raise
        self._drop_remote()
        self.remote = remote
        self.kind = "remote"
        self._note_grant(remote.host_grant, None)
        self.registrations += 1
        self.backoff.reset()
        self._retry_at = math.inf
        if self._stale_session:
            # The daemon replaced it; an older daemon, which does not know the field, did not.
            stale, self._stale_session = self._stale_session, ""
            try:
                remote.end_session(stale)
            except Exception as e:  # NOT_FOUND: replaced, or a restart: nothing to end
                log.debug("bagualu: ending the old session %s: %s", stale, _short(e))

    def _registration_failed(self, error: Exception, first: bool) -> None:
        kind, text = error_kind(error)
        if kind in ("refused", "exhausted"):  # the model or the options: refused again
            self._to_embedded(f"{self.address} refused the model ({text[:300]})", None)
        elif first:
            self._to_embedded(f"{self.address} is unavailable ({_short(error)})",
                              self.backoff.next_delay())
        else:  # still away: quietly wait longer
            log.debug("bagualu: governor still unreachable (%s)", _short(error))
            self._retry_at = self.clock() + self.backoff.next_delay()

    def _maybe_reconnect(self) -> None:
        """At a plan point: once the backoff delay has passed, one attempt to register again."""
        if self.remote is not None or self.clock() < self._retry_at:
            return
        try:
            self._connect(wait_s=None)
        except Exception as e:
            self._registration_failed(e, first=False)
            return
        log.warning("bagualu: governor back: session %s", self.remote.session_id)

    def register(self, model: Dict[str, Any], capacity_bytes: int, pipeline_rank: int,
                 allow_offload: bool = True, allow_fp8: bool = True,
                 calibration: Optional[Dict[str, Any]] = None, dual_batch: bool = True) -> None:
        """Describes the stage. The embedded planner is always created (the fallback).

        Both planners get the same plan-cache budget step (budget_step_bytes), sized from the
        capacity, so that every byte count they see and return is real. The model and the
        options are kept: a retry registers exactly the same with a restarted daemon. Called
        again (plans.py register_backward), it closes the embedded planner it had and
        registers anew, naming the session the new one replaces (docs/operations.md,
        "Registering again")."""
        again = self.embedded is not None  # registered again (the capture's backward measured)
        # A daemon found away before stays so until the backoff's next try (_maybe_reconnect,
        # with this model), not waited for again here.
        retry_at = self._retry_at if again and self.remote is None else None
        replaced = ""
        if again:
            if self.remote is not None and self.remote.session_id:
                replaced, self.remote.session_id = self.remote.session_id, ""
            self.close()  # the channel and the embedded planner; the session stays for now
            self._stale_session = replaced or self._stale_session
        step = budget_step_bytes(capacity_bytes)
        self._model = model
        self._options = {"capacity_bytes": int(capacity_bytes), "pipeline_rank": pipeline_rank,
                         "allow_offload": allow_offload, "allow_fp8": allow_fp8,
                         "dual_batch": bool(dual_batch), "budget_step_bytes": step}
        calibration = calibration or self.calibration
        if calibration:
            self._options["calibration"] = calibration
        # The anytime path and the warm-up: search_options and warm_up_options. With a daemon
        # the daemon warms up (once for the job's ranks of one stage), not the fallback.
        warm = warm_up_options()
        self._warm_spike_bound = warm["warm_spike_bound"] if warm["warm_up"] else None
        self.embedded = plannermod.EmbeddedPlanner(
            model, dict(self._options, refine_nice=EMBEDDED_REFINE_NICE,
                        **search_options(),
                        **(warm if not self.uses_daemon else {"warm_up": False})))
        self.description = self.embedded.description
        self.kind = "embedded"
        if not self.uses_daemon:
            if warm["warm_up"]:
                # at once, not at the first plan: a planner registered again between iterations
                # (the capture's backward measured) warms up before the next one starts
                try:
                    self.embedded.warm_up(self.grant if self.grant is not None else -1,
                                          self.share)
                except PlannerError as e:  # the first plan starts it as before
                    log.warning("bagualu: the warm-up did not start at registration (%s)", e)
            return
        if retry_at is not None:
            self._retry_at = retry_at
            return
        try:
            self._connect(wait_s=max(self.deadline_s, 0.2) * 4)
        except Exception as e:  # daemon absent, late, refusing, or grpc missing
            self._registration_failed(e, first=True)
            return
        log.info("bagualu: registered with the governor at %s (session %s)",
                 self.address, self.remote.session_id)

    def _call(self, what: str, *args: Any) -> Any:
        """Calls the remote governor, falling back to the embedded planner on any failure.
        The embedded planner gets every call either way, so it is in step when needed."""
        if self.remote is not None:
            try:
                out = getattr(self.remote, what)(*args)
            except Exception as e:
                kind, text = error_kind(e)
                if kind == "refused":
                    # The daemon understood and refused: a planning error, not an outage.
                    raise PlannerError(f"governor: {text}") from e
                if kind == "lost_session":
                    # It answers: register again at the next plan point.
                    self._to_embedded(f"{self.address} does not know session "
                                      f"{self.remote.session_id} (restarted?)", 0.0)
                elif kind in ("outage", "quota"):
                    self._stale_session = self.remote.session_id
                    self._to_embedded(f"{self.address} is unavailable ({_short(e)})",
                                      self.backoff.next_delay())
                else:
                    # "not_planned": planned in-process before the switch back; "exhausted":
                    # over one of the daemon's limits. The daemon is fine: the embedded
                    # planner, which saw every call, answers this one.
                    log.debug("bagualu: the embedded planner answers %s (%s)", what, text)
            else:
                getattr(self.embedded, what)(*args)  # keep the fallback's state in step
                return out
        return getattr(self.embedded, what)(*args)

    def plan(self, point: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        """Plans a scheduling point; first, after the backoff delay, retries a lost daemon.
        With a grant from the node, the embedded planner plans within it (and within the
        link's bandwidth share) too, so a fallback plan never asks for more than the node
        gave."""
        self._maybe_reconnect()
        if self.grant is not None:
            point = dict(point, host_limit_bytes=int(self.grant), bandwidth_share=self.share)
        try:
            plan = self._call("plan", point)
        except PlannerError as e:
            log.warning("bagualu: planning failed (%s); keeping the previous strategies", e)
            return None
        if plan is not None and self.kind == "remote":
            self._note_grant(plan.get("host_grant_bytes"), plan.get("bandwidth_share"))
        return plan

    def _note_grant(self, grant: Optional[int], share: Optional[float]) -> None:
        """The daemon's host grant and bandwidth share for this session (None: not sent)."""
        if grant is not None and grant > 0 and grant != self.grant:
            log.info("bagualu: the node grants %s of pinned host memory",
                     show_size(int(grant), True))
            self.grant = int(grant)
        if share is not None and share > 0:
            self.share = float(share)

    def plan_after_gate(self, mb: int, chunk: int, layer: int, load: float) -> Optional[Dict]:
        try:
            return self._call("plan_after_gate", mb, chunk, layer, load)
        except PlannerError as e:
            log.warning("bagualu: deferred planning failed (%s)", e)
            return None

    def report(self, mb: int, chunk: int, actual: int,
               stats: Optional[Dict[str, Any]] = None,
               in_effect: Optional[Dict[str, Any]] = None) -> None:
        """What a forward retained; ``stats``: the process's allocator figures now
        (AllocatorStats fields: the daemon shows them, and its grants follow host_used_bytes);
        ``in_effect``: the plans this process serves its micro-batches in flight (InEffect
        fields), whichever planner made them: what the daemon shows as the process's."""
        if self.remote is not None:
            self.remote.stats = dict(stats or {})
            self.remote.in_effect = dict(in_effect) if in_effect else None
        try:
            self._call("report", mb, chunk, int(actual))
        except PlannerError as e:
            log.debug("bagualu: report ignored: %s", e)

    def reset_iteration(self) -> None:
        if self.embedded is not None:
            self.embedded.reset_iteration()
        if self.remote is not None:
            self.remote.reset_iteration()

    def planner_stats(self) -> Optional[Dict[str, Any]]:
        """The embedded planner's counters (bgl_planner_stats: the plan cache, the anytime
        path, the warm-up's warm_keys, warm_hits, warm_cpu_s, ...), or with the daemon its
        warm-up figures under the same names (and warm_shared_hits, warm_shared_keys: the
        plans the job's sessions share); None before register."""
        if self.kind == "remote" and self.remote is not None \
                and self.remote.warm_stats is not None:
            return dict(self.remote.warm_stats)
        if self.embedded is None:
            return None
        try:
            return self.embedded.stats()
        except PlannerError as e:
            log.debug("bagualu: planner stats: %s", e)
            return None

    def static_plan(self, steps: List[Dict[str, Any]], load_factor: float = 1.0, *,
                    moves: bool) -> Dict[str, str]:
        """planning/static.py's static_plan with the registered model and options (``moves``
        has no default here: the public bagualu.static_plan moves by default, the static-under
        policy never does; each caller says which)."""
        if self._model is None:
            raise PlannerError("static_plan: no model registered yet (the capture's first "
                               "iteration registers it)")
        return static.static_plan(self._model, self._options, steps, load_factor, moves=moves)

    def sessions(self) -> List[Dict[str, Any]]:
        """The daemon's sessions as dicts (protobuf field names); [] while planning
        in-process."""
        if self.remote is None:
            return []
        from google.protobuf.json_format import MessageToDict
        return [MessageToDict(s, preserving_proto_field_name=True,
                              always_print_fields_with_no_presence=True)
                for s in self.remote.list_sessions()]

    def close(self) -> None:
        self._retry_at = math.inf
        if self.remote is not None:
            try:
                self.remote.unregister()
            except Exception:
                pass
            self.remote.close()
            self.remote = None
        if self.embedded is not None:
            self.embedded.close()


def _short(e: BaseException) -> str:
    code = getattr(e, "code", None)
    if callable(code) and callable(getattr(e, "details", None)):  # a gRPC error
        return f"{getattr(code(), 'name', code())}: {e.details()}"[:300]
    text = str(e).strip().splitlines()
    detail = text[0] if text else ""
    for line in text:
        if "details" in line:
            detail = line.strip()
    return f"{type(e).__name__}: {detail}"[:200]


EMBEDDED_ANYTIME_MIN_OPS = 1  # the embedded planner's PlannerOptions::anytime_min_ops
# ... and its refiner's nice value (PlannerOptions::refine_nice): in the training process the
# refinements take only the CPU training leaves (docs/planner.md, "The anytime path")
EMBEDDED_REFINE_NICE = 19
WARM_SPIKE_BOUND = 3.0  # the warm-up's default highest load (PlannerOptions::warm_spike_bound)


def env_switch(env: Dict[str, str], name: str, meaning: str) -> bool:
    """Variable ``name`` as an on/off switch, off when unset: 1/true/on/yes or 0/false/off/no
    (any case); ValueError naming it and what on means otherwise."""
    switch = env.get(name, "0").strip().lower()
    if switch not in ("1", "true", "on", "yes", "", "0", "false", "off", "no"):
        raise ValueError(f"{name}: must be 1/true/on/yes ({meaning}) or 0/false/off/no (the "
                         f"default), got {env.get(name)!r}")
    return switch in ("1", "true", "on", "yes")


def search_options(env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The embedded planner's search options from BGL_REPRODUCIBLE_PLANS (0/false/off/no, the
    default: the anytime path at every chunk size, docs/planner.md: a plan-cache miss, on the
    critical path in a training process (the first iterations, every spike), answered at once
    with the first answer and refined on the worker thread, whose plan the key's next point
    gets; the downgrade's search priced at what earlier searches took; 1/true/on/yes: every
    miss planned by the full search on the call and the downgrade's search unpriced, so that a
    run's plans depend on its inputs (the capture's times among them), not on how fast its
    threads ran: reproducible runs and tests, at the full search's cost per miss); ValueError
    naming the variable otherwise."""
    env = os.environ if env is None else env
    if env_switch(env, "BGL_REPRODUCIBLE_PLANS", "plans independent of timing"):
        return {"anytime_min_ops": 0, "gate_search_share": 0.0}
    return {"anytime_min_ops": EMBEDDED_ANYTIME_MIN_OPS}


def warm_up_options(env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The embedded planner's warm-up options (issue 43: from the first plan on, the worker
    thread plans the keys the run will meet at loads 1 to the spike bound, so that a spike and
    the points after it are served by full-search plans) from BGL_WARM_UP (1/true/on/yes: on;
    off by default: with it on, iterations of the unmodified models ran 5-15 times longer on 2
    cores, docs/benchmarks/planner.md "The warm-up"), BGL_WARM_SPIKE_BOUND (a load factor in
    [1, 64]) and BGL_WARM_NICE (the worker thread's nice value, 0-19, default 19); ValueError
    naming the variable otherwise."""
    env = os.environ if env is None else env
    text = env.get("BGL_WARM_SPIKE_BOUND", "").strip()
    bound = WARM_SPIKE_BOUND
    if text:
        try:
            bound = float(text)
        except ValueError:
            bound = math.nan
        if not 1.0 <= bound <= 64.0:
            raise ValueError(f"BGL_WARM_SPIKE_BOUND: the highest load factor the warm-up plans "
                             f"for must be a number in [1, 64], got {text!r}")
    out: Dict[str, Any] = {"warm_up": True, "warm_spike_bound": bound}
    nice = env.get("BGL_WARM_NICE", "").strip()
    if nice:
        if not (nice.isdigit() and 0 <= int(nice) <= 19):
            raise ValueError(f"BGL_WARM_NICE: the warm-up thread's nice value must be an "
                             f"integer in [0, 19], got {nice!r}")
        out["warm_nice"] = int(nice)
    if not env_switch(env, "BGL_WARM_UP", "warm up"):
        return {"warm_up": False}  # (a bad bound or nice value is refused all the same)
    return out
_MIN_STEP = 64 << 10
_MAX_STEP = 64 << 20  # the planner's default (PlannerOptions::budget_step_bytes)


def budget_step_bytes(capacity: int) -> int:
    """The plan cache's budget bucket for a stage of ``capacity`` bytes.

    capacity/64 rounded down to a power of two: budgets within 1/64 of the capacity share a
    plan, which is planned for the bucket's lowest budget, so at most ~1.6% of the capacity
    is left unused by the rounding. At least 64 KiB, because finer steps only split budgets
    that differ by allocator rounding and measurement noise (and the daemon rejects under
    4 KiB); at most the planner's 64 MiB default, which large GPUs keep."""
    step = _MIN_STEP
    while step * 2 <= min(max(int(capacity), 0) // 64, _MAX_STEP):
        step *= 2
    return step
