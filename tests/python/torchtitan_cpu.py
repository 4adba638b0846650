"""The test harness that runs torchtitan 0.3.0 on a CPU-only machine (gloo), and the assets its
runs need; test-only: neither torchtitan nor bagualu has a CPU path for this.

    python torchtitan_cpu.py ASSETS [torchtitan.train arguments]   # one rank (under torchrun)
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
It also prints each step's loss in full (torchtitan's line rounds it). The assets: a byte-level BPE tokenizer trained with the ``tokenizers`` package on text this
module writes, and a local JSON-lines dataset of that text (nothing is downloaded).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import types
from pathlib import Path
from typing import Any, List

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


def main(argv: List[str]) -> int:
    if argv[:1] == ["--assets"]:
        write_assets(Path(argv[1]))
        return 0
    assets, args = Path(argv[0]), argv[1:]
    torch.set_num_threads(1)
    patch()
    print_exact_losses()
    # The assets' flags first: tyro takes what follows a subcommand
    # (activation-checkpoint:none) as that subcommand's.
    sys.argv = [sys.argv[0], "--hf_assets_path", str(assets / "tokenizer"),
                "--dataloader.dataset_path", str(assets / "c4_test"), *args]
    from torchtitan.train import main as train
    train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
