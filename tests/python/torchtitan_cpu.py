"""The test harness that runs torchtitan 0.3.0 on a CPU-only machine (gloo), and the assets its
runs need; test-only: neither torchtitan nor bagualu has a CPU path for this.

    python torchtitan_cpu.py ASSETS [--spike-step N] [--measure] [--dynamo-counters]
                             [--force NAME=STRATEGY,...] [torchtitan.train arguments]
    python torchtitan_cpu.py --assets DIR                           # writes DIR's assets

The four adjustments (docs/torchtitan.md, "On CPU"), made in this process before torchtitan
builds anything, with no change to torchtitan's files:
- the device: torchtitan picks "cuda" when no accelerator is found and calls torch.cuda's memory
  functions; here it gets "cpu" and a small stand-in module for those calls (the memory figures
  in its log lines are this process's peak RSS);
- FSDP's gradient reduction: torchtitan asks for PREMUL_SUM with factor 1, which gloo lacks; a
  plain SUM is the same arithmetic (FSDP's force-sum option);
- attention: the default FlexAttention has no eager CPU backward and plain causal SDPA is refused
  by torchtitan's config helper: the helper returns causal SDPA;
- expert parallelism's token exchange: gloo's list all_to_all needs equal sizes; the runs pass
  ``--parallelism.spmd_backend partial_dtensor``, whose dispatcher uses all_to_all_single with
  uneven splits (no patch).
It also prints each step's loss in full (torchtitan's line rounds it), and with ``--spike-step
N`` makes step N a routing spike (``spike_routing``); ``--measure`` prints each step's time and
heap peak (``measure_steps``, for bench/python/torchtitan_ac.py); ``--dynamo-counters``
prints dynamo's counters once training ended (``print_dynamo_counters``: graphs, operations
captured, graph breaks; for ``--compile.enable``); ``--force`` forces bagualu's trainer's
plans (``force_strategies``). The assets: a byte-level
BPE tokenizer trained with the ``tokenizers`` package on text this module writes, and a local
JSON-lines dataset of that text (nothing is downloaded).
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import sys
import types
from pathlib import Path
from typing import Any, Callable, List

import torch

WORDS = ("expert router token layer memory plan offload recompute gradient batch pipeline "
         "stage rank device host tensor shard gather scatter attention norm residual "
         "the of and to in is that for on with as by at from this be are").split()


def write_assets(root: Path, vocab: int = 1024, rows: int = 400) -> None:
    """``root``/tokenizer (tokenizer.json, tokenizer_config.json) and ``root``/c4_test
    (data.json: {"text": ...} per line), deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import random
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 200))) + "."
             for _ in range(rows)]
    (root / "c4_test").mkdir(parents=True, exist_ok=True)
    with open(root / "c4_test" / "data.json", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|begin|>", "<|end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin|>", "eos_token": "<|end|>", "add_bos_token": True,
         "add_eos_token": True}))


class _Props:
    name = "cpu"
    total_memory = 64 << 30


def _cpu_module() -> types.ModuleType:
    """torch.cpu plus the torch.cuda calls torchtitan makes on its device module."""
    m = types.ModuleType("torchtitan_cpu_device")
    m.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})

    def memory_stats(device: Any = None) -> dict:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    m.set_device = lambda device: None
    m.current_device = lambda: 0
    m.device_count = lambda: 1
    m.get_device_name = lambda device=None: "cpu"
    m.get_device_properties = lambda device=None: _Props()
    m.memory_stats = memory_stats
    m.reset_peak_memory_stats = lambda device=None: None
    m.empty_cache = lambda: None
    m.synchronize = lambda device=None: None
    m.memory = types.SimpleNamespace(memory_stats=memory_stats)
    return m


