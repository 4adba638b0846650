#!/usr/bin/env python3
"""Plots of a bgl-sim run (PNG, matplotlib), in the spirit of the paper's Figures 8 to 11.

usage: plots.py OUT_DIR [--sweep SWEEP_CSV --param NAME]

OUT_DIR is what `bgl-sim --out OUT_DIR` wrote. Writes into OUT_DIR:
  summary.png   throughput and MFU per policy (Fig. 8)
  mfu_trace.png per-iteration MFU of each policy beside the load factor (Fig. 9)
  ablation.png  L1..L4 cumulative speedup (Fig. 11), when the ablation levels ran
  memory.png    activation memory of the traced iteration, rank 0, against capacity
  timeline.png  rank 0's resources over the first steady scheduling points of the traced iteration
With --sweep, also sweep.png: MFU per policy against the swept parameter (Fig. 10), from a CSV
written by tools/bgl-sim/sweep.sh.
"""
import argparse
import csv
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def plot_summary(rows, out):
    names = [r["policy"] for r in rows]
    mfu = [100 * float(r["mfu"]) for r in rows]
    pflops = [float(r["throughput_tflops"]) / 1e3 for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].bar(names, pflops, color="tab:blue")
    ax[0].set_ylabel("throughput (PFLOP/s, whole cluster)")
    ax[1].bar(names, mfu, color="tab:green")
    ax[1].set_ylabel("MFU (%), restarts included")
    for a in ax:
        a.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "summary.png"), dpi=120)
    plt.close(fig)


def plot_trace(rows, out):
    by_policy = defaultdict(list)
    for r in rows:
        by_policy[r["policy"]].append(r)
    fig, ax = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    load_drawn = False
    for policy, rs in by_policy.items():
        it = [int(r["iteration"]) for r in rs]
        ax[0].plot(it, [100 * float(r["mfu"]) for r in rs], label=policy, lw=0.8)
        ooms = [int(r["iteration"]) for r in rs if r["oom"] == "1"]
        if ooms:
            ax[0].scatter(ooms, [0.5] * len(ooms), marker="x", s=20)
        if not load_drawn:
            ax[1].plot(it, [float(r["max_load"]) for r in rs], color="black", lw=0.8)
            load_drawn = True
    ax[0].set_ylabel("MFU (%)")
    ax[0].legend(fontsize=7, ncol=4)
    ax[1].set_ylabel("worst load factor")
    ax[1].set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mfu_trace.png"), dpi=120)
    plt.close(fig)


def plot_ablation(rows, out):
    by = {r["policy"]: float(r["total_s"]) for r in rows}
    levels = ["L1", "L2", "L3", "L4"]
    if not all(level in by for level in levels):
        return
    speedup = [by["L1"] / by[level] for level in levels]
    paper = [1.0, 1.16, 1.16 * 1.05, 1.16 * 1.05 * 1.13]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(len(levels))
    ax.bar([i - 0.2 for i in x], speedup, width=0.4, label="bgl-sim")
    ax.bar([i + 0.2 for i in x], paper, width=0.4, label="paper")
    ax.set_xticks(list(x), levels)
    ax.set_ylabel("speedup over L1")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "ablation.png"), dpi=120)
    plt.close(fig)


def plot_memory(rows, out):
    fig, ax = plt.subplots(figsize=(11, 4))
    capacity = None
    for policy in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == policy and r["rank"] == "0"]
        if not rs:
            continue
        capacity = float(rs[0]["capacity_bytes"]) / 2**30
        ax.plot([float(r["time_s"]) for r in rs], [float(r["bytes"]) / 2**30 for r in rs],
                label=policy, lw=0.8)
    if capacity is not None:
        ax.axhline(capacity, color="red", ls="--", lw=1, label="activation capacity")
    ax.set_xlabel("time in iteration (s)")
    ax.set_ylabel("activation memory, rank 0 (GiB)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "memory.png"), dpi=120)
    plt.close(fig)


def plot_timeline(rows, out, policy="L4", points=4):
    mine = [r for r in rows if r["policy"] == policy and r["rank"] == "0"]
    steady = [int(r["point"]) for r in mine if r["chain"] == "B"]
    if not steady:
        return
    first = min(steady)  # the first point that fuses a forward with a backward
    rs = [r for r in mine if first <= int(r["point"]) < first + points]
    lanes = ["compute", "comm", "d2h", "h2d"]
    colors = {"F": "tab:blue", "B": "tab:orange", "O": "tab:green", "R": "tab:red"}
    fig, ax = plt.subplots(figsize=(11, 3))
    for r in rs:
        lane = lanes.index(r["resource"]) if r["resource"] in lanes else 0
        start, end = float(r["start_s"]), float(r["end_s"])
        ax.barh(lane, end - start, left=start, color=colors.get(r["chain"], "gray"),
                edgecolor="black", lw=0.3)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("time (s)")
    ax.set_title(f"{policy}, rank 0, scheduling points {first}..{first + points - 1} "
                 "(F blue, B orange, O green, R red)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "timeline.png"), dpi=120)
    plt.close(fig)


def plot_sweep(path, param, out):
    rows = read(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == policy]
        ax.plot([r[param] for r in rs], [100 * float(r["mfu"]) for r in rs], marker="o",
                label=policy)
    ax.set_xlabel(param)
    ax.set_ylabel("MFU (%)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sweep.png"), dpi=120)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory written by bgl-sim --out")
    parser.add_argument("--sweep", help="CSV written by tools/bgl-sim/sweep.sh")
    parser.add_argument("--param", default="value", help="column of the swept parameter")
    args = parser.parse_args()
    for name in ("summary.csv", "iterations.csv", "memory.csv", "timeline.csv"):
        if not os.path.exists(os.path.join(args.out, name)):
            sys.exit(f"plots.py: {args.out}/{name} is missing; run bgl-sim --out {args.out}")
    summary = read(os.path.join(args.out, "summary.csv"))
    plot_summary(summary, args.out)
    plot_trace(read(os.path.join(args.out, "iterations.csv")), args.out)
    plot_ablation(summary, args.out)
    plot_memory(read(os.path.join(args.out, "memory.csv")), args.out)
    plot_timeline(read(os.path.join(args.out, "timeline.csv")), args.out)
    if args.sweep:
        plot_sweep(args.sweep, args.param, args.out)


if __name__ == "__main__":
    main()
