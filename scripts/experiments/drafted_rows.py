"""What the target's forward costs a batch when several of its sequences draft, against what the load-aware plan's
table says (``BatchCosts.seconds``): 8 sequences at a given context, m of them drafting a chain of d tokens, timed
alternately with the plain step of the same 8 (so a slow spell of the machine falls on both). A measurement, not the
benchmark.

    python scripts/experiments/drafted_rows.py --context 400
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load
from verispec.backends.costs import batch_costs
from verispec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=400, help="cache entries of each sequence")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    costs = batch_costs(target)
    pool = target.state_pool(args.batch, args.context + max(args.depths) + 2)
    states = [pool.acquire() if pool is not None else target.new_state() for _ in range(args.batch)]
    for s in states:
        target.prefill(s, [5] * (args.context - 1))
    root = Tree.root_only()

    def step(trees: list[Tree]) -> float:
        t = time.perf_counter()
        target.forward_batch(states, [torch.full((tr.size,), 7) for tr in trees],
                             [s.committed + torch.tensor(tr.depths) for s, tr in zip(states, trees)],
                             [tr.ancestors_mask() for tr in trees], features=(3, 15, 27))
        out = time.perf_counter() - t
        for s in states:
            target.commit(s, [])
        return out

    for _ in range(3):
        step([root] * args.batch)
    print(f"{args.batch} sequences at {args.context} entries, {args.dtype}; ms median of {args.repeats}, each drafted "
          "step timed right after a plain one")
    for d in args.depths:
        for m in (1, args.batch // 2, args.batch - 1, args.batch):
            chain = Tree.chain(d)
            trees = [chain] * m + [root] * (args.batch - m)
            plain, drafted = [], []
            for _ in range(args.repeats):
                plain.append(step([root] * args.batch))
                drafted.append(step(trees))
            rows = sum(t.size for t in trees)
            ratio = statistics.median(x / y for x, y in zip(drafted, plain))
            model = costs.seconds(rows, args.batch, d + 1, args.context) / costs.seconds(args.batch, args.batch)
            print(f"  {m} drafting {d}: plain {1000 * statistics.median(plain):.1f}, drafted "
                  f"{1000 * statistics.median(drafted):.1f} ms; drafted / plain {ratio:.3f} (the table: {model:.3f})")


if __name__ == "__main__":
    main()
