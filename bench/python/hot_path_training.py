"""The hot path's calls inside a training run (hot_path.py --training MODEL): examples/
unmodified.py's ``train(MODEL, "bagualu", ...)`` at half of keep-all's peak (width 4,
128-token micro-batches, every expert local, stage 0 of a 4-stage 1F1B pipeline), with the
package's hook and enforcer methods wrapped by ``time.perf_counter_ns`` (no profiler). Rows:
the pack hook by what it returned (the tensor itself under light capture or for a small storage,
a record kept on the device, a record whose data left it), the unpack hook and the last-holder release by the
record's placement, and the C calls underneath; per row the median and 90th percentile per call
and the calls and milliseconds per iteration, over the iterations after the first. Inside
training every call costs several times the synthetic benchmark's (the model's kernels leave
the caches cold between hooks). Not thread-safe: one training thread, as the hooks are."""
from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Dict, List

ns = time.perf_counter_ns


def measure(package_dir: str, model: str, iterations: int) -> Dict[str, Dict[str, float]]:
    """Runs the training above with ``package_dir``'s bagualu; per row its summary."""
    sys.path.insert(0, os.path.join(package_dir, "examples"))
    import torch
    import unmodified as u
    from bagualu import record as R
    from bagualu.capture import tracker as T
    from bagualu.enforce import device as D
    from bagualu.enforce import enforcer as E

    times: Dict[str, List[int]] = {}
    on = [False]

    def note(key: str, t0: int) -> None:
        if on[0]:
            times.setdefault(key, []).append(ns() - t0)

    def wrap(cls: Any, name: str, key: str) -> None:
        f = getattr(cls, name, None)
        if f is None:  # not in this version of the package
            return

        def g(*a: Any, **k: Any) -> Any:
            t0 = ns()
            try:
                return f(*a, **k)
            finally:
                note(key, t0)
        setattr(cls, name, g)

    def what_of(r: Any, t: Any) -> str:
        return ("light or small: the tensor itself" if r is t else
                "record, " + ("kept" if r.rec.placement == "device" else "moved")
                if isinstance(r, R.Packed) else "other")

    if "pack" in vars(T.Tracker):  # a package whose hooks are Python methods
        pack = T.Tracker.pack

        def timed_pack(self: Any, t: Any) -> Any:
            t0 = ns()
            r = pack(self, t)
            note(f"pack ({what_of(r, t)})", t0)
            return r
        T.Tracker.pack = timed_pack
        unpack, release = R.Packed.unpack, R.Packed.__del__

        def timed_unpack(self: Any) -> Any:
            where, t0 = self.rec.placement, ns()
            r = unpack(self)
            note(f"unpack ({where})", t0)
            return r

        def timed_del(self: Any) -> None:
            where, t0 = self.rec.placement, ns()
            release(self)
            note(f"Packed.__del__ ({where})", t0)
        R.Packed.unpack, R.Packed.__del__ = timed_unpack, timed_del
    else:  # the compiled binding's hooks, per tracker (a Packed's release is not timed alone)
        init = T.Tracker.__init__

        def timed_init(self: Any, *a: Any, **k: Any) -> None:
            init(self, *a, **k)
            pack, unpack = self.pack, self.unpack

            def timed_pack(t: Any) -> Any:
                t0 = ns()
                r = pack(t)
                note(f"pack ({what_of(r, t)})", t0)
                return r

            def timed_unpack(p: Any) -> Any:
                where = p.rec.placement if isinstance(p, R.Packed) else "tensor"
                t0 = ns()
                r = unpack(p)
                note(f"unpack ({where})", t0)
                return r
            self.pack, self.unpack = timed_pack, timed_unpack
        T.Tracker.__init__ = timed_init
    for name in ("register", "offload_saved", "offload", "_acquire", "prefetch", "retire"):
        wrap(E.Enforcer, name, f"Enforcer.{name}")
    wrap(D.DeviceMemory, "alloc", "DeviceMemory.alloc")
    wrap(D.DeviceMemory, "free", "DeviceMemory.free")

    torch.set_num_threads(1)
    kw: Dict[str, Any] = dict(width=4, seq=128, ep=False)
    cap = u.keep_all_peak(model, **kw) // 2
    state = {"it": 0}
    import bagualu
    end = bagualu.end_iteration

    def counting_end(*a: Any, **k: Any) -> Any:
        state["it"] += 1
        on[0] = True  # from the second iteration on (the first captures)
        return end(*a, **k)
    bagualu.end_iteration = counting_end
    try:
        r = u.train(model, "bagualu", capacity=cap, iterations=iterations, **kw)
    finally:
        bagualu.end_iteration = end
    assert r["oom"] is None, r["oom"]
    measured = max(iterations - 1, 1)
    out: Dict[str, Dict[str, float]] = {}
    for key, v in sorted(times.items()):
        s = sorted(v)
        out[key] = {"median_us": statistics.median(s) / 1e3, "p90_us": s[int(len(s) * 0.9)] / 1e3,
                    "calls": len(s) / measured, "ms_per_iteration": sum(s) / 1e6 / measured}
    out["iteration (wall)"] = {"median_us": statistics.median(r["times_ms"][1:]) * 1e3,
                               "p90_us": max(r["times_ms"][1:]) * 1e3, "calls": 1,
                               "ms_per_iteration": statistics.median(r["times_ms"][1:])}
    return out


def table(results: Dict[str, Dict[str, float]]) -> List[str]:
    rows = ["| call, in training | median (p90) us | calls/iteration | ms/iteration |",
            "| --- | --- | --- | --- |"]
    for key, s in results.items():
        rows.append(f"| {key} | {s['median_us']:.1f} ({s['p90_us']:.1f}) | {s['calls']:.0f} | "
                    f"{s['ms_per_iteration']:.1f} |")
    return rows

