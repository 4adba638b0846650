"""bagualu as torchtitan's memory manager (issue 21): torchtitan 0.3.0's own entry point, trainer
and debug MoE models under torchrun (2 ranks, gloo), selected with ``--module
bagualu.torchtitan``; the CPU adjustments live in the harness (torchtitan_cpu.py), the
torchtitan install in .venv-torchtitan (scripts/setup-torchtitan.sh). Each run is compared with
torchtitan's own run without bagualu (activation checkpointing off, the same seed): losses
and gradient norms equal, bit for bit, on every step; bagualu plans below the keep-all peak
on every rank. The interleaved run plans against a bgl-governord the test starts (every rank of
the job registered with it); the EP run's second step is a routing spike onto one rank. The
compiled run (--compile.enable) is compared with torchtitan's own compiled run, dynamo's
counters included."""
from __future__ import annotations

import os
import re
import site
import subprocess
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from conftest import ROOT, check_torchrun, require_libs
from test_torchrun import daemon, daemon_binary  # noqa: F401  (the daemon fixture)

VENV = ROOT / ".venv-torchtitan"
HARNESS = ROOT / "tests" / "python" / "torchtitan_cpu.py"
COMMON = ["--training.local_batch_size", "2", "--training.seq_len", "64",
          "--training.steps", "2", "--training.disable_cuda_graphs", "--checkpoint.no-enable",
          "--debug.seed", "0", "--metrics.log_freq", "1"]
# The runs compare with torchtitan's own bit for bit: no plan may store an activation in FP8.
EXACT = ["--bagualu.no-allow-fp8"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2",
       "--parallelism.data_parallel_shard_degree", "1",
       "--parallelism.pipeline_parallel_microbatch_size", "1"]
LINE = re.compile(r"bagualu: iter (\d+) policy \S+ load ([\d.]+) \(max [\d.]+\) budget \S+ "
                  r"peak ([\d.]+)MiB/([\d.]+)MiB .*?offloads (\d+) .*?fp8 (\d+) "
                  r"recomputed (\d+) evictions (\d+) deferred (\d+)")
# Interleaved1F1B, 2 stages per rank (4 in all, micro-batches of 1): torchtitan's own module
# split, one decoder layer per stage (qwen3's MoE debug model has 8, all MoE: the first 4 are
# kept, which also keeps the run short; its 64 experts make each layer 38M parameters).
INTERLEAVED = ["--parallelism.pipeline_parallel_degree", "2",
               "--parallelism.data_parallel_shard_degree", "1",
               "--parallelism.pipeline_parallel_microbatch_size", "1",
               "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
               "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0",
               "layers.1", "layers.2", "layers.3,norm,lm_head"]
CAPACITY_INTERLEAVED = "16MiB"
EP2 = ["--parallelism.expert_parallel_degree", "2", "--parallelism.data_parallel_shard_degree",
       "2", "--parallelism.spmd_backend", "partial_dtensor"]
# torchtitan's compile of each decoder block (in place, fullgraph); aot_eager: inductor's C++
# compile takes about 110 s per run here on CPU, aot_eager about 10 s (docs/torchtitan.md).
COMPILE = ["--compile.enable", "--compile.components", "model", "--compile.backend", "aot_eager"]
DYNAMO = re.compile(r"\[rank(\d+)\]:HARNESS rank \d+ dynamo graphs (\d+) ops (\d+) breaks (\d+) "
                    r"reasons (.*)")


def python() -> Path:
    py = VENV / "bin" / "python"
    if not py.exists():
        raise AssertionError(f"{py} is missing: run scripts/setup-torchtitan.sh (setup-python.sh "
                             "runs it)")
    # Its torch is the base venv's (.venv); run from another venv (.venv-min's torch 2.6) these
    # tests would test that torch, not this run's.
    base = next(VENV.glob("lib/python*/site-packages/bagualu-base-venv.pth"), None)
    ours = os.path.realpath(site.getsitepackages()[0])
    if base is not None and f"'{ours}'" not in base.read_text():
        pytest.skip(f"{VENV.name} sits on another venv's torch than this run's ({ours})")
    return py


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("torchtitan-assets")
    subprocess.run([str(python()), str(HARNESS), "--assets", str(root)], check=True,
                   timeout=120)
    return root


def run(assets: Path, tmp: Path, args: List[str], harness: Tuple[str, ...] = ()) -> str:
    """One torchrun of torchtitan.train through the harness (``harness``: its own flags);
    its output."""
    require_libs()
    env = dict(os.environ, OMP_NUM_THREADS="1", BGL_CACHE_DIR=str(tmp / "cache"),
               PYTHONPATH=str(ROOT / "integrations" / "pytorch"))
    cmd = [str(python()), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--tee", "3", "--log-line-prefix-template", "[rank${rank}]:", str(HARNESS),
           str(assets), *harness, "--dump_folder", str(tmp / "out"), *COMMON, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp)
    text = out.stdout + out.stderr
    check_torchrun(out.returncode, text)
    return text


