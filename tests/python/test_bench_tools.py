"""The benchmark tools whose figures docs/benchmarks/same-capacity.md and hot-path.md give:
pooling same-capacity runs (bench_unmodified.py --pool) and the shares of a py-spy profile
(bench/python/spy_shares.py), their results on known input and exit 2 on bad input."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import bagualu
from bagualu import vocabulary
import bench_unmodified
import unmodified
from conftest import require_libs

ROOT = Path(__file__).resolve().parents[2]


def _spy_shares():
    spec = importlib.util.spec_from_file_location("spy_shares",
                                                  ROOT / "bench" / "python" / "spy_shares.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _same_capacity(path: Path, plain, bagualu, ckpt, width: int = 4) -> str:
    runs = {"plain": {"ms": plain}, "bagualu": {"ms": bagualu},
            "checkpoint every block": {"ms": ckpt}}
    paired = bench_unmodified._paired({k: v["ms"] for k, v in runs.items()})
    path.write_text(json.dumps({"device": "cpu", "width": width, "seq": 128, "spike": 0,
                                "models": {"m": {"runs": runs, "paired": paired}}}))
    return str(path)


def test_pool_pools_rounds_of_several_files(tmp_path, capsys) -> None:
    a = _same_capacity(tmp_path / "a.json", [100, 200], [110, 240], [150, 300])
    b = _same_capacity(tmp_path / "b.json", [300], [330], [400])
    assert bench_unmodified.pool([a, b]) == 0
    out = capsys.readouterr().out
    # plain median of 100, 200, 300: 200; bagualu of 110, 240, 330: 240 -> 1.20x
    assert "| m | plain | 3 | 200.0 (100.0-300.0) | 1.00x | 1.50x |" in out
    assert "| m | bagualu | 3 | 240.0 (110.0-330.0) | 1.20x | 1.25x |" in out
    # paired per round: 1.10, 1.20, 1.10 -> median 1.10 over 3
    assert "bagualu/plain 1.10x (1.10-1.20) over 3" in out


def test_under_a_spike_bagualus_rows_compare_with_the_baseline_of_the_same_experts(
        tmp_path, capsys) -> None:
    # Under --spike plain and checkpointing compute every expert, bagualu's policies this
    # rank's only: bagualu's ratio is over the keep-all baseline that computes those.
    runs = {"plain": {"ms": [400, 400]}, "bagualu": {"ms": [330, 360]},
            "checkpoint every block": {"ms": [600, 600]},
            bench_unmodified.EP_BASELINE: {"ms": [300, 300]}}
    paired = bench_unmodified._paired({k: v["ms"] for k, v in runs.items()}, spike=16)
    assert paired == {"bagualu/keep-all, room to spare": pytest.approx([1.1, 1.2])}
    # Without a spike the same times pair bagualu with plain, and checkpointing with bagualu.
    assert set(bench_unmodified._paired({k: v["ms"] for k, v in runs.items()})) == {
        "bagualu/plain", "checkpoint/bagualu"}
    # With offload-all beside it, bagualu over offload-all too (issue 43's bar), round by round.
    with_offload = {**{k: v["ms"] for k, v in runs.items()}, "offload-all": [300, 400]}
    assert bench_unmodified._paired(with_offload, spike=16) == {
        "bagualu/keep-all, room to spare": pytest.approx([1.1, 1.2]),
        "bagualu/offload-all": pytest.approx([1.1, 0.9])}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"device": "cpu", "width": 4, "seq": 128, "spike": 16,
                                "models": {"m": {"runs": runs, "paired": paired}}}))
    assert bench_unmodified.pool([str(path)]) == 0
    out = capsys.readouterr().out
    assert "| m | bagualu | 2 | 345.0 (330.0-360.0) | 1.15x of keep-all, room to spare |  |" in out
    assert "| m | plain | 2 | 400.0 (400.0-400.0) | 1.00x | 1.50x |" in out


def test_pool_rejects_a_file_that_is_not_one_and_another_setup(tmp_path, capsys) -> None:
    a = _same_capacity(tmp_path / "a.json", [100], [110], [150])
    bad = tmp_path / "bad.json"
    bad.write_text('{"device": "cpu"}')
    assert bench_unmodified.pool([a, str(bad)]) == 2
    assert "bad.json: not a --same-capacity --json-out file" in capsys.readouterr().err
    other = _same_capacity(tmp_path / "w8.json", [100], [110], [150], width=8)
    assert bench_unmodified.pool([a, other]) == 2
    assert "pool files of one setup" in capsys.readouterr().err
    assert bench_unmodified.pool([str(tmp_path / "missing.json")]) == 2


def test_spy_shares_by_the_outermost_bagualu_frame(tmp_path, capsys, monkeypatch) -> None:
    raw = tmp_path / "p.raw"
    raw.write_text(
        "main (one.py:1);train (unmodified.py:2);pack (bagualu/capture/tracker.py:3);"
        "alloc (bagualu/enforce/device.py:4) 30\n"
        "main (one.py:1);train (unmodified.py:2);mm (torch/functional.py:9) 70\n"
        "main (one.py:1);build (unmodified.py:5) 500\n"  # outside train(): not counted
        " 40\n")  # samples with no Python frame: not counted either
    spy = _spy_shares()
    monkeypatch.setattr("sys.argv", ["spy_shares", str(raw)])
    assert spy.main() == 0
    out = capsys.readouterr().out
    assert "| mm (functional.py) | 70.0% |" in out
    assert "| bagualu: pack | 30.0% |" in out
    assert "| samples inside train | 100 |" in out


@pytest.mark.parametrize("text", ["not a profile\n", "main (one.py:1);build (u.py:5) 3\n"])
def test_spy_shares_bad_input_is_exit_2(tmp_path, capsys, monkeypatch, text) -> None:
    raw = tmp_path / "bad.raw"
    raw.write_text(text)
    spy = _spy_shares()
    monkeypatch.setattr("sys.argv", ["spy_shares", str(raw)])
    assert spy.main() == 2
    err = capsys.readouterr().err
    assert "bad.raw" in err and ("raw format" in err or "no sample inside train()" in err)


def test_train_of_an_unknown_policy_is_exit_2(capsys, monkeypatch) -> None:
    monkeypatch.setattr("sys.argv", ["bench_unmodified", "--train", "keep-most"])
    assert bench_unmodified.main() == 2
    assert "unknown --train policy 'keep-most'" in capsys.readouterr().err


def test_copies_alone_time_the_runs_copies_and_none_without_them() -> None:
    # A run without bagualu (no stats) or without moves has no copies to time.
    assert bench_unmodified._copies_alone_ms({"oom": None}, 3) is None
    still = {"offloads": 0, "reloads": 0, "bytes_d2h": 0, "bytes_h2d": 0}
    assert bench_unmodified._copies_alone_ms({"stats": {"tracker": still}}, 3) is None
    moved = {"offloads": 30, "reloads": 30, "bytes_d2h": 30 << 16, "bytes_h2d": 30 << 16}
    ms = bench_unmodified._copies_alone_ms({"stats": {"tracker": moved}}, 3)
    assert ms is not None and ms > 0
    assert bench_unmodified._range_cell([]) == ""
    assert bench_unmodified._range_cell([2.0, 1.0, 3.0]) == "2.0 (1.0-3.0)"


def _bench_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "python" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sim_against_run_needs_the_plans_the_run_was_served(tmp_path, capsys) -> None:
    """Issue 42: the bagualu row replays MODEL.plans.json; a folder without it is exit 2 naming
    the file, and a plans file with nothing after the warm-up names that."""
    sim = _bench_script("sim_against_run")
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    (graphs / "m.json").write_text(json.dumps({"micro_batches": 4, "pp": 4}))
    (graphs / "m.capacity").write_text("1000\n")
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"models": {"m": {"warmup_iterations": 1, "runs": {
        "plain": {"ms": [1.0]}, "bagualu": {"ms": [1.2]}}}}}))
    argv = ["--sim", str(tmp_path / "no-sim"), "--graphs", str(graphs), "--run", str(run),
            "--calibration", str(tmp_path / "c.json")]
    assert sim.main(argv) == 2
    assert "m.plans.json" in capsys.readouterr().err
    (graphs / "m.plans.json").write_text(json.dumps(
        {"format": "bgl-served-plans", "version": 1, "iterations": [{"plans": []}]}))
    assert sim.main(argv) == 2
    assert "no iteration after the warm-up's 1" in capsys.readouterr().err


def test_host_costs_refuses_a_missing_calibration(tmp_path, capsys) -> None:
    host_costs = _bench_script("host_costs")
    assert host_costs.main(["--calibration", str(tmp_path / "none.json"), "-o",
                            str(tmp_path / "out.json")]) == 2
    assert "none.json: not found" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_same_capacity_policies_by_name_and_a_typo_is_exit_2(capsys, monkeypatch) -> None:
    """Issue 42: --policies takes the names with a comma in them (the worst-load plan's, the
    spike's baseline), adds plain, the spike's baseline and the bagualu run the worst-load plan
    is taken from; a typo is exit 2 naming the known ones before anything runs."""
    chosen = bench_unmodified.chosen_policies
    assert chosen("bagualu, worst-load plan,static-under", 0) == (
        "plain", "bagualu", bench_unmodified.WORST_LOAD, "static-under")
    assert chosen(bench_unmodified.SELECTIVE, 16) == (
        "plain", bench_unmodified.SELECTIVE, bench_unmodified.EP_BASELINE)
    assert chosen("", 0) == bench_unmodified.SAME_CAPACITY
    monkeypatch.setattr("sys.argv", ["bench_unmodified", "--same-capacity", "--policies",
                                     "bagualu,offload-al"])
    assert bench_unmodified.main() == 2
    err = capsys.readouterr().err
    assert "unknown policies ['offload-al']" in err
    assert "known: plain, bagualu," in err and ("bagualu, worst-load plan, bagualu, every point "
                                                "at the worst load, static-under") in err
    assert chosen(bench_unmodified.WORST_POINTS, 0) == (
        "plain", "bagualu", bench_unmodified.WORST_POINTS)


def test_selective_keeps_the_outputs_of_matmul_kinds_and_recomputes_the_rest() -> None:
    kinds = bagualu.operators(unmodified.build("qwen2_moe"))
    forced = bench_unmodified.selective_forced(kinds)
    assert set(forced) == set(kinds)
    # the kinds named are the planner's (a misspelt one would keep nothing of its kind)
    assert set(bench_unmodified.MATMUL_KINDS) <= set(vocabulary.KINDS)
    # by kind, not by name: the shared expert's projections and gate, the routed experts and
    # attention are kept; its activation, the norms and the dispatch are recomputed
    assert forced["mlp.shared_expert.up_proj"] == forced["mlp.experts"] == "keep"
    assert forced["self_attn"] == forced["mlp.gate"] == "keep"
    assert forced["mlp.shared_expert.act_fn"] == forced["input_layernorm"] == "recompute"
    assert forced["mlp"] == forced["mlp.experts.act_fn"] == "recompute"


def test_the_worst_load_plan_is_the_runs_static_plan_or_a_clear_error() -> None:
    r = {"worst_load_plan": {"load_factor": 2.5, "strategies": {"L0.x": "recompute"}}}
    assert bench_unmodified.worst_load_plan(r) == ({"L0.x": "recompute"}, 2.5)
    for bad in ({}, {"worst_load_plan": {"load_factor": 1.0, "strategies": {}}}):
        with pytest.raises(ValueError, match="no worst-load plan"):
            bench_unmodified.worst_load_plan(bad)


def test_static_under_and_the_worst_load_plan_at_half_the_peak_on_qwen2_moe() -> None:
    """The table's static rows on its third model family (Qwen2-MoE, a shared expert behind a
    gate of its own): static-under finishes at half of keep-all's peak without a spike (its
    capture recomputes, as the plan it has not yet can't move anything on pressure) and runs
    out of memory with one; the planner's plan for the highest load bagualu's run saw
    (bagualu.static_plan), forced on every micro-batch, moves something and fits, the spike's
    included."""
    require_libs()
    name, kw = "qwen2_moe", {"micro_batches": 8}
    cap = unmodified.keep_all_peak(name, ep=False, **kw) // 2
    under = bench_unmodified._run(name, "static-under", cap, {}, 2, dict(kw, ep=False))
    assert under["oom"] is None, under["oom"]
    assert max(ln["peak_bytes"] for ln in under["lines"]) <= cap
    assert under["lines"][-1]["strategies"]["recompute"] > 0
    ours = bench_unmodified._run(name, "bagualu", cap, {}, 2, dict(kw, ep=False),
                                  worst_plan=True)
    assert ours["oom"] is None, ours["oom"]
    plan, load = bench_unmodified.worst_load_plan(ours)
    assert load >= 1.0 and any(s != "keep" for s in plan.values())
    worst = bench_unmodified._run(name, bench_unmodified.WORST_LOAD, cap,
                                  {bench_unmodified.WORST_LOAD: plan}, 2, dict(kw, ep=False))
    assert worst["oom"] is None, worst["oom"]
    assert worst["lines"][-1]["strategies"]["keep"] < sum(worst["lines"][-1]["strategies"].values())
    spiked = dict(kw, ep=True, spike_every=8, spike_on_rank=True)
    cap = unmodified.keep_all_peak(name, **spiked) // 2
    under = bench_unmodified._run(name, "static-under", cap, {}, 2, spiked)
    assert under["oom"] is not None and "out of memory" in under["oom"]
    ours = bench_unmodified._run(name, "bagualu", cap, {}, 2, spiked, worst_plan=True)
    assert ours["oom"] is None, ours["oom"]
    plan, load = bench_unmodified.worst_load_plan(ours)
    assert load == max(ln["max_load_factor"] for ln in ours["lines"]) and load >= 2.0
    worst = bench_unmodified._run(name, bench_unmodified.WORST_LOAD, cap,
                                  {bench_unmodified.WORST_LOAD: plan}, 2, spiked)
    assert worst["oom"] is None, worst["oom"]
    assert max(ln["peak_bytes"] for ln in worst["lines"]) <= cap
    assert max(ln["max_load_factor"] for ln in worst["lines"]) >= 2.0  # the spike ran
    # bagualu with every point planned for that load: no downgrade after a router, fits
    points = bench_unmodified._run(name, bench_unmodified.WORST_POINTS, cap, {}, 2, spiked, load)
    assert points["oom"] is None, points["oom"]
    assert max(ln["peak_bytes"] for ln in points["lines"]) <= cap
    assert not any(ln["downgrades"] for ln in points["lines"])
    served = [p for it in points["served_plans"]["iterations"][1:] for p in it["plans"]]
    assert served and all(p["load_factor"] >= load for p in served)


def test_static_plan_is_a_clear_error_before_the_capture_and_for_a_bad_load() -> None:
    """bagualu.static_plan: PlannerError naming what is wrong before the capture registered
    the model, for a load outside [1, 64] and on a rank with two local stages; after it, a plan with recompute only where moves
    are not asked for, naming the model's operators."""
    require_libs()
    bagualu.install(capacity="64MiB", policy="bagualu", pipeline_stages=1, micro_batches=1,
                    governor="none", log_iterations=False)
    try:
        model = unmodified.build("qwen2_moe", ep_size=1)
        bagualu.instrument(model)
        with pytest.raises(bagualu.PlannerError, match="no model registered yet"):
            bagualu.static_plan(2.0)
        x = unmodified.batches(1)[0]
        for _ in range(2):
            bagualu.begin_iteration()
            for phase, f, b in bagualu.schedule.one_f_one_b(1, 1, 0):
                bagualu.step_point(phase, f, b)
                if f is not None:
                    with bagualu.forward(f):
                        loss = unmodified.loss_of(model, x)
                if b is not None:
                    with bagualu.backward(b):
                        loss.backward()
            bagualu.end_iteration()
        for bad in (0.5, 65.0):
            with pytest.raises(bagualu.PlannerError, match=f"load_factor {bad} is not in"):
                bagualu.static_plan(bad)
        plan = bagualu.static_plan(3.0, moves=False)
        assert plan and set(plan.values()) <= {"keep", "recompute"}
        known = {f"L{i}.{op}" for i in range(3) for op in bagualu.operators(model)}
        assert set(plan) <= known
    finally:
        bagualu.uninstall()
    bagualu.install(capacity="64MiB", policy="bagualu", pipeline_stages=2, micro_batches=2,
                    chunks=2, governor="none", log_iterations=False)
    try:
        with pytest.raises(bagualu.PlannerError, match="this rank has 2 local stages"):
            bagualu.static_plan(2.0)
    finally:
        bagualu.uninstall()
