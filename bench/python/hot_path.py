"""bagualu's hot path, call by call: the CPU time of the saved-tensor hooks, of registration
with the enforcer and of each offload, reload, FP8 cast and prefetch, on CPU tensors (the host
backend), without a profiler: every call is timed alone with time.perf_counter_ns and the
median (and 90th percentile) over many calls is printed.

The package's own rooms are built as the runtime builds them (the simulated device's pool, the
enforcer, the tracker) with a fixed strategy, so each call runs the code a training step runs.
The calls run in rounds of one micro-batch (``--per-micro-batch`` storages: its forward packs
them, its backward unpacks them last first, then they are released, so the pools recycle their
blocks as in training), while ``--background`` records of three other micro-batches stay
tracked, as with four in flight at stage 0 of a 4-stage 1F1B pipeline (defaults: about 1,520
saved storages per iteration of 8 micro-batches, 190 each): a call whose cost grows with the
number of records shows it (try ``--background 6000``).
Moves include their copy: the ``copy`` row times the same bytes copied by torch alone and the
``Enforcer.store_fp8`` row the FP8 cast alone (the host twin's kernel through one enforcer
call), so that the cost of a call without its copy or cast is the difference (and the 256-byte
rows have next to no copy).

    BGL_LIB_DIR=build .venv/bin/python bench/python/hot_path.py [--calls 2000] [--json out.json]

Side by side with another version of the package (``--against DIR``: the integrations/pytorch
folder of, e.g., a git worktree of an older commit): the two run alternately, ``--rounds``
processes each, and every row shows both medians (the median over rounds of each round's
median, with the range) and their ratio. Absolute timings on a shared machine move by up to 2x
with its state; the alternation is what makes the ratio mean something.

    git worktree add /tmp/before <commit>
    BGL_LIB_DIR=build .venv/bin/python bench/python/hot_path.py \
        --against /tmp/before/integrations/pytorch --rounds 3

A version whose binding speaks another interface (native/ext.py's ABI_VERSION) needs its own
build: ``--against-lib-dir /tmp/before/build`` (cmake with -DBGL_WITH_GRPC=OFF -DBGL_BUILD_TESTS=OFF
-DBGL_BUILD_BENCH=OFF, target bgl_python).

``--training MODEL``: the same calls inside a training run instead (hot_path_training.py), alone
or ``--against`` another version.

Sizes: ``--bytes`` (default 64 KiB, the median saved storage of examples/unmodified.py's
train(..., width=4, seq=128) on Qwen3-MoE) and 256 bytes.
"""
from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
OWN_PACKAGE = os.path.join(HERE, "..", "..", "integrations", "pytorch")


def _package_dir() -> str:
    """The package this process measures: ``--package DIR`` (set by --against), else ours."""
    argv = sys.argv
    if "--package" in argv:
        return argv[argv.index("--package") + 1]
    return OWN_PACKAGE


sys.path.insert(0, _package_dir())

import torch  # noqa: E402

from bagualu.capture.tracker import Tracker  # noqa: E402
from bagualu.enforce.device import DeviceMemory  # noqa: E402
from bagualu.enforce.enforcer import Enforcer  # noqa: E402
from bagualu.enforce.pool import DevicePool  # noqa: E402
from bagualu.vocabulary import FP8, KEEP, OFFLOAD, Op  # noqa: E402

try:
    from bagualu.planning.strategies import Strategies  # noqa: E402
except ImportError:  # a package from before it
    Strategies = None

ns = time.perf_counter_ns


def timed(fn: Callable[[int], Any], n: int) -> List[int]:
    """Nanoseconds of ``fn(i)`` for i in range(n), each call alone."""
    out = [0] * n
    gc.disable()
    try:
        for i in range(n):
            t0 = ns()
            fn(i)
            out[i] = ns() - t0
    finally:
        gc.enable()
    return out


