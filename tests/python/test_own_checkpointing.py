"""A model that checkpoints its own blocks (issue 20 item 4): transformers' Qwen3-MoE from a tiny
config with Hugging Face's gradient checkpointing, with torch's checkpoint_wrapper around every
decoder layer (torchtitan's activation checkpointing), and with torch.utils.checkpoint called in
the blocks' forward. bagualu says at instrument that the model checkpoints itself (where it can
tell), and after the capture how many saved tensors the model's checkpointing hid and what it
would plan without it; the count is the number of tensors the same blocks save without
checkpointing, counted here by a hook of the test's own; training gives the gradients of the
same checkpointed model without bagualu, bit for bit."""
from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

import bagualu
from bagualu.capture import foreign
from conftest import assert_grads, require_libs

unmodified = pytest.importorskip("unmodified")
pytest.importorskip("transformers")

FORMS = ("hf", "checkpoint_wrapper", "forward")
MICRO_BATCHES = 2


def build(form: str) -> torch.nn.Module:
    model = unmodified.build("qwen3_moe")
    if form == "hf":
        model.gradient_checkpointing_enable()
    elif form == "checkpoint_wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import \
            checkpoint_wrapper
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
    elif form == "forward":
        unmodified._checkpoint_blocks(model)  # torch.utils.checkpoint inside each forward
    return model


def train(model: torch.nn.Module, with_bagualu: bool) -> Dict[str, torch.Tensor]:
    xs = unmodified.batches(MICRO_BATCHES)

    def loss_of(mb: int) -> torch.Tensor:
        return unmodified.loss_of(model, xs[mb]) / MICRO_BATCHES

    if with_bagualu:
        bagualu.accumulate_gradients(loss_of, MICRO_BATCHES)
    else:
        for mb in range(MICRO_BATCHES):
            loss_of(mb).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def saved_in_blocks() -> int:
    """Tensors the blocks of the model without checkpointing save in one forward (parameters
    left out), counted by a saved-tensors hook of our own."""
    model = unmodified.build("qwen3_moe")
    inside = [0]
    count = [0]
    for b in model.model.layers:
        b.register_forward_pre_hook(lambda m, a: inside.__setitem__(0, inside[0] + 1))
        b.register_forward_hook(lambda m, a, o: inside.__setitem__(0, inside[0] - 1))

    def pack(t: torch.Tensor) -> Any:
        if inside[0] and t.numel() > 0 and not isinstance(t, torch.nn.Parameter) \
                and not isinstance(t._base, torch.nn.Parameter):
            count[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unmodified.loss_of(model, unmodified.batches(1)[0])
    return count[0]


@pytest.mark.parametrize("form", FORMS)
def test_the_models_own_checkpointing_is_reported_and_trains(form: str, caplog) -> None:
    require_libs()
    expected = saved_in_blocks()
    assert expected > 50, expected
    plain = train(build(form), with_bagualu=False)
    model = build(form)
    bagualu.install(capacity="64MiB", policy="bagualu", governor="none", pipeline_stages=1,
                    micro_batches=MICRO_BATCHES, log_iterations=False,
                    allow_fp8=False)  # gradients compared bitwise
    with caplog.at_level("WARNING", logger="bagualu"):
        bagualu.instrument(model)
        at_instrument = caplog.text
        got = train(model, with_bagualu=True)
    if form != "forward":  # a checkpoint call inside forward() shows only when it runs
        assert "the model checkpoints its own blocks" in at_instrument, at_instrument
    after = caplog.text[len(at_instrument):]
    if foreign._top_hooks is None:  # torch 2.6: nothing is counted, and instrument says so
        assert after.count("hides") == 0, after
        if form != "forward":
            assert "cannot count the tensors the model's own checkpointing hides" in at_instrument
    else:
        assert f"hides {expected} of the tensors its planned layers save" in after, after
        assert "Without it bagualu would plan" in after
        assert after.count("hides") == 1, "said more than once"
    assert_grads(plain, got, sum(1 for p in model.parameters() if p.requires_grad),
                 what=f"{form} with bagualu")
