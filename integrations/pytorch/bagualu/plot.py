"""The memory picture: one recorded iteration's activation bytes over time (timeline.py),
planned against actual, the capacity, each micro-batch's forward band with its strategies,
spikes and downgrades marked; SVG, PNG or PDF by the file's extension.

    bagualu.plot_iteration("iteration.svg")              # the last bagualu.record_iteration()
    python -m bagualu.plot recorded.json -o iteration.svg

matplotlib is optional and imported only here, when drawing: without it plot_iteration writes
the recorded series as JSON and CSV beside the asked path and says so (a .json or .csv path
writes only the data)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from .errors import BagualuError
from .timeline import SPIKE, Recording, last_recording

log = logging.getLogger("bagualu")

PICTURES = (".svg", ".png", ".pdf")
DATA = (".json", ".csv")
MIB = float(1 << 20)
# The series as drawn: recording key -> (the line's gid in an SVG, legend label, style).
LINES = {
    "actual_bytes": ("actual", "actual: activation bytes the allocator holds",
                     dict(color="black", linewidth=1.6)),
    "layer_bytes": ("layer", "actual: the layers' bytes once plans are carried out",
                    dict(color="tab:blue", linewidth=1.2)),
    "planned_bytes": ("planned", "planned: the plans' bytes for the layers",
                      dict(color="tab:green", linewidth=1.4, linestyle="--")),
}
STRATEGY_LETTERS = (("keep", "K"), ("offload", "O"), ("fp8", "F"), ("recompute", "R"))


class MatplotlibMissing(BagualuError):
    """matplotlib cannot be imported."""


def _matplotlib() -> Any:
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MatplotlibMissing(f"matplotlib is not installed ({e}); pip install matplotlib")
    return matplotlib, Figure


def drawn_series(recording: Recording) -> Dict[str, List[float]]:
    """What ``draw`` plots, by recording key: ``t_ms`` and, in MiB, each series it draws
    (planned only where the iteration was planned)."""
    series = recording.series()
    out: Dict[str, List[float]] = {"t_ms": list(series["t_ms"])}
    for key in LINES:
        if key == "planned_bytes" and not recording.planned:
            continue
        out[key] = [v / MIB for v in series[key]]
    return out


def strategy_label(counts: Dict[str, int]) -> str:
    """'K20 O4 R4': how many operators had each strategy (the ones that had none left out)."""
    return " ".join(f"{letter}{counts[s]}" for s, letter in STRATEGY_LETTERS
                    if counts.get(s)) or "-"


def draw(recording: Recording, spike_threshold: float = SPIKE,
         title: Optional[str] = None) -> Any:
    """The picture of ``recording`` as a matplotlib Figure (no pyplot: nothing global).
    Each line's gid (LINES) names it in an SVG. MatplotlibMissing without matplotlib."""
    matplotlib, Figure = _matplotlib()
    data = drawn_series(recording)
    t = data["t_ms"]
    with matplotlib.rc_context({"path.simplify": False, "svg.hashsalt": "bagualu",
                                "font.size": 8}):
        fig = Figure(figsize=(11, 5.6), layout="constrained")
        ax = fig.add_subplot(1, 1, 1)
        span = (t[-1] - t[0]) if len(t) > 1 else 1.0
        strip = ax.get_xaxis_transform()  # x in data, y in axes: the labels above the axes
        # Each micro-batch's forward as a band (spikes, a router's load factor over the
        # threshold, in orange) labelled above the axes with F, its number and its strategy
        # counts; its backward as a lighter band labelled B and its number.
        spikes = {id(m) for m in recording.spikes(spike_threshold)}
        above = 2  # characters the labels stand above the axes (the title goes over them)
        for m in recording.micro_batches:
            name = f"{m['micro_batch']}" + (f".{m['chunk']}" if m["chunk"] else "")
            if m.get("backward_ms"):
                b0, b1 = m["backward_ms"]
                ax.axvspan(b0, b1, color="tab:blue", alpha=0.07, linewidth=0, zorder=0)
                ax.text((b0 + b1) / 2, 1.01, f"B{name}", transform=strip, ha="center",
                        va="bottom", fontsize=6, color="tab:blue")
            if not m.get("forward_ms"):
                continue
            t0, t1 = m["forward_ms"]
            spike = id(m) in spikes
            ax.axvspan(t0, t1, color="tab:orange" if spike else "0.88",
                       alpha=0.45 if spike else 1.0, linewidth=0, zorder=0)
            label = f"F{name} " + strategy_label(m["strategies"])
            if spike:
                label += f" load {m['max_load_factor']:.2f}"
            upright = (t1 - t0) < 0.12 * span  # a narrow band: the label stands up
            ax.text((t0 + t1) / 2, 1.01, label, transform=strip, ha="center", va="bottom",
                    fontsize=6, rotation=90 if upright else 0)
            above = max(above, len(label) if upright else 2)
        for key, values in data.items():
            if key == "t_ms":
                continue
            gid, label, style = LINES[key]
            (line,) = ax.plot(t, values, label=label, **style)
            line.set_gid(gid)
        ax.axhline(recording.capacity_bytes / MIB, color="tab:red", linewidth=1.2,
                   label="capacity", gid="capacity")
        if recording.plan_capacity_bytes and recording.planned:
            ax.axhline(recording.plan_capacity_bytes / MIB, color="tab:red", linewidth=0.8,
                       linestyle=":", label="the planner's room for the layers",
                       gid="plan_capacity")
        downgrades = recording.downgrades()
        if downgrades:
            ax.plot([s["t_ms"] for s in downgrades], [s["actual_bytes"] / MIB for s in downgrades],
                    linestyle="none", marker="v", markersize=7, color="tab:purple",
                    label="downgrade (deferred replan after a router)", gid="downgrades")
        ax.axvspan(0, 0, color="0.88", label="forward (F: K/O/F/R operators kept, offloaded, "
                   "in FP8, recomputed)")
        ax.axvspan(0, 0, color="tab:blue", alpha=0.07, label="backward")
        if spikes:
            ax.axvspan(0, 0, color="tab:orange", alpha=0.45,
                       label=f"spike: a router's load factor > {spike_threshold:g}")
        top = max([recording.capacity_bytes / MIB] + [max(v) for k, v in data.items()
                                                      if k != "t_ms" and v])
        ax.set_ylim(0, top * 1.08)
        ax.set_xlim(t[0] if t else 0, t[-1] if len(t) > 1 else 1)
        ax.set_xlabel("time in the iteration (ms)")
        ax.set_ylabel("activation memory (MiB)")
        it = "" if recording.iteration is None else f" {recording.iteration}"
        ax.set_title(title or f"iteration{it}, policy {recording.policy} on "
                     f"{recording.device}: activation memory, planned against actual",
                     pad=8 + 3.6 * above)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), fontsize=7, ncol=3,
                  frameon=False)
    return fig


