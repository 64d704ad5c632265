"""Speed of plain autoregressive decoding vs chain speculative sampling with training-free drafts.

Loads the target once and, for each prompt, runs every configuration back to back (so that machine
noise hits all of them alike); reports total tokens / total decode time, mean accepted length, and
the ratio to autoregressive decoding measured in the same run. The full benchmark harness
(``verispec bench``) supersedes this script for anything beyond the core numbers.

    python scripts/core_speed.py --drafts layerskip:8 ngram --temperatures 0 0.6 1.0 --prompts 6 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from verispec import CausalLM, Tree, generate, get_verifier
from verispec.cli import build_drafter
from verispec.datasets import spec_bench_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafts", nargs="+", default=["layerskip:8"], help="--draft specs as in verispec generate")
    ap.add_argument("--gamma", type=int, default=5, help="chain length")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0])
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    target = CausalLM.load(args.target)
    configs = [("ar", "none")] + [(f"chain+{d}", d) for d in args.drafts]
    totals = defaultdict(lambda: [0, 0.0, 0, 0])  # tokens, seconds, steps, accepted
    for T in args.temperatures:
        for i, prompt in enumerate(text for _, text in spec_bench_prompts(args.prompts)):
            for name, spec in configs:
                drafter = build_drafter(spec, target)
                tree = Tree.root_only() if spec == "none" else Tree.chain(args.gamma)
                r = generate(target, drafter, get_verifier("chain"), prompt, tree=tree,
                             max_new_tokens=args.max_new_tokens, temperature=T, seed=args.seed + i)
                t = totals[(T, name)]
                t[0] += r.num_tokens
                t[1] += r.wall_s - r.prefill_s
                t[2] += len(r.steps)
                t[3] += sum(s.accepted_length for s in r.steps)
    print("| T | method | tokens/s | mean accepted length | speed vs ar |\n|---|---|---|---|---|")
    for T in args.temperatures:
        base = totals[(T, "ar")][0] / totals[(T, "ar")][1]
        for name, _ in configs:
            tok, sec, steps, acc = totals[(T, name)]
            print(f"| {T} | {name} | {tok / sec:.1f} | {acc / steps:.2f} | {tok / sec / base:.2f}x |")


if __name__ == "__main__":
    main()
