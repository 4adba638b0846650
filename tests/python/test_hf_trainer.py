"""bagualu in Hugging Face's Trainer (``bagualu.trainer_callback``, bagualu/loops/hf_trainer.py):
an unmodified transformers MoE model from a small config (examples/unmodified.py) trained by an
unmodified ``transformers.Trainer`` with gradient accumulation, at half of keep-all's peak on
the simulated device, against the same Trainer run without bagualu; and what is refused."""
from __future__ import annotations

import types
from typing import Any, Dict, List, Optional

import pytest
import torch

import bagualu
from conftest import require_libs

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
unmodified = pytest.importorskip("unmodified")

BATCH, SEQ = 2, 32


def dataset(n: int, seed: int = 1) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, 128, (SEQ,), generator=g) for _ in range(n)]
    return [{"input_ids": t, "labels": t} for t in rows]


class LossTrainer(transformers.Trainer):
    """The Trainer as it is, keeping each micro-batch's loss (what training_step returns)."""

    losses: List[float]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(loss.item())
        return loss


class ExactPeak(transformers.TrainerCallback):
    """After bagualu's callback set up: every saved storage its own block of the simulated
    device (no light capture's coarse blocks), so keep-all's peak is exact."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        bagualu.force_strategies({})


def train(tmp_path, callbacks: Optional[list] = None, name: str = "qwen3_moe",
          accumulation: int = 2, micro_batches: int = 5, evaluate: bool = False,
          **args: Any) -> Dict[str, Any]:
    """One Trainer run over ``micro_batches`` batches (one epoch; steps of ``accumulation``,
    the last one shorter where it does not divide): the losses, the final weights, and
    whether bagualu ran out of memory."""
    model = unmodified.build(name, seed=0)
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accumulation, num_train_epochs=1, learning_rate=1e-3,
        logging_strategy="no", save_strategy="no", report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, eval_strategy="steps" if evaluate else "no", eval_steps=1,
        per_device_eval_batch_size=BATCH, **args)
    trainer = LossTrainer(model=model, args=targs,
                          train_dataset=dataset(micro_batches * BATCH),
                          eval_dataset=dataset(2 * BATCH, seed=2) if evaluate else None,
                          callbacks=callbacks)
    trainer.losses = []
    out: Dict[str, Any] = {"oom": None}
    try:
        trainer.train()
    except bagualu.OutOfMemoryError as e:
        out["oom"] = str(e)
    out["losses"] = trainer.losses
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["model"] = model
    return out


def callback(capacity: Any, policy: str = "bagualu") -> Any:
    return bagualu.trainer_callback(capacity, policy, governor="none", log_iterations=False,
                                    allow_fp8=False, device="cpu")  # FP8 off: bit for bit


def refusing() -> Any:
    """A callback to ask what it refuses (nothing installed until the Trainer trains)."""
    return bagualu.trainer_callback("1GiB", governor="none", device="cpu")


def assert_same_training(ref: Dict[str, Any], got: Dict[str, Any], what: str) -> None:
    assert got["oom"] is None, f"{what}: {got['oom']}"
    assert got["losses"] == ref["losses"], f"{what}: losses differ"
    assert sorted(got["weights"]) == sorted(ref["weights"])
    for n, w in ref["weights"].items():
        assert torch.equal(w, got["weights"][n]), f"{what}: {n} differs after training"


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_half_of_the_keep_all_peak(name: str, tmp_path) -> None:
    """Three optimizer steps of 2, 2 and 1 micro-batches (the epoch's short last step): at half
    of keep-all's peak keep-all runs out of memory, and bagualu finishes, moving activations,
    with the losses and weights of the same Trainer run without bagualu, bit for bit."""
    require_libs()
    plain = train(tmp_path, name=name)
    assert len(plain["losses"]) == 5
    room = callback("4GiB", "keep-all")
    full = train(tmp_path, [room, ExactPeak()], name=name)
    assert_same_training(plain, full, "keep-all with room")
    assert len(room.history) == 3  # one iteration per optimizer step
    peak = max(line["peak_bytes"] for line in room.history)
    cap = peak // 2
    keep = train(tmp_path, [callback(cap, "keep-all")], name=name)
    assert keep["oom"] is not None, "keep-all must run out of memory at half its peak"
    cb = callback(cap)
    r = train(tmp_path, [cb], name=name)
    assert_same_training(plain, r, f"bagualu at half of keep-all's peak ({cap} bytes)")
    assert len(cb.history) == 3 and all(line["ooms"] == 0 for line in cb.history)
    assert max(line["peak_bytes"] for line in cb.history) <= cap
    moved = sum(line["offloads"] + line["recomputed_ops"] for line in cb.history) + \
        cb.stats["tracker"]["drops"]
    assert moved > 0, "the plans must move something"
    assert sum(line["fp8_casts"] for line in cb.history) == 0
    with pytest.raises(bagualu.BagualuError):
        bagualu.current()  # uninstalled at the end of train()
    assert "forward" not in vars(r["model"])  # the model's own forward again


def test_a_gradient_accumulation_of_one_with_evaluation(tmp_path) -> None:
    """gradient_accumulation_steps=1: every micro-batch is its own step (and iteration); the
    evaluation after each step runs the model without gradients, unplanned; bit for bit the
    run without bagualu, at the capacity of the test above."""
    require_libs()
    plain = train(tmp_path, accumulation=1, micro_batches=3, evaluate=True)
    room = callback("4GiB", "keep-all")
    train(tmp_path, [room, ExactPeak()], accumulation=1, micro_batches=3)
    cap = max(line["peak_bytes"] for line in room.history) // 2
    cb = callback(cap)
    r = train(tmp_path, [cb], accumulation=1, micro_batches=3, evaluate=True)
    assert_same_training(plain, r, "one micro-batch per step")
    assert len(cb.history) == 3
    assert sum(line["offloads"] + line["recomputed_ops"] for line in cb.history) > 0


def test_deepspeed_is_refused(tmp_path, monkeypatch) -> None:
    """DeepSpeed (TrainingArguments(deepspeed=...), which needs the deepspeed package to be
    built, or `accelerate launch --use_deepspeed`) is refused when the Trainer is made,
    naming what to use instead."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none")
    cb = refusing()
    cb.on_init_end(args, None, None)  # nothing to refuse
    args.deepspeed = "ds_config.json"
    with pytest.raises(bagualu.BagualuError, match="DeepSpeed is not supported") as e:
        cb.on_init_end(args, None, None)
    assert "bagualu.accumulate_gradients" in str(e.value) and "DDP" in str(e.value)
    args.deepspeed = None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(bagualu.BagualuError, match="DeepSpeed is not supported"):
        cb.on_init_end(args, None, None)