def patch() -> None:
    """The adjustments above; before any torchtitan module is imported."""
    import torch._utils as tu
    real_type, real_module = tu._get_available_device_type, tu._get_device_module
    cpu = _cpu_module()
    tu._get_available_device_type = lambda: "cpu"
    tu._get_device_module = lambda t="cpu": cpu if t == "cpu" else real_module(t)
    try:
        import torchtitan.tools.utils  # noqa: F401  (reads the device type once)
    finally:
        tu._get_available_device_type, tu._get_device_module = real_type, real_module
    from torchtitan.distributed import fsdp
    real_disable = fsdp.disable_fsdp_gradient_division

    def disable_division(model: Any) -> Any:
        out = real_disable(model)
        from torch.distributed.fsdp import FSDPModule
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return out

    fsdp.disable_fsdp_gradient_division = disable_division
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(mod, "disable_fsdp_gradient_division",
                                                     None) is real_disable:
            mod.disable_fsdp_gradient_division = disable_division
    from torchtitan.models.common import attention, config_utils
    real_attention = config_utils.get_attention_config

    def attention_config(backend: str) -> Any:
        if backend in ("flex", "sdpa"):
            return attention.ScaledDotProductAttention.Config()
        return real_attention(backend)

    config_utils.get_attention_config = attention_config
    for name, mod in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(mod, "get_attention_config",
                                                     None) is real_attention:
            mod.get_attention_config = attention_config


def print_exact_losses() -> None:
    """Each rank prints every step's loss in full ('HARNESS rank R step S loss L grad_norm G'):
    torchtitan's own line rounds to 5 decimals."""
    from torchtitan.components import metrics
    real_log = metrics.MetricsProcessor.log

    def log(self: Any, step: int, global_avg_loss: float, global_max_loss: float,
            grad_norm: float, *args: Any, **kwargs: Any) -> Any:
        print(f"HARNESS rank {os.environ.get('RANK', '0')} step {step} loss "
              f"{float(global_avg_loss)!r} grad_norm {float(grad_norm)!r}", flush=True)
        return real_log(self, step, global_avg_loss, global_max_loss, grad_norm, *args,
                        **kwargs)

    metrics.MetricsProcessor.log = log


def spike_routing(step: int) -> None:
    """Step ``step`` of every run in this process is a routing spike: before its forward the
    harness adds 100 to the load-balancing bias (``expert_bias_E``, which torchtitan's router
    adds to the scores it picks experts by, not to the gate weights) of the upper half of
    each MoE layer's experts, so every token routes to them: under expert parallelism 2 all
    tokens go to EP rank 1's experts (load 2 there, 0 on rank 0). The bias is the model's own
    buffer and the same in torchtitan's run and bagualu's, so their losses stay comparable."""
    from torch.distributed.tensor import DTensor
    from torchtitan import trainer
    real_step = trainer.Trainer.train_step

    def train_step(self: Any, data_iterator: Any) -> Any:
        if self.step == step:
            with torch.no_grad():
                for part in self.model_parts:
                    for m in part.modules():
                        bias = getattr(m, "expert_bias_E", None)
                        if isinstance(bias, torch.Tensor):
                            local = bias.to_local() if isinstance(bias, DTensor) else bias
                            local[local.shape[0] // 2:] += 100.0
        return real_step(self, data_iterator)

    trainer.Trainer.train_step = train_step


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks",
                                               "keepcost")]


