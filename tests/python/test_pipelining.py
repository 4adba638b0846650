"""bagualu.pipelining and bagualu.accumulate: torch.distributed.pipelining schedules and plain
gradient accumulation calling bagualu.

In process (a gloo group of one rank): the wrapped Schedule1F1B and ScheduleInterleaved1F1B
(two local stages) reproduce the plain schedule's losses and gradients bitwise and call the
planner's points (1F1B; interleaved 1F1B with chunks); the adapter's calls (step points,
forward/backward contexts with their chunk, the loss inside the last stage's forward) are
checked against a recording stand-in for bagualu; the interleaved points derived from torch's
per-rank operation order equal ``interleaved_one_f_one_b`` for every rank (a fake process
group stands for the ranks); a schedule whose order differs from the points, unsupported
schedules, schedules without loss_fn and split-backward (zero-bubble) schedules are refused.
Gradient accumulation through ``bagualu.accumulate`` gives plain PyTorch's gradients bitwise
at the single-stage points. Under torchrun (2 ranks, gloo, a real bgl-governord): the example's
--pipeline torch mode (1F1B, GPipe, interleaved with 2 stages per rank) against plain runs."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                          ScheduleInterleaved1F1B)

import bagualu
from bagualu.loops import accumulate, pipelining
from bagualu.loops.schedule import interleaved_one_f_one_b, one_f_one_b
from conftest import ROOT, check_torchrun, require_libs, small_config
from moe_model import DriftingCorpus, MoEStage
from moe_train import _build_stage
from test_torchrun import _start_daemon, _stop_daemon  # noqa: F401
from test_torchrun import daemon, daemon_binary  # noqa: F401  (the daemon fixture)

MB = 4


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _schedule(cls: Any = Schedule1F1B) -> Tuple[Any, MoEStage]:
    cfg = small_config()
    torch.manual_seed(0)
    model = MoEStage(cfg)
    mbs, seq = cfg.micro_batch_size, cfg.seq_len
    stage = PipelineStage(model, 0, 1, torch.device("cpu"),
                          input_args=(torch.zeros(mbs, seq, dtype=torch.long),),
                          output_args=(torch.zeros(mbs, seq, cfg.vocab),))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab),
                                                 target.view(-1)) / MB

    return cls(stage, MB, loss_fn=loss_fn), model


def _train(schedule: Any, model: MoEStage, steps: int = 2
           ) -> Tuple[List[torch.Tensor], List[Dict[str, torch.Tensor]]]:
    cfg = small_config()
    corpus = DriftingCorpus(cfg, seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses_out, grads = [], []
    for it in range(steps):
        data = [corpus.batch(it) for _ in range(MB)]
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        opt.zero_grad(set_to_none=True)
        loss, grad = _step(schedule, model, x, y)
        losses_out.append(loss)
        grads.append(grad)
        opt.step()
    return losses_out, grads


def _step(schedule: Any, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
          ) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """One schedule step: its micro-batch losses and the model's gradients."""
    losses: List[torch.Tensor] = []
    schedule.step(x, target=y, losses=losses)
    return (torch.stack([loss.detach() for loss in losses]),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def test_fix_batch_p2p_is_idempotent() -> None:
    from torch.distributed.pipelining import schedules
    first = pipelining.fix_batch_p2p()
    assert pipelining.fix_batch_p2p() == first
    if first:  # torch drops the works of a batch (2.5.1): replaced by the waiting version
        assert schedules._batch_p2p is pipelining._batch_p2p_all


def assert_bitwise(ref_losses, ref_grads, losses, grads) -> None:
    """The same losses and gradients, bit for bit: as many steps as the reference (not an
    empty or a shorter run), every micro-batch's loss, every parameter's gradient."""
    assert len(ref_losses) == len(losses) == len(ref_grads) == len(grads) > 0
    for a, b in zip(ref_losses, losses):
        assert a.shape == b.shape and a.numel() > 0, (a.shape, b.shape)
        assert torch.equal(a, b)
    for ga, gb in zip(ref_grads, grads):
        assert len(ga) > 0 and ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name


def test_wrapped_1f1b_matches_plain_schedule_bitwise(world_of_one) -> None:
    require_libs()
    ref_losses, ref_grads = _train(*_schedule())
    bagualu.install(capacity="512KiB", policy="bagualu", governor="none", pipeline_rank=0,
                    pipeline_stages=1, micro_batches=MB, log_iterations=False,
                    allow_fp8=False)
    schedule, model = _schedule()
    bagualu.instrument(model, small_config().info())
    pipe = bagualu.pipelining.wrap_schedule(schedule)
    losses, grads = _train(pipe, model)
    assert_bitwise(ref_losses, ref_grads, losses, grads)
    assert pipe.points == one_f_one_b(MB, 1, 0)
    assert pipe.plans == MB  # every forward point planned (the embedded planner)
    assert pipe.line is not None and pipe.line["iteration"] == 1
    mitigated = sum(ln["offloads"] + ln["recomputed_ops"] for ln in bagualu.history())
    assert mitigated > 0  # 512 KiB is tight: the plans were carried out, losses still bitwise
    pipe.unwrap()
    assert "forward_one_chunk" not in schedule._stage.__dict__


def test_points_that_differ_from_the_schedule_are_refused(world_of_one) -> None:
    require_libs()
    bagualu.install(capacity="64MiB", policy="bagualu", governor="none",
                    pipeline_stages=1, micro_batches=MB, log_iterations=False)
    schedule, model = _schedule(Schedule1F1B)
    bagualu.instrument(model, small_config().info())
    pipe = bagualu.pipelining.wrap_schedule(schedule, points=pipelining.gpipe(MB))
    with pytest.raises(bagualu.BagualuError, match=r"ran B0 where bagualu expected F1"):
        _train(pipe, model, steps=1)


def test_gpipe_points_and_unsupported_schedules(world_of_one) -> None:
    schedule, _ = _schedule(ScheduleGPipe)
    assert pipelining.schedule_points(schedule) == pipelining.gpipe(MB)
    with pytest.raises(bagualu.BagualuError, match="object is not a torch.distributed"):
        pipelining.wrap_schedule(object())
    no_loss = Schedule1F1B(schedule._stage, MB)
    with pytest.raises(bagualu.BagualuError, match="Schedule1F1B has no loss_fn"):
        pipelining.schedule_points(no_loss)
    with pytest.raises(bagualu.BagualuError, match="Schedule1F1B has no loss_fn"):
        pipelining.wrap_schedule(no_loss)


# -- several stages per rank --------------------------------------------------------------------
def _interleaved(cls: Any = ScheduleInterleaved1F1B, loss: bool = True
                 ) -> Tuple[Any, torch.nn.ModuleList]:
    """The small model as 2 stages (embedding + layer 0, layer 1 + head), both on this rank."""
    cfg = small_config()
    mbs, seq = cfg.micro_batch_size, cfg.seq_len
    modules = [_build_stage(cfg, 0, i, 2, torch.device("cpu")) for i in range(2)]
    # torch >= 2.6 takes requires_grad from the examples: the activation between the stages
    # needs it on both sides, or no gradient reaches stage 0
    ins = [torch.zeros(mbs, seq, dtype=torch.long),
           torch.zeros(mbs, seq, cfg.hidden, requires_grad=True)]
    outs = [torch.zeros(mbs, seq, cfg.hidden, requires_grad=True),
            torch.zeros(mbs, seq, cfg.vocab)]
    stages = [PipelineStage(m, i, 2, torch.device("cpu"), input_args=(ins[i],),
                            output_args=(outs[i],)) for i, m in enumerate(modules)]

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.view(-1, cfg.vocab),
                                                 target.view(-1)) / MB

    return cls(stages, MB, loss_fn=loss_fn if loss else None), torch.nn.ModuleList(modules)


