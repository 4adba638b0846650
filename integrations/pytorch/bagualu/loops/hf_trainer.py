"""bagualu in Hugging Face's ``Trainer``: one callback, ``bagualu.trainer_callback(...)``, that
installs bagualu, instruments the Trainer's model and runs every gradient-accumulation step's
micro-batches as bagualu's (docs/pytorch.md, "Hugging Face Trainer").

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[bagualu.trainer_callback(capacity="40GiB")])
    trainer.train()

Why a callback: it is the Trainer's own extension point, so the line works with the Trainer and
its subclasses (TRL's SFTTrainer, a user's own) and beside other callbacks, with no change of
class or loop. What the loop needs beyond the callback's events is done from them:

- constructed (before ``Trainer(...)`` moves the model to the GPU): on CUDA, libbgl_alloc.so
  becomes PyTorch's allocator (bagualu.install's rule: before the first CUDA allocation);
- ``on_init_end``: what bagualu cannot run under is refused (DeepSpeed, FSDP, whole-model
  ``torch_compile``, ``nn.DataParallel``), with what to use instead;
- ``on_train_begin`` (after accelerate prepared the model): ``bagualu.install`` with one
  pipeline stage and ``gradient_accumulation_steps`` micro-batches, ``bagualu.instrument`` of
  the model, and the model's ``forward`` wrapped: a forward with gradients inside a training
  step is the next micro-batch's ``mb.forward()`` (its step point, then bagualu's forward
  context; a Hugging Face model computes its loss inside it), and its backward context (step
  point, ``bagualu.backward``) opens when the forward returns;
- ``on_step_begin``: ``begin_iteration()``; ``on_substep_end`` (after each micro-batch's
  backward) closes that micro-batch's backward; ``on_pre_optimizer_step`` (after the last one)
  closes it and ends the iteration (its line is in ``callback.history``);
- ``on_train_end``: the model's forward restored, ``callback.stats`` kept, bagualu uninstalled.

A step may hold fewer micro-batches than ``gradient_accumulation_steps`` (the Trainer's last
step of an epoch that does not divide evenly); more forwards with gradients than that in one
step, or a forward before the previous micro-batch's backward, raise ``BagualuError``.
Evaluation (no gradients, or outside a training step) runs the model unplanned.

Imports transformers only when ``trainer_callback`` is called. Not thread-safe: the Trainer's
training thread.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import torch

from .. import api as bagualu
from ..errors import BagualuError, InstallError
from ..installer import swap_cuda_allocator
from ..settings import check_issue_order, check_policy, parse_size
from .accumulate import MicroBatch, micro_batches

log = logging.getLogger("bagualu")

__all__ = ["trainer_callback", "refusal"]

WHAT = "bagualu.trainer_callback"
INSTEAD = ("bagualu's own gradient-accumulation loop on an FSDP2 model "
           "(fully_shard, then bagualu.accumulate_gradients: docs/pytorch.md, \"Data parallelism: "
           "FSDP2 and DDP\"), torchtitan with --module bagualu.torchtitan, or this Trainer under "
           "DDP (torchrun, one process per GPU, no FSDP or DeepSpeed config)")


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").strip().lower() in ("1", "true", "yes")


def refusal(args: Any) -> Optional[str]:
    """Why bagualu cannot run under the Trainer with these ``TrainingArguments`` (and
    the environment ``accelerate launch`` sets), with what to use instead; None where it can."""
    if getattr(args, "deepspeed", None) or _env_true("ACCELERATE_USE_DEEPSPEED"):
        return (f"{WHAT}: DeepSpeed is not supported: its engine runs the backward, partitions "
                "(ZeRO) and checkpoints activations itself, so bagualu cannot plan the "
                f"micro-batches' activations. Use {INSTEAD}")
    if getattr(args, "fsdp", None) or getattr(args, "fsdp_plugin_args", None) or \
            _env_true("ACCELERATE_USE_FSDP"):
        return (f"{WHAT}: accelerate's FSDP plugin is not supported in the Trainer (bagualu "
                "refuses FSDP1's flat parameters, and FSDP2 under the Trainer's loop is "
                f"untested). Use {INSTEAD}")
    if _env_true("ACCELERATE_USE_MEGATRON_LM"):
        return f"{WHAT}: Megatron-LM through accelerate is not supported. Use {INSTEAD}"
    if getattr(args, "torch_compile", False):
        return (f"{WHAT}: torch_compile=True compiles the whole model, whose forward bagualu "
                "plans per micro-batch and per operator; compile each decoder block instead "
                "(for block in model.model.layers: block.compile()) and leave torch_compile "
                "off: bagualu plans compiled blocks (docs/pytorch.md, \"Compiled blocks\")")
    n_gpu = getattr(args, "n_gpu", 1)  # the Trainer set its devices up before on_init_end
    if isinstance(n_gpu, int) and n_gpu > 1:
        return (f"{WHAT}: {n_gpu} GPUs in one process (torch.nn.DataParallel) are not "
                "supported: its replicas run the forward in threads. Launch one process per "
                "GPU instead (torchrun or accelerate launch: DDP)")
    return None


class _Callback:
    """The callback's behaviour (module docstring); ``trainer_callback`` mixes it into
    ``transformers.TrainerCallback``."""

    def __init__(self, capacity: Union[int, str], policy: str = "bagualu", *,
                 governor: Optional[str] = None, allow_fp8: bool = True,
                 issue_order: str = "dual-batch", log_iterations: bool = True,
                 strict: bool = False, device: Optional[str] = None,
                 layers: Optional[Union[str, Sequence[str]]] = None,
                 ops: Optional[Dict[str, str]] = None, expert_parallel: Optional[int] = None,
                 ep_rank: int = 0, local_experts: Optional[Sequence[int]] = None,
                 dispatch: Optional[Union[str, Sequence[str]]] = None,
                 **install_options: Any) -> None:
        parse_size(capacity, "capacity")  # bad values fail here, not at train()
        check_policy(policy)
        check_issue_order(issue_order)
        for key in ("pipeline_rank", "pipeline_stages", "micro_batches", "chunks"):
            if key in install_options:
                raise BagualuError(f"{WHAT}: {key} comes from the Trainer's TrainingArguments "
                                   "(one stage, gradient_accumulation_steps micro-batches); do "
                                   "not give it")
        self.device = torch.device(device) if device is not None else None
        self.install_kwargs: Dict[str, Any] = dict(
            capacity=capacity, policy=policy, governor=governor, allow_fp8=allow_fp8,
            issue_order=issue_order, log_iterations=log_iterations, strict=strict,
            **install_options)
        self.instrument_kwargs: Dict[str, Any] = dict(
            layers=layers, ops=ops, expert_parallel=expert_parallel, ep_rank=ep_rank,
            local_experts=local_experts, dispatch=dispatch)
        self.history: List[Dict[str, Any]] = []  # each optimizer step's iteration line
        self.stats: Optional[Dict[str, Any]] = None  # bagualu.stats() at the end of train()
        self.micro_batches = 0
        self._model: Optional[torch.nn.Module] = None
        self._forward: Any = None
        self._loop: Optional[Iterator[MicroBatch]] = None
        self._backward: Any = None  # the open backward context of the last forward
        self._in_forward = False
        if torch.cuda.is_available() and (self.device is None or self.device.type == "cuda"):
            # bagualu.install's rule: the allocator before the first CUDA allocation, which the
            # Trainer's constructor makes when it moves the model to the GPU.
            try:
                swap_cuda_allocator()
            except InstallError as e:
                if strict:
                    raise
                log.error("bagualu: %s Continuing with PyTorch's allocator (plans still "
                          "apply).", e)

    # -- the Trainer's events -----------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        why = refusal(args)
        if why is not None:
            raise BagualuError(why)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        why = refusal(args)
        if why is not None:
            raise BagualuError(why)
        if model is None:
            raise BagualuError(f"{WHAT}: the Trainer passed no model to on_train_begin")
        self._teardown()  # a second train() (or auto_find_batch_size's retry)
        where = torch.device(args.device)
        if self.device is not None and self.device.type != where.type:
            raise BagualuError(f"{WHAT}: made for device {self.device}, but the Trainer trains "
                               f"on {where} (TrainingArguments' device)")
        self.micro_batches = int(args.gradient_accumulation_steps)
        self.history = []
        if "TORCHELASTIC_RUN_ID" in os.environ:  # every rank of this torchrun job: one job
            os.environ.setdefault("BGL_JOB_ID", "hf-trainer-" + os.environ["TORCHELASTIC_RUN_ID"])
        bagualu.install(device=str(where), pipeline_rank=0, pipeline_stages=1,
                        micro_batches=self.micro_batches, **self.install_kwargs)
        try:
            bagualu.instrument(model, {"name": f"hf-{type(model).__name__}"},
                               **self.instrument_kwargs)
        except BaseException:
            bagualu.uninstall()
            raise
        self._model = model
        self._forward = model.__dict__.get("forward")  # an instance attribute, or None
        inner = model.forward

        def forward(*a: Any, **k: Any) -> Any:
            return self._run_forward(inner, a, k)

        for attr in ("__doc__", "__name__", "__qualname__", "__module__"):
            try:
                setattr(forward, attr, getattr(inner, attr))
            except (AttributeError, TypeError):
                pass
        forward.__wrapped__ = inner  # type: ignore[attr-defined]  # inspect.signature
        model.forward = forward
        log.info("bagualu: managing the Trainer's activations (%d micro-batches per step, "
                 "policy %s, capacity %s)", self.micro_batches, self.install_kwargs["policy"],
                 self.install_kwargs["capacity"])

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._model is None:
            return
        self._close_backward()
        bagualu.begin_iteration()
        self._loop = iter(micro_batches(self.micro_batches, iterations=False))

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close_backward()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any,
                              **kwargs: Any) -> None:
        if self._loop is None:
            return
        self._close_backward()
        self._loop = None
        self.history.append(bagualu.end_iteration())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._teardown()

    # -- the micro-batches --------------------------------------------------------------------
    def _run_forward(self, inner: Any, a: tuple, k: dict) -> Any:
        if self._loop is None or self._in_forward or not torch.is_grad_enabled():
            return inner(*a, **k)  # evaluation, a nested call, or outside a training step
        if self._backward is not None:
            raise BagualuError(f"{WHAT}: a second forward with gradients before the previous "
                               "micro-batch's backward ended (one forward and one backward per "
                               "micro-batch: the Trainer's training_step)")
        try:
            mb = next(self._loop)
        except StopIteration:
            raise BagualuError(
                f"{WHAT}: more forwards with gradients in one optimizer step than "
                f"gradient_accumulation_steps ({self.micro_batches}); one forward and one "
                "backward per micro-batch") from None
        self._in_forward = True
        try:
            with mb.forward():
                out = inner(*a, **k)
        finally:
            self._in_forward = False
        ctx = mb.backward()
        ctx.__enter__()  # the step point of its backward; closed after the backward ran
        self._backward = ctx
        return out

    def _close_backward(self) -> None:
        ctx, self._backward = self._backward, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def _teardown(self) -> None:
        self._loop = None
        self._backward = None  # an unfinished step (an error): nothing to close cleanly
        if self._model is not None:
            if self._forward is not None:
                self._model.forward = self._forward
            else:
                self._model.__dict__.pop("forward", None)
            self._model = self._forward = None
        from ..runtime import active
        if active() is not None:
            self.stats = bagualu.stats()
            bagualu.uninstall()


_CLASS: Any = None


def trainer_callback(capacity: Union[int, str], policy: str = "bagualu", **options: Any) -> Any:
    """A ``transformers.TrainerCallback`` that runs the Trainer under bagualu (module
    docstring): ``Trainer(..., callbacks=[bagualu.trainer_callback(capacity="40GiB")])``.
    Create it before the model goes to the GPU (it swaps the CUDA allocator then).

    ``capacity``, ``policy`` and ``options`` are ``bagualu.install``'s (governor, allow_fp8,
    issue_order, log_iterations, strict, pinned_capacity, calibration, ...) and
    ``bagualu.instrument``'s (layers, ops, expert_parallel, ep_rank, local_experts, dispatch);
    the device, one pipeline stage and ``gradient_accumulation_steps`` micro-batches come from
    the TrainingArguments (``device="cpu"``: no CUDA allocator swap where the Trainer will
    train on the CPU, e.g. ``use_cpu=True`` on a GPU machine). After ``train()``:
    ``.history`` (each step's iteration line) and ``.stats`` (``bagualu.stats()`` at its
    end)."""
    global _CLASS
    if _CLASS is None:
        import transformers
        _CLASS = type("BagualuCallback", (_Callback, transformers.TrainerCallback),
                      {"__doc__": _Callback.__doc__, "__module__": __name__})
    return _CLASS(capacity, policy, **options)