def plain_and_bagualu(assets: Path, tmp: Path, model: str, config: str, args: List[str],
                      capacity: str, governor: str, harness: Tuple[str, ...] = (),
                      ours_args: Tuple[str, ...] = (), force: str = "") -> Tuple[str, str]:
    """torchtitan's own run of ``model``/``config`` (no activation checkpointing) and the same
    through bagualu's trainer at ``capacity`` planned by ``governor`` with ``ours_args`` (and
    the harness's ``--force``, if given), FP8 off (the tests compare the two bit for bit);
    their outputs."""
    (tmp / "plain").mkdir()
    (tmp / "bagualu").mkdir()
    plain = run(assets, tmp / "plain", ["--module", model, "--config", config, *args,
                                        "activation-checkpoint:none"], harness)
    ours = run(assets, tmp / "bagualu", ["--module", "bagualu.torchtitan", "--config", config,
                                         *args, "--bagualu.capacity", capacity,
                                         "--bagualu.governor", governor, *EXACT, *ours_args],
               harness + (("--force", force) if force else ()))
    return plain, ours


def losses(text: str) -> Dict[Tuple[int, int], Tuple[float, float]]:
    """(rank, step) -> (loss, grad norm) from the harness's exact lines."""
    out = {}
    for m in re.finditer(r"HARNESS rank (\d+) step (\d+) loss (\S+) grad_norm (\S+)", text):
        out[(int(m[1]), int(m[2]))] = (float(m[3]), float(m[4]))
    return out


def lines_by_rank(text: str) -> Dict[int, List[re.Match]]:
    """bagualu's iteration lines per rank (torchrun prefixes each rank's lines)."""
    out: Dict[int, List[re.Match]] = {0: [], 1: []}
    for ln in text.splitlines():
        m = LINE.search(ln)
        r = re.match(r"\[rank(\d+)\]:", ln)
        if m and r:
            out[int(r[1])].append(m)
    return out


def dynamo_counters(text: str) -> Dict[int, Tuple[int, int, int, str]]:
    """rank -> (graphs, operations captured, graph breaks, break reasons) from the harness's
    --dynamo-counters lines."""
    return {int(m[1]): (int(m[2]), int(m[3]), int(m[4]), m[5]) for m in DYNAMO.finditer(text)}


def test_pipeline_1f1b_deepseek_v3_on_two_ranks(assets, tmp_path) -> None:
    """PP 2 with torchtitan's Schedule1F1B (2 micro-batches per step), deepseek_v3
    debugmodel: bagualu below every rank's keep-all peak plans offloads/recomputes on both
    stages, and torchtitan's losses and gradient norms are those of its run without
    bagualu, bit for bit."""
    plain, ours = plain_and_bagualu(assets, tmp_path, "deepseek_v3", "deepseek_v3_debugmodel",
                                    PP2, "10MiB", "none")
    ref, got = losses(plain), losses(ours)
    assert len(ref) == 4 and ref == got, (ref, got)
    by_rank = lines_by_rank(ours)
    for rank in (0, 1):
        lines = by_rank[rank]
        assert len(lines) == 2, (rank, [m[0] for m in lines])
        moved = sum(int(m[5]) + int(m[6]) + int(m[7]) + int(m[8]) for m in lines)
        assert moved > 0, f"rank {rank}: nothing mitigated: {[m[0] for m in lines]}"
        assert all(float(m[3]) <= float(m[4]) for m in lines)