class _Recorder:
    """Stands for bagualu's runtime calls: records step points and forward/backward contexts
    (with their chunk) in order; ``open`` is the context running now."""

    def __init__(self) -> None:
        self.calls: List[Tuple[Any, ...]] = []
        self.open: List[Tuple[str, int, int]] = []

    def step_point(self, phase: str, f: Any, b: Any, forward_chunk: int = 0,
                   backward_chunk: int = 0) -> None:
        self.calls.append(("P", phase, f, b, forward_chunk, backward_chunk))

    def context(self, kind: str) -> Any:
        @contextlib.contextmanager
        def ctx(mb: int, chunk: int = 0) -> Iterator[None]:
            self.calls.append((kind, mb, chunk))
            self.open.append((kind, mb, chunk))
            try:
                yield
            finally:
                self.open.pop()
        return ctx


# torch before 2.8 runs a one-rank ScheduleInterleaved1F1B into gloo's "writev: Bad file
# descriptor" (seen on 2.6 with the plain schedule); two ranks under torchrun run there.
ONE_RANK_INTERLEAVED = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 8),
    reason="torch < 2.8: one-rank interleaved schedules fail inside gloo")


@ONE_RANK_INTERLEAVED
def test_interleaved_calls_follow_the_schedule(world_of_one, monkeypatch) -> None:
    """The adapter's calls on ScheduleInterleaved1F1B (2 local stages), with a recording
    stand-in for the runtime: the planner's interleaved points, each forward and backward in
    its context with its chunk, the loss inside the last stage's forward; the losses and
    gradients of the plain schedule, bitwise."""
    ref_losses, ref_grads = _train(*_interleaved())
    rec = _Recorder()
    for name, value in (("step_point", rec.step_point), ("forward", rec.context("F")),
                        ("backward", rec.context("B")), ("current", lambda: None),
                        ("begin_iteration", lambda: None), ("end_iteration", lambda: {})):
        monkeypatch.setattr(bagualu.api, name, value)  # what the loops call
    schedule, model = _interleaved()
    in_loss: List[Tuple[str, int, int]] = []
    loss_fn = schedule._loss_fn

    def spying_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        in_loss.append(rec.open[-1])
        return loss_fn(logits, target)

    schedule._loss_fn = spying_loss
    pipe = pipelining.wrap_schedule(schedule)
    assert pipe.chunks == 2
    losses, grads = _train(pipe, model, steps=1)
    assert torch.equal(losses[0], ref_losses[0])
    for name in ref_grads[0]:
        assert torch.equal(ref_grads[0][name], grads[0][name]), name
    points = interleaved_one_f_one_b(MB, 1, 0, 2)
    assert pipe.points == points
    want: List[Tuple[Any, ...]] = []
    for phase, f, b, fc, bc in points:
        want.append(("P", phase, f, b, fc or 0, bc or 0))
        if f is not None:
            want.append(("F", f, fc))
        if b is not None:
            want.append(("B", b, bc))
    assert rec.calls == want
    assert in_loss == [("F", mb, 1) for mb in range(MB)]  # the last stage is chunk 1
    assert rec.open == [] and pipe.micro_batch is None and pipe.chunk is None
    pipe.unwrap()
    assert all("forward_one_chunk" not in st.__dict__ for st in schedule._stages)


