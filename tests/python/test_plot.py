"""The memory picture (issue 44): bagualu.record_iteration records one iteration's activation
bytes over time, bagualu.plot_iteration draws it (python -m bagualu.plot from a recorded
JSON); the plotted series are the recorded ones, the plans' bytes match what the layers held
where the memory model holds, spikes and downgrades are marked, and without matplotlib the
series are written as JSON and CSV."""
from __future__ import annotations

import dataclasses
import logging
import re
import sys
import xml.etree.ElementTree as ET

import pytest

import bagualu
from bagualu import plot
from bagualu.timeline import SERIES, Recording, last_recording
from conftest import require_libs, small_config
from moe_train import train

RUN = dict(micro_batches=4, stages=2, governor="none", log_iterations=False)
SVG = "{http://www.w3.org/2000/svg}"


def _balanced():
    """The small MoE stage with every expert local (ep=1): each router sends its tokens'
    top-k slots to this process's experts, so every load factor is exactly 1.0."""
    return dataclasses.replace(small_config(), ep=1)


@pytest.fixture(scope="module")
def balanced(tmp_path_factory):
    """bagualu at half of keep-all's peak (the plans offload or recompute), balanced routing;
    its last iteration (the third: the first holds the capture) recorded and drawn."""
    require_libs()
    keep = train(_balanced(), "keep-all", capacity="64MiB", iterations=1, **RUN)
    assert keep["oom"] is None, keep["oom"]
    capacity = max(line["peak_bytes"] for line in keep["lines"]) // 2
    path = tmp_path_factory.mktemp("plot") / "balanced.svg"
    r = train(_balanced(), "bagualu", capacity=capacity, iterations=3, picture=str(path),
              **RUN)
    assert r["oom"] is None, r["oom"]
    rec = last_recording()
    assert rec is not None and rec.iteration == 2 and r["picture"] == str(path)
    return r, rec, path


def _svg_points(root: ET.Element, gid: str):
    """The (x, y) vertices of the line drawn with ``gid`` in an SVG matplotlib wrote."""
    group = root.find(f".//{SVG}g[@id='{gid}']")
    assert group is not None, f"no line {gid} in the SVG"
    d = group.find(f".//{SVG}path").get("d")
    nums = [float(x) for x in re.findall(r"-?\d+(?:\.\d+)?(?:e-?\d+)?", d)]
    return list(zip(nums[0::2], nums[1::2]))


def _affine(xs, ys) -> None:
    """``ys`` is ``xs`` under one affine map (the axes' transform), to SVG's precision."""
    i = max(range(len(xs)), key=lambda k: abs(xs[k] - xs[0]))
    assert xs[i] != xs[0], "a flat series says nothing"
    scale = (ys[i] - ys[0]) / (xs[i] - xs[0])
    span = max(abs(y) for y in ys) or 1.0
    for x, y in zip(xs, ys):
        assert abs(ys[0] + scale * (x - xs[0]) - y) <= 1e-3 * span + 0.02, (x, y)


def test_the_plotted_series_are_the_recorded_ones(balanced) -> None:
    r, rec, path = balanced
    series = rec.series()
    n = len(series["t_ms"])
    assert n == len(rec.samples) >= 4 * RUN["micro_batches"]  # point, forward, backward ends
    assert series["t_ms"] == sorted(series["t_ms"])
    # The figure: each line's data is the recorded series (MiB).
    fig = plot.draw(rec)
    lines = {ln.get_gid(): ln for ln in fig.axes[0].get_lines() if ln.get_gid()}
    assert {"actual", "layer", "planned", "capacity"} <= set(lines), set(lines)
    for key in SERIES:
        gid = plot.LINES[key][0]
        assert list(lines[gid].get_xdata()) == series["t_ms"]
        assert list(lines[gid].get_ydata()) == [v / plot.MIB for v in series[key]]
    assert list(lines["capacity"].get_ydata()) == [rec.capacity_bytes / plot.MIB] * 2
    # The file the example wrote: SVG that parses, each series' vertices the recorded values
    # under the axes' transform (time on x, bytes on y).
    root = ET.parse(path).getroot()
    assert root.tag == f"{SVG}svg"
    for key in SERIES:
        pts = _svg_points(root, plot.LINES[key][0])
        assert len(pts) == n, (key, len(pts), n)
        _affine(series["t_ms"], [p[0] for p in pts])
        _affine(series[key], [p[1] for p in pts])
    # One band per micro-batch forward, with its strategy counts: the plans moved things.
    assert len(rec.micro_batches) == RUN["micro_batches"]
    assert all(m["planned"] and m["forward_ms"] and m["backward_ms"] for m in rec.micro_batches)
    moved = sum(m["strategies"]["offload"] + m["strategies"]["recompute"] +
                m["strategies"]["fp8"] for m in rec.micro_batches)
    assert moved > 0, [m["strategies"] for m in rec.micro_batches]
    assert rec.line is not None and rec.line["iteration"] == 2
    assert max(series["actual_bytes"]) <= rec.capacity_bytes


