"""Where a batched decoding step of the lean forward spends its time: a pool of B sequences of CTX entries of context
decodes one row each; the step is timed whole (median of 15), then with the attention products stubbed out
(``LeanLlama._grouped_attention`` returns zeros), then with the linear layers stubbed too. A measurement only: the
stubbed forwards compute nothing useful.

    python scripts/experiments/step_split.py --context 600 --batch 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.backends import lean, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    pool = target.state_pool(args.batch, args.context + 64)
    states = [pool.acquire() for _ in range(args.batch)]
    g = torch.Generator().manual_seed(0)
    for s in states:
        target.prefill(s, torch.randint(100, 20000, (args.context,), generator=g).tolist())
    one = torch.ones(1, 1, dtype=torch.bool)

    def median_step() -> float:
        times = []
        for _ in range(18):
            t = time.perf_counter()
            target.forward_batch(states, [torch.tensor([7])] * len(states),
                                 [torch.tensor([s.committed]) for s in states], [one] * len(states))
            times.append(time.perf_counter() - t)
            for s in states:
                target.commit(s, [])
        return statistics.median(times[3:]) * 1e3

    whole = median_step()
    lean.LeanLlama._grouped_attention = lambda self, q, *rest: q.new_zeros(q.shape)
    lean.LeanLlama._attention = lambda self, i, q, k, v, span, *rest: \
        q.new_zeros(span[1] - span[0], self.heads * self.head_dim)
    lean.LeanLlama._pooled_attention = lambda self, i, q, *rest: q.new_zeros(q.shape[0], self.heads * self.head_dim)
    no_attention = median_step()
    lean._linear = lambda x, module: x.new_zeros(x.shape[0], module.weight.shape[0])
    neither = median_step()
    print(f"{args.batch} sequences x {args.context} entries, {args.dtype}: step {whole:.1f} ms; attention "
          f"{whole - no_attention:.1f}, linear layers {no_attention - neither:.1f}, the rest {neither:.1f}")


if __name__ == "__main__":
    main()