@ONE_RANK_INTERLEAVED
def test_wrapped_interleaved_matches_plain_schedule_bitwise(world_of_one) -> None:
    """ScheduleInterleaved1F1B with 2 stages on this rank under bagualu (chunks=2, 512 KiB:
    offloads and recomputes happen): the plain schedule's losses and gradients bitwise, the
    planner's interleaved points. Needs the runtime's chunk= support."""
    require_libs()
    ref_losses, ref_grads = _train(*_interleaved())
    bagualu.install(capacity="512KiB", policy="bagualu", governor="none", pipeline_rank=0,
                    pipeline_stages=1, micro_batches=MB, chunks=2, log_iterations=False,
                    allow_fp8=False)
    schedule, model = _interleaved()
    bagualu.instrument(model, small_config().info())
    pipe = pipelining.wrap_schedule(schedule)
    losses, grads = _train(pipe, model)
    assert_bitwise(ref_losses, ref_grads, losses, grads)
    points = interleaved_one_f_one_b(MB, 1, 0, 2)
    assert pipe.points == points
    assert pipe.plans == sum(1 for p in points if p[1] is not None)  # every forward planned
    assert pipe.line is not None and pipe.line["iteration"] == 1
    mitigated = sum(ln["offloads"] + ln["recomputed_ops"] for ln in bagualu.history())
    assert mitigated > 0


