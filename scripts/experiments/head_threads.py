"""The EAGLE head's drafting in the loop with torch's two threads, as today, against one thread while it drafts
(``engine.propose_batch`` under ``torch.set_num_threads(1)``, two again for the target's forward). The head's first
depth costs about 2.4 ms a step in the loop against 1.27 ms when timed alone (``head_split.py``); its weights' bytes
explain little of it (``head_quantised.py``). A suspect: each of its small operators is a parallel region, and after
the target's forward and the verification the pool's second thread has gone to sleep. A timing: run it on a quiet
machine.

Per prompt (Spec-Bench, the last questions of each category), each way in turn (the order alternating prompt by
prompt), ``generate`` with a fixed greedy chain of 1: the mean drafting and whole-step milliseconds over the drafting
steps (a prompt's first step left out), and the ratio of the two ways' drafting with a 95 % bootstrap interval over
prompts.

    python scripts/experiments/head_threads.py --prompts 6
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from verispec import build_drafter, generate, load
from verispec import engine as engine_module
from verispec.datasets import spec_bench_prompts
from verispec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--depth", type=int, default=1, help="the chain drafted a step")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype="float32")
    drafter = build_drafter("eagle", target, dtype="float32")
    ids = [target.encode_prompt(p) for _, p in spec_bench_prompts(args.prompts, from_end=True)]
    original = engine_module.propose_batch
    ways = ("threads", "one thread")

    def one_thread(*a, **kw):
        torch.set_num_threads(1)
        try:
            return original(*a, **kw)
        finally:
            torch.set_num_threads(args.threads)

    draft = {w: [] for w in ways}
    whole = {w: [] for w in ways}
    for i, prompt in enumerate(ids):
        for w in (ways if i % 2 == 0 else ways[::-1]):
            engine_module.propose_batch = one_thread if w == "one thread" else original
            out = generate(target, drafter, "chain", prompt, tree=Tree.chain(args.depth), children="topk",
                           policy="fixed", max_new_tokens=args.max_new_tokens, temperature=0.0, seed=i)
            steps = [s for s in out.steps[1:] if s.draft_depth == args.depth]
            draft[w].append(statistics.fmean(s.draft_s for s in steps))
            whole[w].append(statistics.fmean(s.draft_s + s.target_s + s.verify_s for s in steps))
    engine_module.propose_batch = original
    ratios = [b / a for a, b in zip(draft[ways[0]], draft[ways[1]])]
    rnd = random.Random(0)
    boot = sorted(statistics.fmean(rnd.choices(ratios, k=len(ratios))) for _ in range(2000))
    for w in ways:
        print(f"{w}: drafting {statistics.fmean(draft[w]) * 1e3:.2f} ms, whole step "
              f"{statistics.fmean(whole[w]) * 1e3:.2f} ms (chain of {args.depth}, {len(ids)} prompts)")
    print(f"drafting, one thread / {args.threads}: {statistics.fmean(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}]")


if __name__ == "__main__":
    main()
