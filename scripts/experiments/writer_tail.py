"""How much of a corpus stage is its tail: N prompts through 64 slots of the corpus writer (``_Writer.sample``, with
features, as a round keeps them), the target's forwards timed by kind: prefills, full-batch decoding steps, and
steps with fewer live sequences (the stage waiting for its longest answers). design.md, "The draft head's corpus".

    python scripts/experiments/writer_tail.py --prompts 128
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.backends import load
from verispec.eagle.corpus import _Writer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype="bfloat16")
    w = _Writer(target, (3, 15, 27), 64, max_batch=args.slots)
    torch.manual_seed(0)
    prompts = [w.prompt([f"Write a short paragraph about topic number {i}."]) for i in range(args.prompts)]
    log: list[tuple[int, int, float]] = []  # (sequences, rows, seconds) of each forward
    forward = target.forward_batch

    def timed(states, tokens, *a, **k):
        t0 = time.perf_counter()
        out = forward(states, tokens, *a, **k)
        log.append((len(states), sum(len(x) for x in tokens), time.perf_counter() - t0))
        return out

    target.forward_batch = timed
    t0 = time.perf_counter()
    outs, _ = w.sample(prompts, args.max_new_tokens, 0.6, labels_from=[len(p) - 1 for p in prompts])
    wall = time.perf_counter() - t0
    steps = [(s, d) for s, r, d in log if r == s]  # one row per sequence: decoding
    full = [d for s, d in steps if s == args.slots]
    tail = [(s, d) for s, d in steps if s < args.slots]
    lengths = sorted(len(o) for o in outs)
    print(f"{args.prompts} prompts, {args.slots} slots: {sum(lengths)} tokens in {wall:.1f} s "
          f"({sum(lengths) / wall:.0f} tokens/s); prefills {sum(d for s, r, d in log if r != s):.1f} s; "
          f"full-batch steps {len(full)}, {sum(full):.1f} s ({args.slots * len(full) / max(sum(full), 1e-9):.0f} "
          f"tokens/s); tail steps {len(tail)}, {sum(d for _, d in tail):.1f} s "
          f"({sum(s for s, _ in tail) / max(sum(d for _, d in tail), 1e-9):.0f} tokens/s, mean live "
          f"{sum(s for s, _ in tail) / max(len(tail), 1):.1f}); answers: median {lengths[len(lengths) // 2]}, "
          f"longest {lengths[-1]} tokens")


if __name__ == "__main__":
    main()