def test_interleaved_points_from_torch_order_for_every_rank() -> None:
    """torch's ScheduleInterleaved1F1B tables (every rank, built under a fake process group
    of 2 and 4 ranks) run the operations of the planner's interleaved 1F1B in its order."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    for ranks, chunks in ((2, 2), (4, 2), (2, 3)):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
        try:
            stages = [PipelineStage(torch.nn.Linear(4, 4), c * ranks, ranks * chunks,
                                    torch.device("cpu"), input_args=(torch.zeros(1, 4),),
                                    output_args=(torch.zeros(1, 4),)) for c in range(chunks)]
            for n in (ranks, 2 * ranks, 3 * ranks):
                schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=lambda o, t: o.sum())
                for rank in range(ranks):
                    want = interleaved_one_f_one_b(n, ranks, rank, chunks)
                    assert pipelining.schedule_points(schedule, rank) == want, (ranks, n, rank)
                    ops = pipelining._rank_actions(schedule, stages, rank)
                    assert ops == [op[:3] for op in pipelining._operations(want)]
        finally:
            dist.destroy_process_group()


def test_points_from_actions() -> None:
    # 1F1B stage 0 of 2 as torch runs it (its extra warm-up forward is a steady forward)
    ops = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("F", 2, 0), ("B", 1, 0), ("F", 3, 0),
           ("B", 2, 0), ("B", 3, 0)]
    assert [p[:3] for p in pipelining.points_from_actions(ops)] == one_f_one_b(4, 2, 0)
    # the last stage: F_x B_x are two points
    last = [(k, mb, 0) for mb in range(3) for k in "FB"]
    assert [p[:3] for p in pipelining.points_from_actions(last)] == one_f_one_b(3, 1, 0)
    # fill-drain (GPipe, looped BFS): warm-up forwards, cool-down backwards
    fill = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert [p[:3] for p in pipelining.points_from_actions(fill)] == pipelining.gpipe(2)
    assert interleaved_one_f_one_b(4, 2, 1, 1) == [
        (ph, f, b, None if f is None else 0, None if b is None else 0)
        for ph, f, b in one_f_one_b(4, 2, 1)]
    with pytest.raises(ValueError, match="divisible"):
        interleaved_one_f_one_b(3, 2, 0, 2)


def test_split_backward_and_lossless_multi_stage_schedules_are_refused(world_of_one) -> None:
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble
    zb, _ = _interleaved(ScheduleInterleavedZeroBubble)
    with pytest.raises(bagualu.BagualuError, match=r"ScheduleInterleavedZeroBubble splits the "
                       r"backward into input \(I\) and weight \(W\) parts"):
        pipelining.wrap_schedule(zb)
    no_loss, _ = _interleaved(loss=False)
    with pytest.raises(bagualu.BagualuError, match="ScheduleInterleaved1F1B has no loss_fn"):
        pipelining.wrap_schedule(no_loss)


# -- gradient accumulation without pipeline parallelism ----------------------------------------
def _accumulation_data() -> Tuple[torch.Tensor, torch.Tensor]:
    corpus = DriftingCorpus(small_config(), seed=1)
    data = [corpus.batch(0) for _ in range(MB)]
    return torch.stack([d[0] for d in data]), torch.stack([d[1] for d in data])


def _model() -> MoEStage:
    torch.manual_seed(0)
    return MoEStage(small_config())


def _loss(model: MoEStage, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    vocab = small_config().vocab
    return torch.nn.functional.cross_entropy(model(x).view(-1, vocab), y.view(-1)) / MB


def test_accumulate_gradients_matches_plain_pytorch_bitwise(monkeypatch) -> None:
    require_libs()
    x, y = _accumulation_data()
    ref = _model()
    ref_losses = []
    for mb in range(MB):
        loss = _loss(ref, x[mb], y[mb])
        loss.backward()
        ref_losses.append(loss.detach())
    bagualu.install(capacity="512KiB", policy="bagualu", governor="none", pipeline_rank=0,
                    pipeline_stages=1, micro_batches=MB, log_iterations=False,
                    allow_fp8=False)
    model = _model()
    bagualu.instrument(model, small_config().info())
    seen: List[Tuple[Any, ...]] = []
    real = bagualu.step_point
    monkeypatch.setattr(bagualu.api, "step_point", lambda *a: seen.append(a) or real(*a))
    losses = accumulate.accumulate_gradients(lambda mb: _loss(model, x[mb], y[mb]), MB)
    assert seen == one_f_one_b(MB, 1, 0)  # ("steady", mb, None), ("steady", None, mb)
    assert len(losses) == len(ref_losses) == MB
    assert all(torch.equal(a, b) for a, b in zip(ref_losses, losses))
    ref_params, params = list(ref.named_parameters()), list(model.named_parameters())
    assert len(params) == len(ref_params) > 0
    for (name, p), (_, q) in zip(ref_params, params):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or
                                                         torch.equal(p.grad, q.grad)), name
    history = bagualu.history()
    assert len(history) == 1 and history[0]["offloads"] + history[0]["recomputed_ops"] > 0

    # the loop form: the same gradients again (accumulated on top of the first pass's, as
    # plain PyTorch accumulates a second pass), its line and plans
    for mb in range(MB):
        _loss(ref, x[mb], y[mb]).backward()
    seen.clear()
    loop = accumulate.micro_batches(MB)
    loop_losses = []
    for mb in loop:
        assert isinstance(mb, int) and 0 <= mb < MB
        with mb.forward():
            loss = _loss(model, x[mb], y[mb])
        with mb.backward():
            loss.backward()
        loop_losses.append(loss.detach())
    assert seen == one_f_one_b(MB, 1, 0)
    assert len(loop_losses) == MB and all(torch.equal(a, b)
                                          for a, b in zip(ref_losses, loop_losses))
    for (name, p), (_, q) in zip(ref_params, params):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or
                                                         torch.equal(p.grad, q.grad)), name
    assert loop.line is not None and loop.line["iteration"] == 1  # the second (from 0)
    assert loop.plans == MB


def test_accumulate_misuse_is_refused() -> None:
    require_libs()
    with pytest.raises(bagualu.BagualuError, match="not installed"):
        list(accumulate.micro_batches(2))
    with pytest.raises(bagualu.BagualuError, match="positive number of micro-batches"):
        accumulate.micro_batches(0)
    bagualu.install(capacity="64MiB", policy="keep-all", governor="none", pipeline_stages=1,
                    micro_batches=2, log_iterations=False)
    model = _model()
    bagualu.instrument(model, small_config().info())
    x, y = _accumulation_data()
    loop = iter(accumulate.micro_batches(2))
    mb = next(loop)
    with pytest.raises(bagualu.BagualuError, match=r"micro-batch 0: backward\(\) where "
                       r"nothing yet"):
        with mb.backward():
            pass
    with mb.forward():
        loss = _loss(model, x[mb], y[mb])
    with pytest.raises(bagualu.BagualuError, match=r"micro-batch 0: the loop moved on "
                       r"without its backward\(\)"):
        next(loop)
    with bagualu.backward(0):
        loss.backward()  # the runtime's own bookkeeping of micro-batch 0 closes
    bagualu.end_iteration()

    two = accumulate.micro_batches(2, iterations=False)
    bagualu.begin_iteration()
    first = next(iter(two))
    with first.forward():
        loss = _loss(model, x[0], y[0])
    with pytest.raises(bagualu.BagualuError, match=r"micro-batch 1: forward\(\) before the "
                       r"backward\(\) of micro-batch 0"):
        with accumulate.MicroBatch(1, two).forward():
            pass
    with first.backward():
        loss.backward()
    with pytest.raises(bagualu.BagualuError, match="runs once"):
        iter(two).__next__()
    bagualu.end_iteration()


# -- two ranks under torchrun -------------------------------------------------------------------
ARGS = ["--iterations", "2", "--layers", "2", "--micro-batches", "4", "--hidden", "64",
        "--seq-len", "32", "--spike-every", "3", "--pipeline", "torch",
        "--no-fp8"]  # bit for bit against plain PyTorch: no plan may choose FP8


def _torchrun(tmp_path: Any, *extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "integrations" / "pytorch" / "examples" / "moe_train.py"), *ARGS,
           *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    check_torchrun(out.returncode, text)
    return text


# A loss printed as a hex float. torchrun's ranks share one stdout, unbuffered: a line's text
# and its newline are separate writes, so another rank's line can follow the number directly.
# A NaN or infinite loss is captured too, so that a run that diverged fails as a wrong loss.
_HEX = r"(-?0x[0-9a-f]+(?:\.[0-9a-f]*)?p[+-]\d+|-?nan|-?inf)"


def _exact_losses(text: str) -> List[str]:
    return re.findall(r"rank 1 iteration \d+ loss \S+ exact " + _HEX, text)


def test_torch_schedules_on_two_ranks_against_the_daemon(daemon, tmp_path) -> None:
    require_libs()
    plain = _torchrun(tmp_path, "--policy", "plain")
    assert "rank 0 finished 2 iterations plain" in plain, plain[-4000:]
    ref = _exact_losses(plain)
    assert len(ref) == 2, plain[-4000:]

    # 1F1B under a tight capacity (offload and recompute happen), every rank on the daemon
    text = _torchrun(tmp_path, "--governor", daemon, "--capacity", "1500KiB")
    assert _exact_losses(text) == ref, text[-4000:]
    for rank, points in ((0, "10 (warmup 2 steady 6 cooldown 2)"),
                         (1, "16 (warmup 0 steady 16 cooldown 0)")):
        m = re.search(rf"rank {rank} finished 2 iterations governor=remote ooms=0 "
                      rf"step points {re.escape(points)} plans (\d+)", text)
        assert m is not None and int(m.group(1)) > 0, text[-4000:]
    assert re.search(r"offloads [1-9]|recomputed [1-9]", text), text[-4000:]

    # GPipe: every forward, then every backward; the same losses as plain 1F1B
    text = _torchrun(tmp_path, "--governor", daemon, "--capacity", "64MiB",
                     "--torch-schedule", "gpipe")
    assert _exact_losses(text) == ref, text[-4000:]
    for rank in (0, 1):
        assert re.search(rf"rank {rank} finished 2 iterations governor=remote ooms=0 step "
                         r"points 16 \(warmup 8 steady 0 cooldown 8\) plans [1-9]", text), \
            text[-4000:]


def _phase_counts(points: List[Tuple[Any, ...]], iterations: int) -> str:
    count = {ph: sum(1 for p in points if p[0] == ph) * iterations
             for ph in ("warmup", "steady", "cooldown")}
    return (f"{sum(count.values())} (warmup {count['warmup']} steady {count['steady']} "
            f"cooldown {count['cooldown']})")


def test_interleaved_on_two_ranks_against_the_daemon(daemon, tmp_path) -> None:
    """ScheduleInterleaved1F1B, 2 ranks x 2 stages (4 layers, one per stage), gloo: the plain
    schedule gives plain Schedule1F1B's losses bit for bit (the same model cut in 4 stages
    instead of 2), and under bagualu (chunks=2, every rank on the daemon, a tight capacity)
    the same losses again at the planner's interleaved points. The bagualu run needs the
    runtime's chunk= support."""
    require_libs()
    four = ("--layers", "4")
    ref = _exact_losses(_torchrun(tmp_path, *four, "--policy", "plain"))
    assert len(ref) == 2
    plain = _torchrun(tmp_path, *four, "--policy", "plain", "--torch-schedule", "interleaved")
    assert "rank 0 finished 2 iterations plain" in plain, plain[-4000:]
    assert _exact_losses(plain) == ref, plain[-4000:]

    text = _torchrun(tmp_path, *four, "--governor", daemon, "--capacity", "3MiB",
                     "--torch-schedule", "interleaved")
    assert _exact_losses(text) == ref, text[-4000:]
    for rank in (0, 1):
        points = _phase_counts(interleaved_one_f_one_b(4, 2, rank, 2), 2)
        m = re.search(rf"rank {rank} finished 2 iterations governor=remote ooms=0 "
                      rf"step points {re.escape(points)} plans (\d+)", text)
        assert m is not None and int(m.group(1)) > 0, text[-4000:]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_unmodified_hf_model_on_two_ranks_against_the_daemon(daemon, tmp_path, schedule
                                                             ) -> None:
    """transformers' Qwen3-MoE, unchanged, cut into stages by examples/unmodified_pipeline.py
    and trained under torch's Schedule1F1B (2 ranks) or ScheduleInterleaved1F1B (2 ranks x 2
    stages), gloo, every rank on the daemon at half of its own keep-all peak under that
    schedule: every rank offloads or recomputes, nothing runs out of memory, and the losses are
    plain PyTorch's bit for bit."""
    text = _hf_pipeline(tmp_path, daemon, schedule)
    losses = _hf_losses(text)
    assert len(losses["plain"]) == 2, text[-4000:]
    assert losses["keep-all"] == losses["plain"] and losses["bagualu"] == losses["plain"], \
        text[-4000:]
    for rank in (0, 1):
        m = re.search(rf"rank {rank} bagualu finished 2 iterations governor=remote ooms=0 "
                      r"capacity (\d+) of keep-all peak (\d+) plans (\d+) mitigated (\d+)",
                      text)
        assert m is not None, text[-4000:]
        capacity, peak, plans, mitigated = map(int, m.groups())
        assert capacity == peak // 2 and plans > 0 and mitigated > 0, m.group(0)


