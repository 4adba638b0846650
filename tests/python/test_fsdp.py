"""bagualu under FSDP2: transformers' Qwen3-MoE and Mixtral from tiny configs, unchanged, with
``fully_shard`` on every decoder block and the root, on 2 gloo ranks under torchrun
(tests/python/fsdp_ranks.py, one run for every ``*_on_two_ranks`` check here, a name the ASan
run of scripts/test.sh leaves out); DistributedDataParallel on the same ranks; in one process,
the legacy FullyShardedDataParallel refused at instrument and a recompute that waits for
FSDP2's parameters.

What is checked against plain FSDP2 (the same weights, each rank its own data): offload and
recompute mixed in a layer give every parameter's gradient shard bit for bit, FP8 storage within
1% relative L2; the bagualu policy at half of keep-all's peak finishes, mitigating, with plain
FSDP2's gradients bit for bit; the memory model (the planner's keep-all bytes at each
micro-batch's load) is within 1.5% of the activation bytes PyTorch saved in the blocks, counted
by the worker's own saved-tensors hook, which leaves out parameters and FSDP2's all-gathered
unsharded ones: a gathered weight taken for an activation would add a layer's weights to every
micro-batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import pytest
import torch
import torch.distributed as dist

import bagualu
from conftest import ROOT, check_torchrun, require_libs

unmodified = pytest.importorskip("unmodified")
pytest.importorskip("transformers")

MODELS = ("qwen3_moe", "mixtral")


def require_fsdp2_on_cpu() -> None:
    """FSDP2's all-gather records an event on its stream; torch.cpu.Stream has no record_event
    in torch 2.6, so plain fully_shard on CPU fails there, with or without bagualu."""
    if not hasattr(torch.cpu.Stream, "record_event"):
        pytest.skip(f"torch {torch.__version__}: FSDP2 does not run on CPU (torch.cpu.Stream "
                    "has no record_event; the DDP scenario runs in the same workers)")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> Dict[int, Dict[str, Any]]:
    """Every scenario of fsdp_ranks.py on 2 ranks: rank -> scenario -> results."""
    require_libs()
    require_fsdp2_on_cpu()
    out = tmp_path_factory.mktemp("fsdp")
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(out / "cache"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(ROOT / "tests" / "python" / "fsdp_ranks.py"), str(out)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    check_torchrun(run.returncode, run.stdout + run.stderr)
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


def _grads_equal(g: Dict[str, Any], what: str) -> None:
    assert g["ref_nonzero"], f"{what}: plain FSDP2's gradients are all zero"
    assert g["same_names"] and g["count"] > 20, f"{what}: gradients of other parameters {g}"
    assert g["n_differ"] == 0, f"{what}: {g['n_differ']} gradient shards differ, e.g. " \
                               f"{g['differ']} (relative L2 {g['rel_l2']:.3g})"


@pytest.mark.parametrize("name", MODELS)
def test_offload_recompute_and_fp8_under_fsdp2_on_two_ranks(ranks, name: str) -> None:
    """Qwen3-MoE with reshard_after_forward=False in the gradient-accumulation loop, Mixtral
    with reshard_after_forward=True, explicit prefetching and four forwards in flight: forced
    offload + recompute in every layer gives plain FSDP2's losses and gradient shards bit for
    bit; FP8 storage in the mix changes them by less than 1% relative L2 (but changes them)."""
    for rank, res in ranks.items():
        s = res[name]
        assert "error" not in s, s.get("error")
        what = f"{name} rank {rank}"
        assert s["keep_all"]["losses"] == s["plain"]["losses"], what
        _grads_equal(s["keep_all"]["grads"], f"{what} keep-all")
        mixed = s["mixed"]
        assert mixed["oom"] is None, mixed["oom"]
        t = mixed["stats"]["tracker"]
        assert t["offloads"] > 0 and t["drops"] > 0 and t["recomputes"] > 0, t
        assert mixed["losses"] == s["plain"]["losses"][:len(mixed["losses"])], what
        _grads_equal(mixed["grads"], f"{what} offload+recompute")
        fp8 = s["fp8"]
        assert fp8["oom"] is None and fp8["stats"]["tracker"]["fp8_casts"] > 0, fp8["stats"]
        assert 0 < fp8["grads"]["rel_l2"] <= 0.01, f"{what} FP8: {fp8['grads']}"


@pytest.mark.parametrize("name", MODELS)
def test_half_of_the_keep_all_peak_under_fsdp2_on_two_ranks(ranks, name: str) -> None:
    """The bagualu policy at half of each rank's own keep-all peak (the simulated device's
    capacity): no out-of-memory, activations moved, and plain FSDP2's losses and
    gradient shards bit for bit (the ranks' data and so their plans differ)."""
    for rank, res in ranks.items():
        s = res[name]
        assert "error" not in s, s.get("error")
        half = s["half"]
        what = f"{name} rank {rank} at half of {s['peak']} bytes"
        assert half["oom"] is None, f"{what}: {half['oom']}"
        assert len(half["lines"]) == 2 and all(line["ooms"] == 0 for line in half["lines"])
        t = half["stats"]["tracker"]
        assert t["offloads"] + t["drops"] + t["fp8_casts"] > 0, f"{what}: nothing mitigated"
        assert half["losses"] == s["plain"]["losses"], what
        _grads_equal(half["grads"], what)
    assert ranks[0][name]["plain"]["losses"] != ranks[1][name]["plain"]["losses"]


@pytest.mark.parametrize("name", MODELS)
def test_the_memory_model_counts_only_activations_under_fsdp2_on_two_ranks(ranks, name: str
                                                                          ) -> None:
    """The planner's keep-all bytes at each micro-batch's load against the bytes PyTorch saved
    in the blocks for that micro-batch (the capture's own sample left out), within 1.5%."""
    for rank, res in ranks.items():
        s = res[name]
        assert "error" not in s, s.get("error")
        saved = s["plain"]["saved"]
        predicted = s["keep_all"]["keep_all"]
        # every forward but the capture (the description was made from it) gives a sample
        assert len(predicted) == len(saved) - 1 >= 7, (len(predicted), len(saved))
        errors = [abs(p - b) / b for p, b in zip(predicted, saved[1:])]
        assert max(errors) < 0.015, f"{name} rank {rank}: {errors}"


def test_compiled_blocks_per_operator_under_fsdp2_on_two_ranks(ranks) -> None:
    """Every block compiled, then fully_shard (torchtitan's order), Qwen3-MoE: at half of
    keep-all's peak the compiled blocks' operators are placed apart (keep and offload in one
    block), and plain compiled FSDP2's losses and gradient shards bit for bit."""
    for rank, res in ranks.items():
        s = res["compiled"]
        assert "error" not in s, s.get("error")
        half = s["half"]
        what = f"compiled, rank {rank} at half of {s['peak']} bytes"
        assert half["oom"] is None, f"{what}: {half['oom']}"
        compiled = half["stats"]["compiled"]
        assert compiled and compiled["per_operator"] and compiled["mixed_blocks"] > 0, compiled
        assert half["stats"]["tracker"]["offloads"] > 0, half["stats"]["tracker"]
        assert half["losses"] == s["plain"]["losses"], what
        _grads_equal(half["grads"], what)


def test_keep_all_runs_out_of_memory_at_half_its_peak_on_two_ranks(ranks) -> None:
    for rank, res in ranks.items():
        assert "error" not in res["oom"], res["oom"].get("error")
        assert res["oom"]["oom"] is not None, f"rank {rank}: keep-all did not run out"


def test_distributed_data_parallel_works_on_two_ranks(ranks) -> None:
    """DistributedDataParallel needs nothing of bagualu: offload and recompute mixed in a layer
    give plain DDP's losses and gradients bit for bit."""
    for rank, res in ranks.items():
        s = res["ddp"]
        assert "error" not in s, s.get("error")
        t = s["stats"]["tracker"]
        assert t["offloads"] > 0 and t["recomputes"] > 0, t
        assert s["losses"] == s["plain_losses"]
        _grads_equal(s["grads"], f"DDP rank {rank}")


def test_fsdp2_inside_pipeline_stages_on_two_ranks(ranks) -> None:
    """FSDP2 inside the stages of torch's Schedule1F1B (examples/unmodified_pipeline.py
    --fsdp: a pp=2 x dp=1 mesh): at half of each rank's keep-all peak bagualu plans and
    mitigates on both ranks, nothing runs out of memory, and the last stage's losses are plain
    PyTorch's (with the same FSDP2 stages) bit for bit; keep-all's peak is that of the same
    stages without FSDP2 on both ranks: no gathered parameter was counted."""
    for rank, res in ranks.items():
        s = res["pipeline_stages"]
        assert "error" not in s, s.get("error")
        assert s["ooms"] == 0 and s["mitigated"] > 0 and s["plans"] > 0, (rank, s)
    last = ranks[1]["pipeline_stages"]
    assert len(last["plain"]) == 2 and last["bagualu"] == last["keep_all"] == last["plain"]
    for rank, res in ranks.items():
        s = res["pipeline_stages"]
        assert s["peak"] == s["peak_without_fsdp"], (rank, s["peak"], s["peak_without_fsdp"])


def test_legacy_fully_sharded_data_parallel_is_refused() -> None:
    """FSDP1 is refused at instrument with a message that names fully_shard; nothing stays
    installed."""
    require_libs()
    from torch.distributed.fsdp import FullyShardedDataParallel
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = unmodified.build("qwen3_moe", layers=2)
        wrapped = FullyShardedDataParallel(model, device_id=torch.device("cpu"))
        bagualu.install(capacity="64MiB", governor="none", log_iterations=False)
        with pytest.raises(bagualu.InstrumentError, match=r"legacy .*FullyShardedDataParallel"
                                                          r".*fully_shard \(FSDP2\)"):
            bagualu.instrument(wrapped)
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules()
                       if not isinstance(m, FullyShardedDataParallel))
        bagualu.instrument(unmodified.build("qwen3_moe", layers=2))  # the runtime is free
    finally:
        dist.destroy_process_group()


