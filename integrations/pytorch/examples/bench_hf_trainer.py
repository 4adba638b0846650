"""bagualu in Hugging Face's Trainer (``bagualu.trainer_callback``) against what Trainer users have
today: transformers' activation checkpointing with its offload
(``TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"offload":
True})``: ``save_on_cpu`` around each checkpointed layer), the same without offload, and plain;
one unmodified transformers MoE model (examples/unmodified.py), every expert computed here.

    python bench_hf_trainer.py --model qwen3_moe --width 4 --seq 128 --steps 6 \\
        --accumulation 4 --repeats 3

What runs: keep-all with room under bagualu (nothing moved, every saved storage its own block:
keep-all's exact activation peak), the capacity ``--fraction`` (0.5) of it, keep-all at that
capacity (it runs out of memory), then ``--repeats`` rounds of plain, checkpointing,
checkpointing with offload and bagualu at the capacity, in turn (a drift of the machine's speed
over minutes spreads over every variant). Per variant: the steady time per optimizer step (each
run's median over steps ``--warmup``.., then the median and range over runs) and two peaks:

- *activations on the device*: bagualu's simulated device (bagualu and keep-all: what the
  capacity holds);
- *step peak of PyTorch tensors*: one more run of each variant under a dispatch mode that counts
  every tensor storage an operator makes until it dies: the most bytes alive during an optimizer
  step above what was alive when it began (activations, gradients, temporaries; parameters and
  optimizer state excluded), the largest over the steps after the first; and the same less the
  gradients' bytes (with accumulation every gradient is alive from the first micro-batch's
  backward on), which leaves activations and temporaries. Host copies are not
  counted: bagualu's go to the enforcer's pinned pool; on a machine without CUDA transformers'
  offload copies CPU tensors into CPU tensors, so this run (only this one: the times are
  transformers' own code) replaces its ``save_on_cpu`` with a stand-in that keeps the copies
  in NumPy arrays, outside PyTorch's allocator, as pinned host memory is outside the device's.

``--device cuda``: the same on a GPU (bagualu's capacity is then the GPU's activation budget,
and the step peak is still the counted tensors').
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import statistics
import sys
import tempfile
import time
import weakref
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import bagualu
import unmodified as u

VARIANTS = ("plain", "checkpointing", "checkpointing + offload", "bagualu")


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage an operator returns until the storage dies."""

    def __init__(self) -> None:
        super().__init__()
        self.live: Dict[int, int] = {}
        self.now = 0
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._see(t)
        return out

    def _see(self, t: torch.Tensor) -> None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0 or ptr in self.live:
            return
        self.live[ptr] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(st, self._gone, ptr, n)

    def _gone(self, ptr: int, n: int) -> None:
        if self.live.get(ptr) == n:
            del self.live[ptr]
            self.now -= n


def numpy_save_on_cpu(pin_memory: bool = False, device_type: str = "cuda") -> Any:
    """``save_on_cpu`` for a machine without CUDA: each saved tensor copied into a NumPy array
    (host memory outside PyTorch's allocator) and copied back when the backward needs it."""
    def pack(t: torch.Tensor) -> Any:
        a = t.detach().contiguous()
        return t.dtype, t.shape, a.view(torch.uint8).numpy().copy() if a.numel() else None

    def unpack(packed: Any) -> torch.Tensor:
        dtype, shape, arr = packed
        if arr is None:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(arr).view(dtype).view(shape).clone()

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class Steps:
    """A TrainerCallback (made by ``steps_callback``): each optimizer step's wall time, and with
    ``live`` the counted bytes' peak of each step above its start."""

    def __init__(self, device: str, live: Optional[LiveBytes]) -> None:
        self.device, self.live = device, live
        self.ms: List[float] = []
        self.cpu_ms: List[float] = []
        self.peaks: List[int] = []
        self._t0 = self._c0 = 0.0
        self._base = 0

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def on_train_begin(self, *a: Any, **k: Any) -> None:
        if self.live is not None:
            self.live.__enter__()

    def on_train_end(self, *a: Any, **k: Any) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def on_step_begin(self, *a: Any, **k: Any) -> None:
        self._sync()
        if self.live is not None:
            self._base = self.live.now
            self.live.peak = self.live.now
        self._t0, self._c0 = time.perf_counter(), time.process_time()

    def on_step_end(self, *a: Any, **k: Any) -> None:
        self._sync()
        self.ms.append((time.perf_counter() - self._t0) * 1e3)
        self.cpu_ms.append((time.process_time() - self._c0) * 1e3)
        if self.live is not None:
            self.peaks.append(self.live.peak - self._base)


def steps_callback(device: str, live: Optional[LiveBytes]) -> Any:
    import transformers
    cls = type("StepsCallback", (Steps, transformers.TrainerCallback), {})
    return cls(device, live)


class ExactPeak:
    """Every saved storage its own block of the simulated device (keep-all's exact peak)."""

    def on_train_begin(self, *a: Any, **k: Any) -> None:
        bagualu.force_strategies({})


def dataset(n: int, seq: int, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 128, (seq,), generator=g) for _ in range(n)]
    return [{"input_ids": t, "labels": t} for t in rows]


