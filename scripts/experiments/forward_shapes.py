"""Whole forwards of the default model (float32) for a few batch shapes at the checked-out code: per shape, the median
ms of 26 forwards of S sequences of R rows each (a causal chain) after 400 entries of cache
(``forward_turns.forwards_in_turns`` with one way). For comparing two revisions whose code cannot take turns in one
process, run it in a worktree of each, alternately, and compare the medians of the same shape; the logits' bits are
compared separately (a change that claims them equal has a test). A measurement, not the benchmark.

    python scripts/experiments/forward_shapes.py --label new
"""

from __future__ import annotations

import argparse

import torch

from forward_turns import forwards_in_turns  # scripts/experiments/forward_turns.py
from verispec.backends import load

SHAPES = ((1, 1), (1, 3), (2, 1), (4, 2), (8, 1), (8, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="", help="printed first on the line (which revision this is)")
    ap.add_argument("--context", type=int, default=400)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load("smollm2-135m", dtype="float32")
    out = []
    for seqs, rows in SHAPES:
        ms, _ = forwards_in_turns(target, {args.label: lambda: None}, seqs, rows, args.context)
        out.append(f"{seqs}x{rows}: {ms[args.label]:.2f}")
    print(args.label, " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