def _hf_pipeline(tmp_path: Any, daemon: str, schedule: str, exact: bool = True) -> str:
    """examples/unmodified_pipeline.py (Qwen3-MoE, 2 ranks, half of each rank's keep-all peak)
    against ``daemon``; its output. ``exact``: no plan or eviction may use FP8 (the losses are
    compared bit for bit)."""
    require_libs()
    pytest.importorskip("transformers")
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "integrations" / "pytorch" / "examples" / "unmodified_pipeline.py"),
           "--model", "qwen3_moe", "--schedule", schedule, "--governor", daemon,
           "--fraction", "0.5", *(["--no-fp8"] if exact else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    check_torchrun(out.returncode, text)
    return text


def _hf_losses(text: str) -> Dict[str, List[str]]:
    return {what: re.findall(rf"rank 1 {what} iteration \d+ loss \S+ exact " + _HEX, text)
            for what in ("plain", "keep-all", "bagualu")}


def test_unmodified_hf_pipeline_within_a_small_node_budget(tmp_path) -> None:
    """The same pipeline against a daemon whose node budget grants each rank 512 KiB of pinned
    host memory, less than the plans would offload: the ranks plan within their grants, a rank
    that registered first and offloaded more gives back before the other grows into it, and
    what pressure eviction cannot offload it stores in FP8. The run finishes without running
    out of memory; the forward's losses are plain PyTorch's and the next iteration's within
    FP8's error."""
    proc, address, log = _start_daemon(tmp_path, f"--host-budget-bytes={1 << 20}",
                                       f"--host-floor-bytes={64 << 10}", "--node-max-sessions=8")
    try:
        text = _hf_pipeline(tmp_path, address, "1f1b", exact=False)  # FP8 evictions expected
    finally:
        _stop_daemon(proc, log)
    losses = _hf_losses(text)
    assert len(losses["plain"]) == 2 and len(losses["bagualu"]) == 2, text[-4000:]
    assert losses["bagualu"][0] == losses["plain"][0], text[-4000:]
    got, want = (float.fromhex(losses[w][1]) for w in ("bagualu", "plain"))
    assert abs(got - want) <= 1e-3 * abs(want), (got, want)
    for rank in (0, 1):
        assert re.search(rf"rank {rank} bagualu finished 2 iterations governor=remote ooms=0 ",
                         text), text[-4000:]
    # Pressure eviction inside a recompute callback once picked the record being regenerated
    # (the package had its data, the enforcer still had it dropped).
    assert "it is on dropped" not in text, text[-4000:]


class _CausalLM(torch.nn.Module):
    """How a Hugging Face model is handed to PipelineStage (tensor in, logits out); the model
    itself is unmodified."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@pytest.mark.parametrize("cls", [Schedule1F1B, ScheduleGPipe])
def test_unmodified_hf_model_under_torch_schedules(world_of_one, cls) -> None:
    """transformers' Qwen3-MoE, unchanged, as the one stage of torch's own 1F1B / GPipe under
    bagualu: the plain schedule's losses and gradients bitwise. GPipe holds every forward, so
    at half of its keep-all peak activations are offloaded or recomputed on the way. A single
    1F1B stage holds one forward, the capture's (the first micro-batch, planned by nobody yet)
    included: at half its peak that forward offloads under pressure (the pool's eviction)."""
    require_libs()
    unmodified = pytest.importorskip("unmodified")
    pytest.importorskip("transformers")
    mb = 4
    xs = unmodified.batches(2 * mb)

    def build() -> Tuple[Any, torch.nn.Module]:
        lm = _CausalLM(unmodified.build("qwen3_moe"))
        stage = PipelineStage(lm, 0, 1, torch.device("cpu"), input_args=(xs[0],),
                              output_args=(torch.zeros(*xs[0].shape, 128),))
        return cls(stage, mb, loss_fn=lambda logits, y: torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), y.flatten()) / mb), lm

    def run(schedule: Any, lm: torch.nn.Module) -> Tuple[list, list]:
        out_losses, out_grads = [], []
        for it in range(2):
            x = torch.cat(xs[it * mb:(it + 1) * mb])
            lm.zero_grad(set_to_none=True)
            loss, grad = _step(schedule, lm, x, x)
            out_losses.append(loss)
            out_grads.append(grad)
        return out_losses, out_grads

    ref_losses, ref_grads = run(*build())
    # keep-all's peak under this very schedule (every storage its own block: exact)
    bagualu.install(capacity="64MiB", policy="keep-all", governor="none", pipeline_stages=1,
                    micro_batches=mb, log_iterations=False)
    schedule, lm = build()
    bagualu.instrument(lm)
    bagualu.force_strategies({})
    run(bagualu.pipelining.wrap_schedule(schedule), lm)
    peak = max(line["peak_bytes"] for line in bagualu.history())
    bagualu.uninstall()
    del schedule, lm
    bagualu.install(capacity=peak // 2, policy="bagualu",
                    governor="none", pipeline_stages=1, micro_batches=mb, log_iterations=False,
                    allow_fp8=False)
    schedule, lm = build()
    bagualu.instrument(lm)
    pipe = bagualu.pipelining.wrap_schedule(schedule)
    losses, grads = run(pipe, lm)
    assert_bitwise(ref_losses, ref_grads, losses, grads)
    assert pipe.plans > 0
    t = bagualu.stats()["tracker"]
    assert t["offloads"] + t["drops"] + t["fp8_casts"] > 0
