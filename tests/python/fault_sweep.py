"""The fault sweep (issue 45 item 3; docs/operations.md, "Fault injection"): a short training run
of an unmodified Hugging Face model (transformers' Mixtral or Qwen3-MoE from a small config) under
a plan that offloads, recomputes and (in the FP8 plan) stores in FP8, with the Nth device,
pinned or copy operation failed, failed from the Nth on, or the Nth copy stalled past the wait
bound. Each case runs in a child forked from one process that imported everything once (a
crash or a hang of a case is seen, not suffered), and ends in one of:

  equal     training finished; losses and gradients equal a clean run of the same plan (bit for
            bit; within 1% relative L2 per parameter where the plan stores FP8)
  named     training stopped with an error that names what failed (the fault's own text, the
            wait bound's, or an out of memory the injected failure caused)
  unreached the run has fewer operations of that kind than N

and nothing leaked: after uninstall every device block is back in the pool (allocated bytes 0)
and every pinned host block was given back (bgl_alloc_fault_stats.pinned_blocks_live 0), and
no record is alive, whether training finished or stopped. Any
other ending (a wrong gradient, an unnamed error, a crash, a hang, a leak) is a failure.

    python tests/python/fault_sweep.py --full            # every N of every kind (docs)
    python tests/python/fault_sweep.py --sample 16 --seed 45
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations" / "pytorch"))
sys.path.insert(0, str(ROOT / "integrations" / "pytorch" / "examples"))

KINDS = ("device", "pinned", "copy", "stall")
WAIT_TIMEOUT_MS = 200  # the cases' wait bound; a stalled copy waits STALL_MS
STALL_MS = 1500
CASE_TIMEOUT_S = 120.0  # a case still running then is a hang
NAMED = ("fault injection", "did not complete within", "out of memory")


class FaultStats(ctypes.Structure):
    _fields_ = [("device_ops", ctypes.c_uint64), ("pinned_ops", ctypes.c_uint64),
                ("copy_ops", ctypes.c_uint64), ("fired", ctypes.c_uint64),
                ("pinned_blocks_live", ctypes.c_int64)]


class AllocStats(ctypes.Structure):  # the head of bgl_alloc_stats
    _fields_ = [("allocated_bytes", ctypes.c_int64), ("allocated_bytes_peak", ctypes.c_int64),
                ("rest", ctypes.c_int64 * 64)]


def _alloc_lib():
    from bagualu.native import libs
    return libs.load("libbgl_alloc.so")


def fault_stats() -> FaultStats:
    s = FaultStats()
    assert _alloc_lib().bgl_alloc_fault_get_stats(ctypes.byref(s)) == 0
    return s


def configure(spec: str, wait_timeout_ms: int) -> None:
    lib = _alloc_lib()
    lib.bgl_alloc_fault_configure.argtypes = [ctypes.c_char_p, ctypes.c_int64]
    lib.bgl_alloc_last_error.restype = ctypes.c_char_p
    if lib.bgl_alloc_fault_configure(spec.encode(), wait_timeout_ms) != 0:
        raise ValueError(lib.bgl_alloc_last_error().decode())


def device_allocated() -> int:
    s = AllocStats()
    rc = _alloc_lib().bgl_alloc_get_stats(0, ctypes.byref(s))
    return s.allocated_bytes if rc == 0 else 0


def plan(model: str, fp8: bool) -> Dict[str, str]:
    import unmodified
    return unmodified.mixed_strategies(model, fp8)


class StopTraining(Exception):
    """The error ``run_once(stop_at_forward=K)`` stops training with."""


def run_once(model: str, forced: Dict[str, str], spec: str,
             stop_at_forward: Optional[int] = None) -> Dict[str, Any]:
    """One training run with the fault ``spec`` (in the child); what a case's ending needs.
    ``stop_at_forward`` K: training stops with StopTraining as the Kth forward begins (the
    forwards before it still waiting for their backwards)."""
    import bagualu
    import unmodified
    os.environ["BGL_FAULT_STALL_MS"] = str(STALL_MS)  # read once, at the first configure
    configure(spec, WAIT_TIMEOUT_MS)
    out: Dict[str, Any] = {"error": None}
    if stop_at_forward is not None:
        loss_of, calls = unmodified.loss_of, [0]

        def stopping(*args: Any) -> Any:
            calls[0] += 1
            if calls[0] == stop_at_forward:
                raise StopTraining(f"stopped as forward {stop_at_forward} began")
            return loss_of(*args)
        unmodified.loss_of = stopping
    try:
        r = unmodified.train(model, "keep-all" if forced is not None else None, forced=forced,
                             ep=False, iterations=1, layers=2, spike_every=0)
        out["error"] = r["oom"]
        out["losses"] = r["losses"]
        out["grads"] = r["grads"]
        out["tracker"] = r.get("stats", {}).get("tracker", {})
    except Exception as e:  # noqa: BLE001: every error is an ending to judge
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        gc.collect()  # the graphs of a run stopped by an error go before uninstall
        try:
            bagualu.uninstall()
        except Exception as e:  # noqa: BLE001
            out["error"] = (out["error"] or "") + f"; uninstall: {type(e).__name__}: {e}"
        gc.collect()
        if stop_at_forward is not None:
            unmodified.loss_of = loss_of
    from bagualu.record import Record
    s = fault_stats()
    out.update(device_ops=s.device_ops, pinned_ops=s.pinned_ops, copy_ops=s.copy_ops,
               fired=s.fired, pinned_live=s.pinned_blocks_live, device_live=device_allocated(),
               records_live=sum(1 for o in gc.get_objects() if issubclass(type(o), Record)))
    return out


def _rel_l2(have, want) -> float:
    return float((have.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def compare(ref: Dict[str, Any], got: Dict[str, Any], rel_l2: float) -> Optional[str]:
    """None when ``got`` equals ``ref`` (bitwise, or within ``rel_l2`` per parameter), else why
    not."""
    import torch
    if got["losses"] != ref["losses"]:
        return f"losses differ: {got['losses']} vs {ref['losses']}"
    if set(got["grads"]) != set(ref["grads"]):
        return "not the same parameters have gradients"
    for name, want in ref["grads"].items():
        have = got["grads"][name]
        if rel_l2 == 0.0:
            if not torch.equal(have, want):
                return f"gradient of {name} differs"
        else:
            err = _rel_l2(have, want)
            if err > rel_l2:
                return f"gradient of {name} off by {err:.3g} relative L2"
    return None


def _child(fn, path: str) -> None:
    """Runs ``fn`` in a forked child; its result goes to ``path`` (torch.save)."""
    import torch
    code = 0
    try:
        torch.save(fn(), path)
    except BaseException as e:  # noqa: BLE001
        sys.stderr.write(f"fault sweep child: {type(e).__name__}: {e}\n")
        code = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forked(fn, timeout_s: float = CASE_TIMEOUT_S) -> Dict[str, Any]:
    """``fn()`` in a child process: {"result": ...} or {"crash": why} or {"hang": seconds}."""
    import torch
    fd, path = tempfile.mkstemp(prefix="bgl-fault-", suffix=".pt")
    os.close(fd)
    try:
        pid = os.fork()
        if pid == 0:
            _child(fn, path)
        start = time.monotonic()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                break
            if time.monotonic() - start > timeout_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return {"hang": timeout_s}
            time.sleep(0.05)
        if os.WIFSIGNALED(status):
            return {"crash": f"signal {os.WTERMSIG(status)}"}
        if os.WEXITSTATUS(status) != 0:
            return {"crash": f"exit {os.WEXITSTATUS(status)}"}
        return {"result": torch.load(path, weights_only=False)}
    finally:
        os.unlink(path)


def judge(case: Dict[str, Any], ref: Dict[str, Any], got: Dict[str, Any]) -> Dict[str, Any]:
    """The ending of one case and whether it is one of the allowed ones."""
    row = dict(case)
    if "crash" in got or "hang" in got:
        row.update(ending="crash" if "crash" in got else "hang", ok=False,
                   detail=got.get("crash", got.get("hang")))
        return row
    r = got["result"]
    leak = []
    if r["pinned_live"] != 0:
        leak.append(f"{r['pinned_live']} pinned blocks")
    if r["device_live"] != 0:
        leak.append(f"{r['device_live']} device bytes")
    if r.get("records_live", 0) != 0:
        leak.append(f"{r['records_live']} records")
    if r["fired"] == 0:
        ending, ok, detail = "unreached", r["error"] is None, r["error"] or ""
        if r["error"] is None:
            why = compare(ref, r, case["rel_l2"])
            ok, detail = why is None, why or ""
    elif r["error"] is not None:
        named = any(t in r["error"] for t in NAMED)
        ending, ok, detail = ("named" if named else "unnamed error"), named, r["error"]
    else:
        why = compare(ref, r, case["rel_l2"])
        ending, ok, detail = ("equal", True, "") if why is None else ("WRONG GRADIENT", False,
                                                                       why)
        t = r.get("tracker", {})
        absorbed = [k for k in ("offload_failures", "fp8_failures", "evictions") if t.get(k)]
        if ok and absorbed:
            detail = ", ".join(f"{k} {t[k]}" for k in absorbed)
    if leak:
        # Told apart: a leak after a named error, a leak after a finished run.
        ending = "named+leak" if ending == "named" else "leak"
        ok, detail = False, "; ".join(leak) + (f" ({detail})" if detail else "")
    row.update(ending=ending, ok=ok, detail=str(detail)[:300])
    return row


def sweep(model: str, fp8: bool, overlap: bool, kinds=KINDS, sample: Optional[int] = None,
          seed: int = 45, log=print, only: Optional[List[str]] = None) -> Dict[str, Any]:
    """Runs the clean reference, then every N of every kind (or ``sample`` of them, drawn with
    ``seed``, plus each kind's first operation and a from-the-first-on case). ``overlap``: copies
    on the host backend's copy threads (a calibration whose copies overlap compute), else
    synchronous copies."""
    forced = plan(model, fp8)
    if overlap:
        cal = Path(tempfile.mkdtemp(prefix="bgl-fault-cal-")) / "overlap.json"
        cal.write_text(json.dumps({
            "gpu": "host", "copy_overlap": 1, "source": "fault sweep",
            "rooflines": {"offload": {"launch_floor_us": 1, "peak_GBps": 8},
                          "reload": {"launch_floor_us": 1, "peak_GBps": 8}}}))
        os.environ["BGL_CALIBRATION"] = str(cal)
    else:
        os.environ.pop("BGL_CALIBRATION", None)
    t0 = time.monotonic()
    clean = forked(lambda: run_once(model, forced, "count"))
    if "result" not in clean or clean["result"]["error"] is not None:
        raise RuntimeError(f"the clean run failed: {clean}")
    ref = clean["result"]
    counts = {"device": ref["device_ops"], "pinned": ref["pinned_ops"], "copy": ref["copy_ops"],
              "stall": ref["copy_ops"]}
    tol = 0.0
    if fp8:
        # FP8's tolerance: a fault may leave a tensor in full precision (a failed cast is
        # absorbed), so a case is judged against plain PyTorch, within twice the clean FP8
        # run's own largest relative L2 error (at least 2%).
        plain = forked(lambda: run_once(model, None, ""))["result"]
        err = max(_rel_l2(ref["grads"][n], plain["grads"][n]) for n in plain["grads"])
        tol = max(0.02, 2 * err)
        log(f"FP8: the clean run is within {err:.3g} relative L2 of plain PyTorch; "
            f"tolerance {tol:.3g}")
        assert ref["losses"] == plain["losses"]
        ref = plain
    cases: List[Dict[str, Any]] = []
    rng = random.Random(seed)
    for kind in kinds:
        ns = list(range(1, counts[kind] + 1))
        if sample is not None:
            ns = sorted(set([1] + rng.sample(ns, min(sample, len(ns))))) if ns else []
        specs = [f"{kind}:{n}" for n in ns]
        if kind != "stall" and counts[kind] > 0:
            specs.append(f"{kind}:1+")
        cases += [{"model": model, "fp8": fp8, "overlap": overlap, "spec": s,
                   "rel_l2": tol if fp8 else 0.0} for s in specs]
    if only:  # these cases only
        cases = [{"model": model, "fp8": fp8, "overlap": overlap, "spec": s,
                  "rel_l2": tol if fp8 else 0.0} for s in only]
    rows = []
    for case in cases:
        c0 = time.monotonic()
        got = forked(lambda: run_once(model, forced, case["spec"]))
        row = judge(case, ref, got)
        row["seconds"] = round(time.monotonic() - c0, 2)
        rows.append(row)
        log(f"{'ok ' if row['ok'] else 'BAD'} {model} fp8={int(fp8)} overlap={int(overlap)} "
            f"{case['spec']:<11} {row['ending']:<10} {row['seconds']:6.2f}s {row['detail']}")
    return {"counts": counts, "rows": rows, "seconds": round(time.monotonic() - t0, 1)}


RPCS = ("probe", "register", "plan", "plan_after_gate", "report", "end_session",
        "list_sessions")


def rpc_sweep(daemon_factory, model: str = "mixtral", sample: Optional[int] = None,
              seed: int = 45, log=print) -> Dict[str, Any]:
    """The daemon killed (SIGKILL) just before, or just after, the Kth RPC of a training run
    under policy bagualu planned by the daemon (every K of a clean run's RPCs, or ``sample`` of
    them), in this process (only the RPC layer fails). ``daemon_factory()`` gives a started
    daemon with ``address`` and ``kill()``/``stop()`` (tests/python/test_governor.py Daemon).
    Every case must finish training with the gradients of plain PyTorch, bit for bit (FP8 off:
    the fallback planner's plans may differ from the daemon's, not what the backward computes),
    and leak nothing."""
    import bagualu
    import unmodified
    from bagualu.planning.remote import RemoteGovernor
    kw = dict(ep=False, iterations=1, layers=2, spike_every=0)
    plain = unmodified.train(model, None, **kw)
    capacity = unmodified.keep_all_peak(model, **kw) // 2
    originals = {name: getattr(RemoteGovernor, name) for name in RPCS}
    calls: List[str] = []
    kill_at: Dict[str, Any] = {}

    def wrap(name: str):
        real = originals[name]

        def rpc(self, *args, **kwargs):
            calls.append(name)
            k = len(calls)
            if kill_at.get("k") == k and kill_at["when"] == "before":
                kill_at["daemon"].kill()
                kill_at["killed"] = name
            try:
                return real(self, *args, **kwargs)
            finally:
                if kill_at.get("k") == k and kill_at["when"] == "after":
                    kill_at["daemon"].kill()
                    kill_at["killed"] = name
        return rpc

    def one(k: Optional[int], when: str) -> Dict[str, Any]:
        d = daemon_factory()
        calls.clear()  # the factory's own readiness probes are not the run's
        kill_at.clear()
        kill_at.update(k=k, when=when, daemon=d)
        row: Dict[str, Any] = {"model": model, "k": k, "when": when}
        t0 = time.monotonic()
        try:
            r = unmodified.train(model, "bagualu", capacity=capacity, governor=d.address,
                                 allow_fp8=False, **kw)
            error = r["oom"]
        except Exception as e:  # noqa: BLE001
            error, r = f"{type(e).__name__}: {e}", None
        finally:
            try:
                bagualu.uninstall()
            except Exception as e:  # noqa: BLE001
                error = (error or "") + f"; uninstall: {e}"
            gc.collect()
            d.stop()
        s = fault_stats()
        row.update(rpcs=list(calls), killed=kill_at.get("killed"), seconds=round(
            time.monotonic() - t0, 2))
        why = error
        if why is None:
            why = compare(plain, r, 0.0)
        leak = [f"{n} {what}" for n, what in ((s.pinned_blocks_live, "pinned blocks"),
                                               (device_allocated(), "device bytes")) if n]
        if leak:
            why = (why + "; " if why else "") + "leak: " + ", ".join(leak)
        if k is not None and kill_at.get("killed") is None:
            why = (why + "; " if why else "") + f"the run made fewer than {k} RPCs"
        row.update(ok=why is None, detail=why or "",
                   governor=(r or {}).get("stats", {}).get("governor"))
        return row

    for name in RPCS:
        setattr(RemoteGovernor, name, wrap(name))
    try:
        clean = one(None, "never")
        if not clean["ok"]:
            raise RuntimeError(f"the clean run with the daemon failed: {clean}")
        n = len(clean["rpcs"])
        ks = list(range(1, n + 1))
        cases = [(k, w) for k in ks for w in ("before", "after")]
        if sample is not None:
            cases = sorted(random.Random(seed).sample(cases, min(sample, len(cases))))
        rows = []
        for k, when in cases:
            row = one(k, when)
            row["rpc"] = clean["rpcs"][k - 1]
            rows.append(row)
            log(f"{'ok ' if row['ok'] else 'BAD'} {model} daemon killed {when:<6} RPC {k:>3} "
                f"({row['rpc']}) -> {row['governor']} {row['seconds']:6.2f}s {row['detail']}")
    finally:
        for name, real in originals.items():
            setattr(RemoteGovernor, name, real)
    return {"clean_rpcs": clean["rpcs"], "rows": rows}


def summary(results: List[Dict[str, Any]]) -> str:
    """A markdown table: per configuration and kind, cases by ending."""
    lines = ["| model | plan | copies | kind | cases | equal | named error | unreached | bad |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        by: Dict[str, List[Dict[str, Any]]] = {}
        for r in res["rows"]:
            by.setdefault(r["spec"].split(":")[0], []).append(r)
        for kind, rows in by.items():
            r0 = rows[0]
            n = lambda e: sum(1 for r in rows if r["ending"] == e)  # noqa: E731
            lines.append(
                f"| {r0['model']} | {'offload+recompute+FP8' if r0['fp8'] else 'offload+recompute'}"
                f" | {'copy threads' if r0['overlap'] else 'synchronous'} | {kind} "
                f"(of {res['counts'][kind]}) | {len(rows)} | {n('equal')} | {n('named')} | "
                f"{n('unreached')} | {sum(1 for r in rows if not r['ok'])} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mixtral,qwen3_moe")
    p.add_argument("--sample", type=int, default=None, help="N per kind, seeded (default: all)")
    p.add_argument("--full", action="store_true", help="every N of every kind")
    p.add_argument("--seed", type=int, default=45)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--configs", default="plain-sync,fp8-sync,plain-overlap,fp8-overlap",
                   help="PLAN-COPIES pairs: plain or fp8, sync or overlap")
    p.add_argument("--json", default=None, help="write every case's row here")
    p.add_argument("--specs", default=None, help="these fault specs only (comma separated)")
    p.add_argument("--rpc", action="store_true",
                   help="the daemon-kill sweep instead (needs bgl-governord: BGL_GOVERNORD or "
                        "BGL_LIB_DIR's build)")
    p.add_argument("--stop-at-forward", type=int, default=None, metavar="K",
                   help="instead: one run per model and configuration, no fault, stopped by an "
                        "error as the Kth forward begins; what stays held after uninstall")
    a = p.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    import bagualu  # noqa: F401  (imported once, before the children fork)
    import unmodified  # noqa: F401
    sample = None if a.full else a.sample
    if a.rpc:
        return rpc_main(a.models.split(","), sample, a.seed, a.json)
    if a.stop_at_forward is not None:
        return stopped_main(a.models.split(","), a.configs.split(","), a.stop_at_forward, a.json)
    results = []
    t0 = time.monotonic()
    for model in a.models.split(","):
        for config in a.configs.split(","):
            plan_name, copies = config.split("-")
            results.append(sweep(model, plan_name == "fp8", copies == "overlap",
                                 kinds=a.kinds.split(","), sample=sample, seed=a.seed,
                                 only=a.specs.split(",") if a.specs else None))
    rows = [r for res in results for r in res["rows"]]
    print(summary(results))
    print(f"{len(rows)} cases, {sum(1 for r in rows if not r['ok'])} bad, "
          f"{time.monotonic() - t0:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def stopped_main(models: List[str], configs: List[str], k: int, json_path: Optional[str]
                 ) -> int:
    """Training stopped by an error before the Kth forward (the forwards before it never
    backwarded): after uninstall nothing may stay held."""
    rows = []
    for model in models:
        for config in configs:
            plan_name, copies = config.split("-")
            if copies != "sync":
                raise SystemExit(f"--stop-at-forward: configuration {config}: only sync")
            forced = plan(model, plan_name == "fp8")
            got = forked(lambda: run_once(model, forced, "count", stop_at_forward=k))
            r = got.get("result", {})
            held = {n: r.get(n) for n in ("pinned_live", "device_live", "records_live")}
            ok = "result" in got and "StopTraining" in (r["error"] or "") and not any(
                held.values())
            rows.append({"model": model, "config": config, "ok": ok,
                         "error": r.get("error") or got.get("crash") or got.get("hang"),
                         **held})
            print(f"{'ok ' if ok else 'BAD'} {model} {config} stopped at forward {k}: {held} "
                  f"({rows[-1]['error']})")
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


def rpc_main(models: List[str], sample: Optional[int], seed: int, json_path: Optional[str]
             ) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_governor import Daemon

    tmp = Path(tempfile.mkdtemp(prefix="bgl-rpc-sweep-"))
    os.environ.setdefault("BGL_CACHE_DIR", str(tmp / "cache"))

    def factory():
        d = Daemon(tmp)
        d.start()
        return d

    results = [rpc_sweep(factory, m, sample, seed) for m in models]
    rows = [r for res in results for r in res["rows"]]
    print(f"{len(rows)} cases, {sum(1 for r in rows if not r['ok'])} bad")
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
