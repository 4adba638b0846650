"""Where a training loop's time goes, from py-spy's raw profiles: per profile, the share of the
samples inside ``--within`` (a function name, default ``train``) by the outermost frame of the
bagualu package on the stack (its hook, whatever it calls), else by the innermost frame (the
model's or torch's own code), side by side for several profiles (bagualu and plain PyTorch).

    py-spy record -r 250 -f raw -d 14 -p PID -o bagualu.raw   # attached after the warm-up
    python bench/python/spy_shares.py bagualu.raw plain.raw --top 12

Exit 2 with the file and line where a file is not py-spy's raw format (frames separated by
``;``, then a space and a sample count) or has no sample inside ``--within``.
"""
from __future__ import annotations

import argparse
import collections
import sys
from typing import Counter, Tuple

PACKAGE = "(bagualu/"  # how py-spy names the frames of files under integrations/pytorch/bagualu


def shares(path: str, within: str) -> Tuple[int, Counter[str]]:
    """Samples inside ``within`` and their count by frame class (see the module docstring)."""
    total, by = 0, collections.Counter()
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line:
                continue
            stack, _, count = line.rpartition(" ")
            if not count.isdigit() or (not stack and not line.startswith(" ")):
                raise ValueError(f"{path}:{number}: not py-spy's raw format (frames;... count)")
            if not stack:  # samples with no Python frame (py-spy writes " N" for them)
                continue
            frames = stack.split(";")
            if not any(fr.startswith(within + " (") for fr in frames):
                continue
            n = int(count)
            total += n
            ours = next((fr for fr in frames if PACKAGE in fr), None)
            if ours is not None:
                by["bagualu: " + ours.split(" (")[0]] += n
            else:
                leaf = frames[-1]
                by[leaf.split(" (")[0] + " (" + leaf.rsplit("/", 1)[-1].split(":")[0] + ")"] += n
    if total == 0:
        raise ValueError(f"{path}: no sample inside {within}()")
    return total, by


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profiles", nargs="+", help="py-spy record -f raw outputs")
    ap.add_argument("--within", default="train", help="count only samples inside this function")
    ap.add_argument("--top", type=int, default=12, help="rows, largest first")
    args = ap.parse_args()
    try:
        got = [shares(p, args.within) for p in args.profiles]
    except (OSError, ValueError) as e:
        print(f"spy_shares: {e}", file=sys.stderr)
        return 2
    keys = sorted({k for _, by in got for k in by},
                  key=lambda k: -sum(by[k] / total for total, by in got))[:args.top]
    print("| frames | " + " | ".join(args.profiles) + " |")
    print("| --- |" + " --- |" * len(got))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{by[k] / total:.1%}" for total, by in got) + " |")
    print("| bagualu, all frames | " + " | ".join(
        f"{sum(n for k, n in by.items() if k.startswith('bagualu: ')) / total:.1%}"
        for total, by in got) + " |")
    print("| samples inside " + args.within + " | " + " | ".join(str(t) for t, _ in got) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