def test_a_recompute_waits_for_fsdp2_to_gather_its_parameters() -> None:
    """Sharding.ready on a real FSDP2 model (a world of one rank): between forwards the blocks'
    parameters are sharded and nothing can be rerun (an early, scheduled rerun is NotReady; one
    on demand is a clear error); in a block's backward its modules can be rerun on demand, and
    ahead of time too except the FSDP2 block itself, whose hooks would all-gather."""
    require_libs()
    require_fsdp2_on_cpu()
    import fsdp_ranks
    from bagualu.enforce.order import PointIssuer
    from bagualu.errors import NotReady
    from bagualu.vocabulary import Op
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = unmodified.build("qwen3_moe", layers=2)
        blocks = fsdp_ranks.shard(model, reshard=True, prefetch=False)
        bagualu.install(capacity="64MiB", policy="keep-all", governor="none",
                        pipeline_stages=1, micro_batches=1, log_iterations=False)
        bagualu.instrument(model)
        rt = bagualu.current()
        sharding = rt.sharding
        mlp, op = blocks[0].mlp, Op("mlp", "other", 0)
        assert sharding.active and not sharding.ready(mlp, scheduled=False)
        with pytest.raises(bagualu.BagualuError, match="FSDP2 holds its parameters sharded"):
            rt.before_rerun(op, mlp)
        rt.tracker.issuer = PointIssuer(rt.enforcer.scheduler, None, lambda: None)
        rt.tracker.issuer.issuing = True  # as while the enforcer carries out a piece
        with pytest.raises(NotReady):
            rt.before_rerun(op, mlp)
        assert rt.tracker.counters["rerun_waits"] == 1
        rt.tracker.issuer = None
        seen = []

        def in_backward(m, grad_output):
            seen.append((sharding.ready(mlp, False), sharding.ready(mlp, True),
                         sharding.ready(blocks[0], False), sharding.ready(blocks[0], True)))
        mlp.register_full_backward_pre_hook(in_backward)
        bagualu.begin_iteration()
        with bagualu.forward(0):
            loss = unmodified.loss_of(model, unmodified.batches(1)[0])
        with bagualu.backward(0):
            loss.backward()
        bagualu.end_iteration()
        assert seen == [(True, True, True, False)], seen
        assert not sharding.ready(mlp, scheduled=False)  # resharded after the backward
    finally:
        dist.destroy_process_group()