@pytest.mark.parametrize("version", [1, 2])
def test_fsdp_is_refused(version: int, tmp_path, monkeypatch) -> None:
    """accelerate's FSDP plugin (TrainingArguments(fsdp=True), FSDP2 by default, FSDP1 with
    fsdp_config version 1; or `accelerate launch --use_fsdp`): refused, naming bagualu's own
    loop on fully_shard, torchtitan and DDP. (On CPU the Trainer itself refuses FSDP in one
    process before its callbacks run, so the check is called as the Trainer calls it.)"""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none", fsdp=True,
                                          fsdp_config={"version": version})
    cb = refusing()
    with pytest.raises(bagualu.BagualuError, match="FSDP plugin is not supported") as e:
        cb.on_init_end(args, None, None)
    assert "fully_shard, then bagualu.accumulate_gradients" in str(e.value)
    assert "--module bagualu.torchtitan" in str(e.value)
    plain = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                           report_to="none")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(bagualu.BagualuError, match="FSDP plugin is not supported"):
        cb.on_init_end(plain, None, None)


def test_whole_model_compile_and_data_parallel_are_refused(tmp_path, monkeypatch) -> None:
    """torch_compile=True: refused, naming per-block compile; nn.DataParallel (several GPUs in
    one process): refused, naming one process per GPU."""
    # TrainingArguments(torch_compile=True) sets accelerate's dynamo variables for the process
    # (a later Trainer would compile its model): the monkeypatch takes them back.
    for var in ("ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE"):
        monkeypatch.setenv(var, "")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                          report_to="none", torch_compile=True)
    with pytest.raises(bagualu.BagualuError, match="torch_compile=True") as e:
        refusing().on_init_end(args, None, None)
    assert "block.compile()" in str(e.value)
    dp = types.SimpleNamespace(deepspeed=None, fsdp=None, fsdp_plugin_args=None,
                               torch_compile=False, n_gpu=2)
    with pytest.raises(bagualu.BagualuError, match="one process per GPU"):
        refusing().on_init_end(dp, None, None)


def test_bad_arguments_fail_when_the_callback_is_made(tmp_path) -> None:
    with pytest.raises(bagualu.PolicyError, match="unknown policy"):
        bagualu.trainer_callback("1GiB", "keep-some")
    with pytest.raises(ValueError, match="capacity"):
        bagualu.trainer_callback("lots")
    with pytest.raises(bagualu.BagualuError, match="gradient_accumulation_steps"):
        bagualu.trainer_callback("1GiB", micro_batches=4, device="cpu")
    cb = bagualu.trainer_callback("1GiB", device="cpu")
    assert isinstance(cb, transformers.TrainerCallback)
    if not torch.cuda.is_available():  # made for CUDA (it would swap the allocator there)
        args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                              report_to="none")
        with pytest.raises(bagualu.BagualuError, match="made for device cuda.* trains on cpu"):
            bagualu.trainer_callback("1GiB", device="cuda").on_train_begin(
                args, None, None, model=unmodified.build("qwen3_moe"))