def run(a: argparse.Namespace, variant: str, capacity: Any = None, measure: bool = False,
        policy: str = "bagualu", exact: bool = False) -> Dict[str, Any]:
    """One Trainer run of ``variant`` (``capacity`` and ``policy``: bagualu's); its step times
    (and with ``measure`` the counted peaks), bagualu's lines, or its out-of-memory message."""
    import transformers
    gc.collect()
    model = u.build(a.model, seed=0, width=a.width)
    ckpt = variant.startswith("checkpointing")
    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="bench_hf_"), per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accumulation, max_steps=a.steps, learning_rate=1e-4,
        logging_strategy="no", save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        use_cpu=a.device == "cpu", activation_checkpointing=ckpt,
        activation_checkpointing_kwargs={"offload": True} if variant.endswith("offload")
        else None)
    steps = steps_callback(a.device, LiveBytes() if measure else None)
    callbacks: List[Any] = []
    bgl = None
    if variant == "bagualu":
        bgl = bagualu.trainer_callback(capacity, policy, governor=a.governor,
                                       log_iterations=False, device=a.device)
        callbacks.append(bgl)
        if exact:
            import transformers as tf
            callbacks.append(type("Exact", (ExactPeak, tf.TrainerCallback), {})())
    callbacks.append(steps)
    trainer = transformers.Trainer(model=model, args=targs,
                                   train_dataset=dataset(a.steps * a.accumulation * a.batch,
                                                         a.seq),
                                   callbacks=callbacks)
    trainer.remove_callback(transformers.PrinterCallback)  # its line of metrics per run
    patch = contextlib.nullcontext()
    if measure and variant.endswith("offload") and not torch.cuda.is_available():
        import transformers.modeling_utils as mu
        patch = _patched(mu, "save_on_cpu", numpy_save_on_cpu)
    out: Dict[str, Any] = {"oom": None}
    try:
        with patch:
            trainer.train()
    except bagualu.OutOfMemoryError as e:
        out["oom"] = str(e).splitlines()[0]
    out["ms"], out["cpu_ms"], out["peaks"] = steps.ms, steps.cpu_ms, steps.peaks
    out["lines"] = bgl.history if bgl is not None else []
    out["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()
                            if p.requires_grad)
    return out


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Any:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_moe", choices=[m for m in u.MODELS
                                                             if m != "fused"])
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2, help="per-device batch (one micro-batch)")
    ap.add_argument("--accumulation", type=int, default=4, help="gradient_accumulation_steps")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the steady time")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.5, help="capacity: this x keep-all's peak")
    ap.add_argument("--governor", default="none")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    if not 0 < a.warmup < a.steps:
        print(f"bench_hf_trainer: --warmup {a.warmup} must be in 1..--steps-1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    import logging
    import transformers
    transformers.logging.set_verbosity_error()
    logging.getLogger("bagualu").setLevel(logging.ERROR)
    print(f"# bench_hf_trainer {' '.join(sys.argv[1:])}  ({datetime.date.today()}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}, {a.device})")
    room = run(a, "bagualu", "8GiB", policy="keep-all", exact=True)
    peak = max(line["peak_bytes"] for line in room["lines"])
    cap = int(peak * a.fraction)
    keep = run(a, "bagualu", cap, policy="keep-all")
    print(f"{a.model} width {a.width}, {a.batch} x {a.seq} tokens per micro-batch, "
          f"{a.accumulation} micro-batches per step: keep-all's activation peak {mib(peak)}, "
          f"capacity {mib(cap)} ({a.fraction:g} of it); keep-all there: "
          + (f"out of memory ({keep['oom'][:90]}...)" if keep["oom"] else "fits"), flush=True)
    wall: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    cpu: Dict[str, List[float]] = {v: [] for v in VARIANTS}
    lines: List[Dict[str, Any]] = []
    for _ in range(a.repeats):
        for v in VARIANTS:
            r = run(a, v, cap)
            if r["oom"]:
                print(f"{v}: out of memory: {r['oom']}")
                return 1
            wall[v].append(statistics.median(r["ms"][a.warmup:]))
            cpu[v].append(statistics.median(r["cpu_ms"][a.warmup:]))
            lines = r["lines"] or lines
    peaks: Dict[str, int] = {}
    grads = 0
    for v in VARIANTS:
        r = run(a, v, cap, measure=True)
        peaks[v], grads = max(r["peaks"][1:]), r["grad_bytes"]

    def cell(t: List[float], base: List[float]) -> str:
        med = statistics.median(t)
        return (f"{med:.1f} ({min(t):.1f}-{max(t):.1f}), "
                f"{med / statistics.median(base):.2f}x")

    print(f"\n| variant | wall ms per step from step {a.warmup}, median (range) over "
          f"{a.repeats} runs, vs plain | CPU ms per step, the same | activations on the "
          "device, peak | step peak of PyTorch tensors | the same less the gradients |")
    print("| --- | --- | --- | --- | --- | --- |")
    for v in VARIANTS:
        dev = {"plain": f"{mib(peak)} (keep-all)",
               "bagualu": f"{mib(max(x['peak_bytes'] for x in lines))} (capacity {mib(cap)})"
               }.get(v, "not counted (its saves bypass bagualu)")
        print(f"| {v} | {cell(wall[v], wall['plain'])} | {cell(cpu[v], cpu['plain'])} | "
              f"{dev} | {mib(peaks[v])} | {mib(peaks[v] - grads)} |", flush=True)
    moved = {k: sum(x[k] for x in lines) for k in ("offloads", "recomputed_ops", "fp8_casts",
                                                   "evictions")}
    print(f"\nbagualu, last run: {moved} over {len(lines)} steps; strategies of the last step "
          f"{ {s: n for s, n in lines[-1]['strategies'].items() if n} }")
    return 0


if __name__ == "__main__":
    sys.exit(main())