def test_a_scheduled_recompute_that_must_wait_is_skipped_and_runs_on_demand() -> None:
    """Through the enforcer's stream scheduler (the C ABI): a recompute piece whose
    regenerator says NotReady is skipped, the tensor stays dropped with its regenerator, and
    the next acquire regenerates it."""
    require_libs()
    from bagualu.errors import NotReady
    bagualu.install(capacity="16MiB", governor="none", log_iterations=False)
    enf = bagualu.current().enforcer
    data = torch.arange(1024, dtype=torch.float32)
    again = data.clone()
    h = enf.register(data.untyped_storage(), torch.float32, 3, 5, graph_tensor=0)
    calls = []

    def regenerate() -> int:
        calls.append(len(calls))
        if len(calls) == 1:
            raise NotReady("not yet")
        return again.untyped_storage().data_ptr()
    enf.drop(h, regenerate)
    enf.scheduler.begin([{"chain": "R", "stage": 0, "round": 0, "resource": "compute",
                          "first": 0, "last": 10}], -1, 5)
    enf.scheduler.finish()
    assert calls == [0] and enf.scheduler.skipped_pieces == 1
    assert enf.vocab.placement[enf.query(h).placement] == "dropped"
    enf.recompute(h)
    assert calls == [0, 1] and enf.stats()["recomputes"] == 1