def heap_in_use() -> Callable[[], int]:
    """glibc's bytes in use by malloc (mallinfo2: small blocks + mmapped chunks), where
    PyTorch's CPU tensors live; bagualu's own pools are mappings of their own, not counted."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _Mallinfo2

    def in_use() -> int:
        m = libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)
    return in_use


PERIOD_S = float(os.environ.get("BGL_HARNESS_PERIOD_S", "0.005"))


def measure_steps(cuda: bool = False) -> None:
    """Each step prints 'HARNESS rank R step S ms T heap_peak B': the step's wall time and,
    on the last step only, the high-water mark of the heap during its forwards and backwards
    (not the optimizer's step, whose temporaries are the same under every policy) above its
    level at each forward's start, sampled every 5 ms by a thread (no dispatch mode, so
    compiled blocks run as they would): the activations and temporaries PyTorch allocates,
    whatever keeps or recomputes them (the gradients are kept allocated between steps, zeroed
    instead of freed, so they are in the base from the second step on). The sampling (mallinfo2 walks malloc's free
    lists under its lock) slows the step it samples several times over, so only the last step
    is sampled and only the others are timed. ``cuda`` (tests/gpu): the device's allocated
    bytes instead (the CUDA allocator's peak over the whole step, reset at its start, every
    step; no thread samples)."""
    import threading
    import time
    from torchtitan import trainer
    in_use = heap_in_use() if not cuda else torch.cuda.memory_allocated
    real_step = trainer.Trainer.train_step
    real_fb = trainer.Trainer.forward_backward_step
    real_pp = trainer.Trainer.pp_forward_backward_step
    peak = [0]

    def sampled(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if cuda or self.step != self.config.training.steps:
                return real(self, *args, **kwargs)
            base = in_use()
            high = [base]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    high[0] = max(high[0], in_use())
                    done.wait(PERIOD_S)

            th = threading.Thread(target=sample, daemon=True)
            th.start()
            try:
                return real(self, *args, **kwargs)
            finally:
                done.set()
                th.join()
                peak[0] = max(peak[0], high[0] - base)
        return call

    def train_step(self: Any, data_iterator: Any) -> Any:
        peak[0] = 0
        if not getattr(self.optimizers, "_bgl_keeps_grads", False):
            # The gradients stay allocated between steps (zeroed, not freed: the same sums),
            # so that a step's heap growth is its activations and temporaries.
            real_zero = self.optimizers.zero_grad
            self.optimizers.zero_grad = lambda *a, **k: real_zero(set_to_none=False)
            self.optimizers._bgl_keeps_grads = True
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = in_use()
        t0 = time.perf_counter()
        try:
            return real_step(self, data_iterator)
        finally:
            if cuda:
                torch.cuda.synchronize()
                peak[0] = torch.cuda.max_memory_allocated() - base
            ms = (time.perf_counter() - t0) * 1e3
            print(f"HARNESS rank {os.environ.get('RANK', '0')} step {self.step} ms {ms:.1f} "
                  f"heap_peak {peak[0]}", flush=True)

    trainer.Trainer.train_step = train_step
    trainer.Trainer.forward_backward_step = sampled(real_fb)
    trainer.Trainer.pp_forward_backward_step = sampled(real_pp)


def print_dynamo_counters() -> None:
    """Each rank prints, after training: 'HARNESS rank R dynamo graphs G ops O breaks B
    reasons [...]' from ``torch._dynamo.utils.counters``: the graphs dynamo made in this
    process (a recompile makes one more), the operations captured in them, the graph breaks
    and their reasons (sorted)."""
    from torch._dynamo.utils import counters
    breaks = counters["graph_break"]
    print(f"HARNESS rank {os.environ.get('RANK', '0')} dynamo graphs "
          f"{counters['stats']['unique_graphs']} ops {counters['stats']['calls_captured']} "
          f"breaks {sum(breaks.values())} reasons {sorted(breaks)!r}", flush=True)


def force_strategies(spec: str) -> None:
    """bagualu's trainer forces ``spec`` ('NAME=STRATEGY,...', bagualu.force_strategies) on
    every plan from its install on (the capture included)."""
    forced = dict(item.split("=", 1) for item in spec.split(","))
    from bagualu.loops import torchtitan as tt
    real = tt.BagualuTrainer.init_distributed

    def init_distributed(self: Any) -> Any:
        out = real(self)
        import bagualu
        bagualu.force_strategies(forced)
        return out

    tt.BagualuTrainer.init_distributed = init_distributed


def main(argv: List[str]) -> int:
    if argv[:1] == ["--assets"]:
        write_assets(Path(argv[1]))
        return 0
    assets, args = Path(argv[0]), argv[1:]
    spike = None
    if args[:1] == ["--spike-step"]:
        spike, args = int(args[1]), args[2:]
    measure = args[:1] == ["--measure"]
    if measure:
        args = args[1:]
    dynamo = args[:1] == ["--dynamo-counters"]
    if dynamo:
        args = args[1:]
    force = None
    if args[:1] == ["--force"]:
        force, args = args[1], args[2:]
    torch.set_num_threads(1)
    patch()
    print_exact_losses()
    if spike is not None:
        spike_routing(spike)
    if measure:
        measure_steps()
    if force is not None:
        force_strategies(force)
    train_on(assets, args)
    if dynamo:
        print_dynamo_counters()
    return 0


def train_on(assets: Path, args: List[str]) -> None:
    """torchtitan's own ``torchtitan.train`` on the test's tokenizer and dataset in
    ``assets``, with ``args``. The assets' flags go first: tyro takes what follows a subcommand
    (activation-checkpoint:none) as that subcommand's."""
    sys.argv = [sys.argv[0], "--hf_assets_path", str(assets / "tokenizer"),
                "--dataloader.dataset_path", str(assets / "c4_test"), *args]
    from torchtitan.train import main as train
    train()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
