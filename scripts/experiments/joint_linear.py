"""The lean forward's linear layers as four native calls a decoder layer (q, k and v stacked as one weight, o, gate and
up as one, down: ``LeanLlama._native_calls``) against the seven calls of the layers one by one (``_linear``, through
each module's plan). First whole forwards of the default model for a few batch shapes, the two ways taking turns,
with whether their logits are equal bit for bit; then the closed loops of ``ar`` and ``default`` on Spec-Bench
requests at a few concurrencies, the ways taking turns (A B B A), with whether every request's tokens are the same.
A measurement, not the benchmark.

    python scripts/experiments/joint_linear.py --concurrency 1 2 8
"""

from __future__ import annotations

import argparse

import torch

from forward_turns import forwards_in_turns, loops_in_turns  # scripts/experiments/forward_turns.py
from verispec import load
from verispec.backends import lean

WAYS = ("one by one", "four calls")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 8])
    ap.add_argument("--methods", nargs="+", default=["ar", "default"])
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="closed-loop runs of each way (A B, then B A, ...)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    joint = lean.LeanLlama._native_calls

    def switch(name: str) -> None:
        lean.LeanLlama._native_calls = joint if name == WAYS[1] else (lambda self, parts, rows: None)

    target = load("smollm2-135m")
    try:
        for seqs, rows in ((1, 1), (1, 3), (2, 1), (2, 3), (4, 1), (4, 2), (8, 1), (8, 2), (1, 128)):
            ms, same = forwards_in_turns(target, {name: lambda name=name: switch(name) for name in WAYS}, seqs, rows,
                                         turns=30 if rows < 100 else 10, skip=4 if rows < 100 else 2)
            a, b = ms.values()
            print(f"forward, {seqs} sequences x {rows} rows, 400 entries: one by one {a:.2f} ms, four calls {b:.2f} ms "
                  f"({a / b:.3f}x), logits equal: {same}", flush=True)

        loops_in_turns(target, {name: lambda name=name: switch(name) for name in WAYS}, args.methods,
                       args.concurrency, args.limit, args.max_new_tokens, args.rounds)
    finally:
        lean.LeanLlama._native_calls = joint


if __name__ == "__main__":
    main()