def test_expert_parallel_with_fsdp_deepseek_v3_on_two_ranks(assets, tmp_path) -> None:
    """EP 2 with FSDP2 (dp_shard 2), deepseek_v3 debugmodel, torchtitan's all-to-all token
    dispatcher: bagualu at 28 MiB (about half of each rank's keep-all peak, 55 MiB) takes each
    rank's load factor from the tokens the dispatcher delivered (step 1: the two ranks' loads
    differ and average 1), mitigates on both ranks, and torchtitan's losses and gradient norms
    are those of its run without bagualu, bit for bit. Step 2 is a routing spike (the
    harness's --spike-step, in both runs): every token goes to EP rank 1's experts, load 2
    there and 0 on rank 0; rank 1 replans at the dispatch (a deferred replan: the forward
    was planned at step 1's load: the rest of the forward planned again at load 2, offload or
    recompute as they cost, issue 43), rank 0 does not replan."""
    plain, ours = plain_and_bagualu(assets, tmp_path, "deepseek_v3", "deepseek_v3_debugmodel",
                                    EP2, "28MiB", "none", ("--spike-step", "2"))
    ref, got = losses(plain), losses(ours)
    assert len(ref) == 4 and ref == got, (ref, got)
    by_rank = lines_by_rank(ours)
    assert all(len(by_rank[r]) == 2 for r in (0, 1)), by_rank
    loads = [float(by_rank[r][0][2]) for r in (0, 1)]
    assert loads[0] != loads[1] and abs(sum(loads) / 2 - 1.0) < 0.02, loads
    for rank in (0, 1):
        lines = by_rank[rank]
        moved = sum(int(m[5]) + int(m[6]) + int(m[7]) + int(m[8]) for m in lines)
        assert moved > 0, f"rank {rank}: nothing mitigated: {[m[0] for m in lines]}"
        assert all(float(m[3]) <= float(m[4]) for m in lines)
    quiet, spiked = by_rank[0][1], by_rank[1][1]
    assert float(spiked[2]) > 1.95 and float(quiet[2]) < 0.05, (spiked[0], quiet[0])
    # replanned, and what the revision chose moved (offloads or recomputes; FP8 is off)
    assert int(spiked[9]) > 0 and int(spiked[5]) + int(spiked[7]) > 0, spiked[0]
    assert int(spiked[6]) == 0, spiked[0]
    assert int(quiet[9]) == 0, quiet[0]                           # no replan there


def test_pipeline_interleaved_1f1b_qwen3_against_the_daemon_on_two_ranks(
        assets, tmp_path, daemon) -> None:
    """PP 2 with torchtitan's Interleaved1F1B (2 stages per rank, 2 micro-batches), qwen3's
    MoE debug model cut to 4 layers by torchtitan's module split: bagualu's chunks are each
    rank's two stages, and at 16 MiB (keep-all's peaks: 28 and 21 MiB) both ranks plan
    offloads at every step, all planned by one bgl-governord (both ranks register with it,
    as one job); torchtitan's losses and gradient norms are those of its run without
    bagualu, bit for bit."""
    plain, ours = plain_and_bagualu(assets, tmp_path, "qwen3", "qwen3_moe_debug", INTERLEAVED,
                                    CAPACITY_INTERLEAVED, daemon)
    ref, got = losses(plain), losses(ours)
    assert len(ref) == 4 and ref == got, (ref, got)
    by_rank = lines_by_rank(ours)
    for rank in (0, 1):
        lines = by_rank[rank]
        assert len(lines) == 2, (rank, [m[0] for m in lines])
        assert all(int(m[5]) > 0 for m in lines), (rank, [m[0] for m in lines])
        assert all(float(m[3]) <= float(m[4]) for m in lines)
    # Each rank registers its stage graph after the capture, and again once with the layers'
    # measured backward times (docs/planner.md, backward_ms: a new session, the first ended):
    # every session is one rank's, and each rank has its own.
    registered = re.findall(r"\[rank([01])\]:.*bagualu: registered with the governor at "
                            + re.escape(daemon) + r" \(session (\S+)\)", ours)
    by_rank_sessions = {r: {sid for rr, sid in registered if rr == r} for r in ("0", "1")}
    assert all(1 <= len(v) <= 2 for v in by_rank_sessions.values()), registered
    assert not by_rank_sessions["0"] & by_rank_sessions["1"], registered
    jobs = re.findall(r"\[rank([01])\]:.*bagualu: done: planned by the remote planner "
                      r"\(job (\S+)\)", ours)
    assert sorted(r for r, _ in jobs) == ["0", "1"] and len({j for _, j in jobs}) == 1, jobs