def _write_data(recording: Recording, path: Path) -> Path:
    if path.suffix.lower() == ".csv":
        return recording.write_csv(path)
    return recording.save(path)


def plot_iteration(path: Union[str, Path], recording: Optional[Recording] = None, *,
                   spike_threshold: float = SPIKE, title: Optional[str] = None) -> Path:
    """Draws ``recording`` (default: the last ``bagualu.record_iteration()`` stopped) to
    ``path``: .svg, .png or .pdf a picture, .json or .csv the recorded data. Without
    matplotlib it writes the data as .json and .csv beside ``path`` instead and logs that
    matplotlib is missing. Returns the file written (the JSON one in that case)."""
    path = Path(path)
    if recording is None:
        recording = last_recording()
        if recording is None:
            raise BagualuError("no recorded iteration: record one with "
                               "bagualu.record_iteration() first")
    suffix = path.suffix.lower()
    if suffix in DATA:
        return _write_data(recording, path)
    if suffix not in PICTURES:
        raise ValueError(f"{path}: the picture's extension is one of "
                         f"{', '.join(PICTURES + DATA)}")
    try:
        fig = draw(recording, spike_threshold, title)
    except MatplotlibMissing as e:
        data = recording.save(path.with_suffix(".json"))
        recording.write_csv(path.with_suffix(".csv"))
        log.warning("bagualu: %s: no picture at %s; the recorded series are in %s and %s",
                    e, path, data, path.with_suffix(".csv"))
        return data
    fig.savefig(path, dpi=150 if suffix == ".png" else None)
    return path


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bagualu.plot",
        description="Draws a recorded iteration (the JSON of bagualu.record_iteration(), "
                    "Recording.save or plot_iteration's .json) as SVG, PNG or PDF.")
    p.add_argument("recording", help="the recorded iteration (.json)")
    p.add_argument("-o", "--output", default="",
                   help="the picture (.svg, .png, .pdf; default: the recording's name as .svg)")
    p.add_argument("--spike", type=float, default=SPIKE,
                   help=f"load factor over which a forward is a spike (default {SPIKE:g})")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        recording = Recording.load(args.recording)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {args.recording}: {e}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else Path(args.recording).with_suffix(".svg")
    if out.resolve() == Path(args.recording).resolve():
        print(f"error: the output {out} is the recording itself", file=sys.stderr)
        return 2
    try:
        written = plot_iteration(out, recording, spike_threshold=args.spike, title=args.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(written)
    return 0 if written == out else 1


if __name__ == "__main__":
    sys.exit(main())