def test_compiled_recompute_variants_under_fsdp2_on_two_ranks(ranks) -> None:
    """Every block compiled, then fully_shard, Qwen3-MoE, install(compiled_recompute="auto")
    (the experts' group: two compiled variants): layer 0's experts forced to recompute and
    the q projection offloaded in every plan, so each forward after the capture runs layer
    0's block through the experts' variant and the others through the plain one; both
    variants ran on each rank (stats()["compiled"]["recompute"]), the experts recomputed
    beside an offloaded operator in the same blocks, nothing of theirs stashed, and plain
    compiled FSDP2's losses and gradient shards bit for bit (the run adds about 4 s to the
    ranks' fixture)."""
    for rank, res in ranks.items():
        s = res["compiled"]
        assert "error" not in s, s.get("error")
        r = s["recompute"]
        what = f"compiled recompute variants, rank {rank}"
        assert r["oom"] is None, f"{what}: {r['oom']}"
        rc = r["stats"]["compiled"]["recompute"]
        assert rc["groups"] == [["mlp.experts", "mlp.experts.act_fn"]], rc
        calls = rc["calls"]
        assert calls.get("none", 0) > 0 and calls.get("mlp.experts+mlp.experts.act_fn", 0) > 0, \
            f"{what}: not both variants ran: {calls}"
        assert rc["operators_recomputed"] > 0 and rc["mixed_blocks"] > 0, rc
        assert rc["leftover"] == 0, rc
        # the experts' variant compiled in this run, its joint pass tagging their nodes
        assert rc["tagged"].get("mlp.experts+mlp.experts.act_fn", 0) > 0, rc
        assert r["stats"]["tracker"]["offloads"] > 0, r["stats"]["tracker"]
        assert r["losses"] == s["plain"]["losses"], what
        _grads_equal(r["grads"], what)