def test_compiled_blocks_with_expert_parallel_and_fsdp_deepseek_v3_on_two_ranks(
        assets, tmp_path) -> None:
    """torchtitan's --compile.enable (each decoder block compiled in place, fullgraph;
    aot_eager) with EP 2 and FSDP2 (dp_shard 2), deepseek_v3 debugmodel: bagualu plans each
    compiled block as one operator, adds no graph, recompile or graph break to torchtitan's
    own compiled run (dynamo's counters equal on each rank, no break in either), at 28 MiB
    (keep-all's peak under compile: 41-42 MiB per rank) offloads on both ranks, and
    torchtitan's losses and gradient norms are those of its own compiled run bit for bit.
    Its hooks on the FSDP2 units run outside dynamo (before: fullgraph failed at the first
    forward on the storages' nbytes). The compiled block saves a conjugate view (the rotary
    product's), which the binding rebuilds with its bit (before it did not, and the gradients
    differed from step 1 on: tests/python/test_binding.py holds the regression test)."""
    plain, ours = plain_and_bagualu(assets, tmp_path, "deepseek_v3", "deepseek_v3_debugmodel",
                                    EP2 + COMPILE, "28MiB", "none", ("--dynamo-counters",))
    compiled = re.findall(r"\[rank([01])\]:.*bagualu: the \d+ planned blocks of layers are "
                          r"compiled \(in place\)", ours)
    assert sorted(compiled) == ["0", "1"], compiled
    ref_dynamo, got_dynamo = dynamo_counters(plain), dynamo_counters(ours)
    assert sorted(ref_dynamo) == [0, 1] and got_dynamo == ref_dynamo, (ref_dynamo, got_dynamo)
    assert all(c[0] > 0 and c[2] == 0 for c in got_dynamo.values()), got_dynamo
    by_rank = lines_by_rank(ours)
    for rank in (0, 1):
        lines = by_rank[rank]
        assert len(lines) == 2, (rank, [m[0] for m in lines])
        moved = sum(int(m[5]) + int(m[8]) for m in lines)
        assert moved > 0, f"rank {rank}: nothing offloaded: {[m[0] for m in lines]}"
        assert all(float(m[3]) <= float(m[4]) for m in lines)
    ref, got = losses(plain), losses(ours)
    assert len(ref) == 4 and sorted(got) == sorted(ref), (ref, got)
    assert ref == got, (ref, got)


RECOMPUTED = re.compile(r"\[rank(\d)\]:.*bagualu: compiled recompute: groups (\[.*?\]), block "
                        r"calls per variant (\{.*?\}), operators recomputed (\d+), nodes tagged "
                        r"per variant \{'moe.routed_experts.inner_experts': (\d+)\}")


def test_compiled_recompute_flag_recomputes_the_experts_in_compiled_blocks(
        assets, tmp_path) -> None:
    """--bagualu.compiled_recompute auto with --bagualu.compiled_operators operators and
    torchtitan's --compile.enable (aot_eager), FSDP2 (dp_shard 2, no EP: per operator under EP
    is refused, docs/torchtitan.md), deepseek_v3 debugmodel, the experts forced to recompute
    and the attention's output projection to offload (the harness's --force; the planner's own
    choice depends on the machine's times): on each rank the experts' group is the one
    recompute group, every block call after the capture runs the experts' compiled variant,
    whose joint pass tagged the experts' nodes, and the projection's stashed tensors are
    offloaded in the same blocks (the step after the capture offloads). Both need the
    operators named through torchtitan's wrapped forwards (before, neither happened). Dynamo
    makes one graph more than torchtitan's own compiled run of the config (the MoE block's
    variant) and no break, and the losses and gradient norms are torchtitan's own compiled
    run's bit for bit. Two torchruns, torchtitan's own and bagualu's (about 50 s here)."""
    plain, ours = plain_and_bagualu(
        assets, tmp_path, "deepseek_v3", "deepseek_v3_debugmodel", COMPILE, "64MiB", "none",
        ("--dynamo-counters",),
        ("--bagualu.compiled_operators", "operators", "--bagualu.compiled_recompute", "auto"),
        "moe.routed_experts.inner_experts=recompute,attention.wo=offload")
    done = {int(m[1]): m for m in RECOMPUTED.finditer(ours)}
    assert sorted(done) == [0, 1], ours[-3000:]
    for rank, m in done.items():
        assert m[2] == "[['moe.routed_experts.inner_experts']]", m[0]
        assert m[3] == "{'moe.routed_experts.inner_experts': 5}" and int(m[4]) == 5, m[0]
        # the variant's joint pass found the experts' nodes (inside torchtitan's wrapped
        # forwards: capture/stash.py, module_path)
        assert int(m[5]) > 0, m[0]
    by_rank = lines_by_rank(ours)
    for rank in (0, 1):
        lines = by_rank[rank]
        assert len(lines) == 2, (rank, [m[0] for m in lines])
        # the step after the capture: the experts' variant, the projection offloaded beside it
        # (planned: no pressure eviction at 64 MiB)
        assert int(lines[1][5]) > 0 and int(lines[1][8]) == 0, f"rank {rank}: {lines[1][0]}"
    ref_dynamo, got_dynamo = dynamo_counters(plain), dynamo_counters(ours)
    assert sorted(ref_dynamo) == [0, 1] and sorted(got_dynamo) == [0, 1], (ref_dynamo,
                                                                          got_dynamo)
    for rank in (0, 1):
        assert got_dynamo[rank][0] == ref_dynamo[rank][0] + 1, (ref_dynamo, got_dynamo)
        assert got_dynamo[rank][2] == 0 and ref_dynamo[rank][2] == 0, (ref_dynamo, got_dynamo)
    ref, got = losses(plain), losses(ours)
    assert len(ref) == 4 and sorted(got) == sorted(ref), (ref, got)
    assert ref == got, (ref, got)