def test_planned_within_1_5_percent_of_actual_where_the_model_holds(balanced) -> None:
    """Where the memory model holds, the plans' bytes are within 1.5% of what the layers held
    once the plans were carried out: each forward's, and at every sample the live
    micro-batches' together. It holds here because every load factor is 1.0 (each plan, made
    at the last forward's load, is made at its own forward's load); the planner's stage graph
    was built from this model's capture (its keep-all bytes are the bytes PyTorch saves, as
    test_example.py's accuracy test shows); and nothing but the plans moved activations (no
    pressure eviction, no downgrade: the plan made is the plan carried out). The stage's
    output (the last layer's, saved only by the head) is outside the layers for the records
    as for the planner (Record.in_layers); before, the records counted it in and every
    forward held one hidden state more than its plan."""
    _, rec, _ = balanced
    assert not rec.downgrades() and all(s["evictions"] == 0 for s in rec.samples)
    for m in rec.micro_batches:
        assert m["load_factor"] == m["max_load_factor"] == 1.0, m
        assert m["evictions"] == 0 and m["downgrades"] == 0, m
        held = m["actual_bytes"]
        assert abs(m["predicted_bytes"] - held) <= 0.015 * held, m
    finished = set()  # micro-batches whose forward ended and whose backward has not
    compared = 0
    for s in rec.samples:
        if s["event"] == "forward_end":
            finished.add(s["micro_batch"])
        elif s["event"] == "backward_end":
            finished.discard(s["micro_batch"])
        held = s["layer_bytes"]
        if held > 0:
            assert abs(s["planned_bytes"] - held) <= 0.015 * held, (s, len(finished))
            compared += 1
    assert compared >= 2 * RUN["micro_batches"]
    # The allocator holds the layers' bytes and those outside them (embedding, head, loss).
    assert all(s["actual_bytes"] >= s["layer_bytes"] for s in rec.samples)


def test_a_spike_and_its_downgrade_are_marked(tmp_path) -> None:
    """The example's spike (2.6x every 6th micro-batch, 1.5 MiB: static-under runs out of
    memory there) in the recorded iteration: its forward is a spike band, the router's
    deferred replan a downgrade marker."""
    require_libs()
    path = tmp_path / "spike.png"
    r = train(small_config(), "bagualu", capacity="1.5MiB", iterations=2, spike_size=2.6,
              spike_every=6, picture=str(path), **RUN)
    assert r["oom"] is None and r["picture_iteration"] == 1 and r["picture_spike"]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec = last_recording()
    spikes = rec.spikes()
    assert [m["micro_batch"] for m in spikes] == [1], [m["max_load_factor"]
                                                       for m in rec.micro_batches]
    downgrades = rec.downgrades()
    assert downgrades and {s["micro_batch"] for s in downgrades} == {1}
    assert spikes[0]["downgrades"] == len(downgrades)
    fig = plot.draw(rec)
    gids = {ln.get_gid() for ln in fig.axes[0].get_lines()}
    assert "downgrades" in gids
    assert [t.get_text() for t in fig.axes[0].texts if " load 2." in t.get_text()] == [
        "F1 " + plot.strategy_label(spikes[0]["strategies"]) +
        f" load {spikes[0]['max_load_factor']:.2f}"]


def test_without_matplotlib_the_series_are_written_as_data(balanced, tmp_path, monkeypatch,
                                                           caplog) -> None:
    _, rec, _ = balanced
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with caplog.at_level(logging.WARNING, logger="bagualu"):
        written = bagualu.plot_iteration(tmp_path / "it.svg", rec)
    assert written == tmp_path / "it.json" and not (tmp_path / "it.svg").exists()
    assert any("matplotlib is not installed" in m for m in caplog.messages), caplog.messages
    back = Recording.load(written)
    assert back.series() == rec.series() and back.micro_batches == rec.micro_batches
    rows = (tmp_path / "it.csv").read_text().splitlines()
    assert len(rows) == 1 + len(rec.samples) and rows[0].startswith("t_ms,event,")
    monkeypatch.undo()
    # The command line draws the recorded JSON.
    assert plot.main([str(written), "-o", str(tmp_path / "again.svg")]) == 0
    root = ET.parse(tmp_path / "again.svg").getroot()
    assert len(_svg_points(root, "planned")) == len(rec.samples)


def test_recording_is_off_unless_asked() -> None:
    """Nothing is wrapped before record_iteration() or after stop(); bad use is named."""
    require_libs()
    with pytest.raises(bagualu.BagualuError, match="not installed"):
        bagualu.record_iteration()
    rt = bagualu.install(capacity="4MiB", governor="none", log_iterations=False)
    assert "forward" not in vars(rt)
    session = bagualu.record_iteration()
    assert "forward" in vars(rt)
    with pytest.raises(bagualu.BagualuError, match="being recorded already"):
        bagualu.record_iteration()
    session.stop()
    session.stop()
    assert not {"forward", "backward", "step_point", "observe_router", "begin_iteration",
                "end_iteration"} & set(vars(rt))
    with pytest.raises(ValueError, match="extension"):
        bagualu.plot_iteration("picture.gif", session.recording)
