"""bagualu.pipelining: torch.distributed.pipelining schedules calling bagualu.

In process (a gloo group of one rank): the wrapped Schedule1F1B reproduces the plain schedule's
losses and gradients bitwise and calls the 1F1B points; a schedule whose order differs from the
points, and an unsupported schedule, are refused. Under torchrun (2 ranks, gloo, a real
bgl-governord): the example's --pipeline torch mode against a plain run of the same schedule."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import bagualu
from bagualu import pipelining
from bagualu.schedule import one_f_one_b
from conftest import ROOT, require_libs, small_config
from moe_model import DriftingCorpus, MoEStage
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
        losses: List[torch.Tensor] = []
        schedule.step(x, target=y, losses=losses)
        losses_out.append(torch.stack([loss.detach() for loss in losses]))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        opt.step()
    return losses_out, grads


def test_fix_batch_p2p_is_idempotent() -> None:
    from torch.distributed.pipelining import schedules
    first = pipelining.fix_batch_p2p()
    assert pipelining.fix_batch_p2p() == first
    if first:  # torch drops the works of a batch (2.5.1): replaced by the waiting version
        assert schedules._batch_p2p is pipelining._batch_p2p_all


def test_wrapped_1f1b_matches_plain_schedule_bitwise(world_of_one) -> None:
    require_libs()
    ref_losses, ref_grads = _train(*_schedule())
    bagualu.install(capacity="512KiB", policy="bagualu", governor="none", pipeline_rank=0,
                    pipeline_stages=1, micro_batches=MB, log_iterations=False)
    schedule, model = _schedule()
    bagualu.instrument(model, small_config().info())
    pipe = bagualu.pipelining.wrap_schedule(schedule)
    losses, grads = _train(pipe, model)
    for a, b in zip(ref_losses, losses):
        assert torch.equal(a, b)
    for ga, gb in zip(ref_grads, grads):
        assert ga.keys() == gb.keys()
        for name in ga:
            assert torch.equal(ga[name], gb[name]), name
    assert pipe.points == one_f_one_b(MB, 1, 0)
    assert pipe.plans == MB  # every forward point planned (the embedded planner)
    assert pipe.line is not None and pipe.line["iteration"] == 1
    mitigated = sum(ln["offloads"] + ln["recomputed_ops"] for ln in bagualu.current().history)
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
    with pytest.raises(bagualu.BagualuError, match="one stage per rank"):
        pipelining.wrap_schedule(object())
    no_loss = Schedule1F1B(schedule._stage, MB)
    with pytest.raises(bagualu.BagualuError, match="no loss_fn"):
        pipelining.schedule_points(no_loss)


# -- two ranks under torchrun -------------------------------------------------------------------
ARGS = ["--iterations", "2", "--layers", "2", "--micro-batches", "4", "--hidden", "64",
        "--seq-len", "32", "--spike-every", "3", "--pipeline", "torch"]


def _torchrun(tmp_path: Any, *extra: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "integrations" / "pytorch" / "examples" / "moe_train.py"), *ARGS,
           *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return text


def _exact_losses(text: str) -> List[str]:
    return re.findall(r"rank 1 iteration \d+ loss \S+ exact (\S+)", text)


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