class Bench:
    """The rooms of one runtime on the host backend, a strategy set per measurement."""

    def __init__(self, capacity: int, background: int, nbytes: int) -> None:
        self.cpu = torch.device("cpu")
        self.pool = DevicePool(capacity)
        self.memory = DeviceMemory(self.cpu, self.pool, None)
        # As install() makes it on CPU: copies on the training thread where the calibration
        # says they do not overlap compute (packages before issue 22 have no such option).
        kwargs = ({"sync_copies": True}
                  if "sync_copies" in inspect.signature(Enforcer).parameters else {})
        self.enforcer = Enforcer(self.cpu, capacity, borrowed_free_is_safe=False, **kwargs)
        self.op = Op("experts", "expert_linear", 0)
        self.consumer = Op("act", "expert_activation", 0)
        # The strategies as install() has them: bagualu's, a plan per micro-batch (packages
        # without planning/strategies.py: a function of the strategy set).
        self.plans = Strategies("bagualu") if Strategies is not None else None
        self._strategy = KEEP
        self.tracker = Tracker(self.memory, self.enforcer,
                               self.plans.of if self.plans is not None
                               else lambda op, mb: self._strategy)
        self.tracker.scope.append(self.op)
        # Records of other micro-batches, tracked while the measured ones come and go.
        self.background: List[Any] = []
        for mb in range(1, 4):
            self.tracker.begin_forward(100 + mb, capture=False)
            for _ in range(background // 3):
                self.background.append(self.tracker.pack(torch.empty(nbytes // 4)))
        self.tracker.begin_forward(0, capture=False)

    @property
    def strategy(self) -> str:
        return self._strategy

    @strategy.setter
    def strategy(self, strategy: str) -> None:
        """Every measured micro-batch's plan gives the measured operators ``strategy`` (the
        background micro-batches keep: no plan names them)."""
        self._strategy = strategy
        if self.plans is not None:
            self.plans.per_unit = {mb: {self.op.qualname: strategy,
                                        self.consumer.qualname: strategy} for mb in range(8)}

    def issuer(self) -> Any:
        """A PointIssuer over this enforcer's scheduler, whose stage graph has the measured
        operator at index 1 of 40."""
        from bagualu.enforce.order import PointIssuer, StageGraphIndex
        names = [f"L0.op{i}" for i in range(40)]
        names[1] = self.op.qualname
        index = StageGraphIndex({"operators": [{"name": n} for n in names], "tensors": []}, 1)
        return PointIssuer(self.enforcer.scheduler, index, lambda: None)

    @staticmethod
    def issue_order(stages: int) -> List[Dict[str, Any]]:
        """A point's order of ``stages`` stages per chain (F from operators 0, 10, ...; B from
        operators 39, 29, ... down), each with an O and an R piece of nothing to move."""
        out: List[Dict[str, Any]] = []
        for s in range(stages):
            out += [{"chain": "F", "stage": s, "round": 2 * s, "resource": "compute",
                     "first": 10 * s, "last": 10 * s + 9},
                    {"chain": "O", "stage": s, "round": 2 * s, "resource": "d2h"},
                    {"chain": "B", "stage": s, "round": 2 * s + 1, "resource": "compute",
                     "first": 39 - 10 * s, "last": 30 - 10 * s},
                    {"chain": "R", "stage": s, "round": 2 * s + 1, "resource": "h2d"}]
        return out

    def tensors(self, n: int, nbytes: int) -> List[torch.Tensor]:
        return [torch.empty(max(nbytes // 4, 1)).uniform_() for _ in range(n)]

    def run(self, n: int, nbytes: int, per_mb: int) -> Dict[str, List[int]]:
        """About ``n`` timed calls per row, in rounds of one micro-batch of ``per_mb`` saved
        storages each: its forward packs them, its backward unpacks them last first, then they
        are released (so the pools recycle their blocks, as in training)."""
        tr, enf = self.tracker, self.enforcer
        res: Dict[str, List[int]] = {}

        def row(name: str, fn: Callable[[int], Any], k: int) -> None:
            res.setdefault(name, []).extend(timed(fn, k))

        k = per_mb
        for r in range(max(n // k, 1)):
            mb = r % 8
            tr.begin_forward(mb, capture=False)
            row("timer (an empty call)", lambda i: None, k)
            # The allocator's pool (every record kept on the device holds a block).
            blocks: List[int] = [0] * k
            row("pool alloc", lambda i: blocks.__setitem__(i, self.pool.alloc(nbytes)), k)
            row("pool free", lambda i: self.pool.free(blocks[i], nbytes), k)

            # The enforcer alone: registration, offload, prefetch with nothing to issue.
            ts = self.tensors(k, nbytes)
            sts = [t.untyped_storage() for t in ts]
            hs = [0] * k
            row("Enforcer.register", lambda i: hs.__setitem__(
                i, enf.register(sts[i], torch.float32, 1, mb)), k)
            row("Enforcer.offload (includes its copy)", lambda i: enf.offload(hs[i]), k)
            enf.prefetch(mb)
            row("Enforcer.prefetch (reloads in flight at the bound)",
                lambda i: enf.prefetch(mb), k)
            row("Enforcer.retire", lambda i: enf.retire(hs[i]), k)
            # The FP8 cast alone (the host twin's kernel through one enforcer call), the
            # cast inside "pack, fp8" below.
            ts = self.tensors(k, nbytes)
            sts = [t.untyped_storage() for t in ts]
            timed(lambda i: hs.__setitem__(i, enf.register(sts[i], torch.float32, 1, mb)), k)
            row("Enforcer.store_fp8 (the cast alone)", lambda i: enf.store_fp8(hs[i]), k)
            timed(lambda i: enf.retire(hs[i]), k)
            del ts, sts

            # The hooks under keep: a new record per storage, a second view of it, unpack,
            # release.
            self.strategy = KEEP
            ts = self.tensors(k, nbytes)
            views = [t.view(-1)[: t.numel()] for t in ts]
            packed: List[Any] = [None] * k
            packed2: List[Any] = [None] * k
            row("pack, keep (new record)", lambda i: packed.__setitem__(i, tr.pack(ts[i])), k)
            tr.scope.append(self.consumer)
            row("pack, keep (a view of a packed storage)",
                lambda i: packed2.__setitem__(i, tr.pack(views[i])), k)
            tr.scope.pop()
            row("unpack, kept", lambda i: tr.unpack(packed[k - 1 - i]), k)
            # The same unpacks in the backward of a point's unit: each tells the issue order
            # (the first, untimed, passes the order's backward stages).
            issuer = self.issuer()
            issuer.begin(self.issue_order(4), mb, mb, -1, -1)
            tr.set_issuer(issuer)
            tr.unpack(packed[k - 1])
            row("unpack, kept, told to the point's issue order",
                lambda i: tr.unpack(packed[k - 1 - i]), k)
            issuer.finish()
            tr.set_issuer(None)
            del ts, views
            timed(lambda i: packed2.__setitem__(i, None), k)
            row("release (the last holder goes)", lambda i: packed.__setitem__(i, None), k)

            # Offload at pack time, reload at unpack (each with its copy), as the backward
            # needs them (last saved first); FP8 the same.
            for strategy, move, back in ((OFFLOAD, "pack, offload (includes the D2H copy)",
                                          "unpack, reload (includes the H2D copy)"),
                                         (FP8, "pack, fp8 (includes the cast)",
                                          "unpack, uncast (includes the cast back)")):
                self.strategy = strategy
                ts = self.tensors(k, nbytes)
                row(move, lambda i: packed.__setitem__(i, tr.pack(ts[i])), k)
                del ts
                tr.end_forward()
                tr.scope.append(self.op)
                tr.begin_backward(mb)
                row(back, lambda i: tr.unpack(packed[k - 1 - i]), k)
                row(f"release after {strategy}", lambda i: packed.__setitem__(k - 1 - i, None), k)
                tr.begin_forward(mb, capture=False)
            # The Python path's reload (Record.materialize: where the binding's unpack leaves
            # an acquire to retry after an eviction), and the release after it, whose block's
            # end is the binding's (_C.block_done) since 5d24ee3.
            self.strategy = OFFLOAD
            ts = self.tensors(k, nbytes)
            timed(lambda i: packed.__setitem__(i, tr.pack(ts[i])), k)
            del ts
            tr.end_forward()
            tr.scope.append(self.op)
            tr.begin_backward(mb)
            row("Record.materialize, reload (the Python path; includes the H2D copy)",
                lambda i: packed[k - 1 - i].rec.materialize(), k)
            timed(lambda i: tr.unpack(packed[k - 1 - i]), k)
            row("release after a reload by Record.materialize",
                lambda i: packed.__setitem__(k - 1 - i, None), k)
            tr.begin_forward(mb, capture=False)
            self.strategy = KEEP

            # A storage of at most the tracker's min_move_bytes under offload: counted in the
            # micro-batch's light set, never moved (packages before it give every storage a
            # record; that is the "pack, offload" row above).
            if hasattr(tr, "min_move_bytes"):
                self.strategy, tr.min_move_bytes = OFFLOAD, nbytes
                ts = self.tensors(k, nbytes)
                row("pack, offload at most min_move_bytes (counted, not moved)",
                    lambda i: packed.__setitem__(i, tr.pack(ts[i])), k)
                del ts
                timed(lambda i: packed.__setitem__(i, None), k)
                tr.drop_light(mb)  # as its backward's end does
                self.strategy, tr.min_move_bytes = KEEP, 0

            # The issue order (enforce/order.py's PointIssuer): loading a point's order, and
            # where compute is told at every operator call (forward_op) and every unpack
            # (backward_op) of the point's units, in the common case that passes no stage
            # (the first calls, untimed, pass the first stages).
            issuer = self.issuer()
            order = self.issue_order(4)
            row("issue order: load a point's order (16 items)",
                lambda i: issuer.begin(order, mb, mb, -1, -1), k)
            issuer.forward_op(mb, self.op)
            issuer.backward_op(mb, self.op)
            row("issue order: forward_op (no stage passed)",
                lambda i: issuer.forward_op(mb, self.op), k)
            row("issue order: backward_op (no stage passed)",
                lambda i: issuer.backward_op(mb, self.op), k)
            issuer.finish()

            # The copies themselves: torch's copy of the same bytes, between the round's fresh
            # tensors as the offloads copy them (each source once, each into its own
            # destination: what a move's copy costs), and of one pair again and again (both in
            # the caches: the floor).
            srcs, dsts = self.tensors(k, nbytes), self.tensors(k, nbytes)
            row("copy (torch, same bytes, fresh tensors)", lambda i: dsts[i].copy_(srcs[i]), k)
            del srcs, dsts
            src, dst = self.tensors(2, nbytes)
            row("copy (torch, same bytes)", lambda i: dst.copy_(src), k)
            # What torch alone spends when the last reference to a tensor of these bytes goes
            # (its storage freed): the floor under every "release" row above.
            frees: List[Any] = self.tensors(k, nbytes)
            row("free (torch, the last reference to a tensor of these bytes)",
                lambda i: frees.__setitem__(i, None), k)
        return res


def summary(times: List[int]) -> Dict[str, float]:
    s = sorted(times)
    return {"median_us": statistics.median(s) / 1e3,
            "p90_us": s[int(len(s) * 0.9)] / 1e3,
            "calls": len(s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000, help="calls timed per row and size")
    ap.add_argument("--bytes", type=int, default=64 << 10, help="bytes of each saved storage")
    ap.add_argument("--background", type=int, default=570,
                    help="records of other micro-batches tracked meanwhile")
    ap.add_argument("--per-micro-batch", type=int, default=190,
                    help="saved storages per micro-batch (one round of each row)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--against", default="",
                    help="integrations/pytorch of another version: run both alternately")
    ap.add_argument("--rounds", type=int, default=3, help="--against: processes per version")
    ap.add_argument("--against-lib-dir", default="",
                    help="--against: BGL_LIB_DIR of that version (its own build, where its "
                         "binding's interface differs from this one's); default: the same")
    ap.add_argument("--training", default="", metavar="MODEL",
                    help="the calls inside a training run of MODEL instead (qwen3_moe, mixtral)")
    ap.add_argument("--iterations", type=int, default=4, help="--training: iterations")
    ap.add_argument("--package", default="", help=argparse.SUPPRESS)  # read at import
    args = ap.parse_args()
    if args.against:
        return compare(args)
    if args.training:
        import hot_path_training
        res = hot_path_training.measure(_package_dir(), args.training, args.iterations)
        print("\n".join(hot_path_training.table(res)))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "results": {args.training: res}}, f, indent=1)
        return 0
    torch.set_num_threads(1)
    sizes = [args.bytes, 256]
    capacity = 1 << 31
    bench = Bench(capacity, args.background, args.bytes)
    results: Dict[str, Dict[str, Dict[str, float]]] = {}
    for nbytes in sizes:
        bench.run(args.per_micro_batch, nbytes, args.per_micro_batch)  # warm-up
        res = bench.run(args.calls, nbytes, args.per_micro_batch)
        results[str(nbytes)] = {k: summary(v) for k, v in res.items()}
    names = list(results[str(sizes[0])])
    head = " | ".join(f"{n} B median (p90) us" for n in sizes)
    print(f"| call | {head} |")
    print("| --- |" + " --- |" * len(sizes))
    for k in names:
        cells = " | ".join(f"{results[str(n)][k]['median_us']:.1f} "
                           f"({results[str(n)][k]['p90_us']:.1f})" for n in sizes)
        print(f"| {k} | {cells} |")
    print(f"({args.calls} calls per row, {args.background} background records, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


def compare(args: argparse.Namespace) -> int:
    """Runs this benchmark on ``args.against`` and on this package alternately, one process
    each per round, and prints both medians per row and their ratio."""
    import subprocess
    import tempfile
    versions = {"before": os.path.abspath(args.against), "now": os.path.abspath(OWN_PACKAGE)}
    if not os.path.isdir(os.path.join(versions["before"], "bagualu")):
        print(f"hot_path: --against {args.against}: no bagualu package there", file=sys.stderr)
        return 2
    runs: Dict[str, List[Dict[str, Any]]] = {k: [] for k in versions}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, pkg in versions.items():
                out = os.path.join(tmp, f"{name}-{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), "--package", pkg,
                       "--training", args.training, "--iterations", str(args.iterations),
                       "--calls", str(args.calls), "--bytes", str(args.bytes),
                       "--background", str(args.background),
                       "--per-micro-batch", str(args.per_micro_batch), "--json", out]
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                env = dict(os.environ)
                if name == "before" and args.against_lib_dir:
                    env["BGL_LIB_DIR"] = os.path.abspath(args.against_lib_dir)
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
                with open(out) as f:
                    runs[name].append(json.load(f)["results"])
    sizes = list(runs["now"][0])
    head = " | ".join(f"{n} B before | {n} B now | {n} B now/before" for n in sizes)
    print(f"| call (median us, range over rounds) | {head} |")
    print("| --- |" + " --- |" * (3 * len(sizes)))

    def cell(name: str, size: str, row: str) -> Tuple[float, str]:
        v = [run[size][row]["median_us"] for run in runs[name] if row in run[size]]
        if not v:
            return float("nan"), "-"
        m = statistics.median(v)
        return m, f"{m:.1f} ({min(v):.1f}-{max(v):.1f})"

    for row in runs["now"][0][sizes[0]]:
        cells = []
        for size in sizes:
            b, bs = cell("before", size, row)
            n, ns_ = cell("now", size, row)
            ratio = f"{n / b:.2f}x" if b == b and b > 0 else "-"
            cells += [bs, ns_, ratio]
        print(f"| {row} | " + " | ".join(cells) + " |")
    print(f"({args.rounds} alternating rounds of {args.calls} calls per row, "
          f"{args.background} background records, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
