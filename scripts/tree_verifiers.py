"""Tree verifiers on the real default model: accepted length and per-candidate acceptance.

For each temperature and Spec-Bench prompt, every method runs on the same prompt and seed, with the
same draft and tree shape; figures come from the per-step records only (``verispec.metrics``).

    python scripts/tree_verifiers.py --tree 3x5 --temperatures 0.6 1.0 --prompts 3 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from verispec import CausalLM, Tree, generate, get_verifier
from verispec.cli import build_drafter
from verispec.datasets import spec_bench_prompts
from verispec.metrics import mean_accepted_length, per_candidate_acceptance

METHODS = ["specinfer", "resispec", "reserve", "ordered", "swor", "topk"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="layerskip:0-11,18-29")
    ap.add_argument("--tree", default="3x5")
    ap.add_argument("--methods", nargs="+", default=METHODS)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--groups", nargs="+", default=["summarization", "qa", "translation"])
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    target = CausalLM.load(args.target)
    tree = Tree.parse(args.tree)
    steps, tokens, seconds = defaultdict(list), defaultdict(int), defaultdict(float)
    prompts = spec_bench_prompts(args.prompts, tuple(args.groups))
    for T in args.temperatures:
        for i, (_, prompt) in enumerate(prompts):
            for method in args.methods:
                out = generate(target, build_drafter(args.draft, target), get_verifier(method), prompt, tree=tree,
                               max_new_tokens=args.max_new_tokens, temperature=T, seed=args.seed + i)
                steps[(T, method)] += out.steps
                tokens[(T, method)] += out.num_tokens
                seconds[(T, method)] += out.wall_s - out.prefill_s
                print(f"T={T} prompt {i} {method}: {out.mean_accepted_length:.2f}", flush=True)
    k = max(len(c) for c in tree.children)
    print(f"\ntarget {args.target}, draft {args.draft}, tree {args.tree} ({tree.size - 1} nodes), "
          f"{len(prompts)} prompts ({', '.join(args.groups)}), {args.max_new_tokens} new tokens each")
    head = " | ".join(f"cand. {i}" for i in range(1, k + 1))
    print(f"| T | method | steps | mean accepted length | tokens/s | {head} |")
    print("|---|---|---|---|---|" + "---|" * k)
    for T in args.temperatures:
        for method in args.methods:
            s = steps[(T, method)]
            pc = per_candidate_acceptance(s, k)
            cells = " | ".join("-" if x != x else f"{x:.3f}" for x in pc)
            print(f"| {T} | {method} | {len(s)} | {mean_accepted_length(s):.3f} | "
                  f"{tokens[(T, method)] / seconds[(T, method)]:.2f} | {cells} |")


if __name__ == "__main__":
    main()
