"""Per-step cost of each verifier on a real tree, as a fraction of one target forward over that tree.

Drafts a tree with a layer-skip draft of the default target, runs the target forward over it (timed),
then times every tree verifier on the same probabilities (median of repeats). Sampling only (T > 0).

    python scripts/experiments/verifier_overhead.py --tree 3x5 --temperature 1.0 --repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import Sampling, Tree, load
from verispec.drafters import build_drafter
from verispec.probs import logits_to_probs
from verispec.rng import TorchRandomness
from verispec.verifiers import VERIFIERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="layerskip:0-11,18-29")
    ap.add_argument("--tree", default="3x5")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompt", default="Summarize the plot of Romeo and Juliet in three sentences.")
    args = ap.parse_args()

    target = load(args.target)
    drafter = build_drafter(args.draft, target)
    sampling, tree = Sampling(args.temperature), Tree.parse(args.tree)
    prompt = target.encode_prompt(args.prompt)
    state = target.new_state()
    target.prefill(state, prompt[:-1])
    drafter.reset(prompt)
    rows = []
    for mode in ("iid", "swor", "topk"):
        draft = drafter.propose(prompt, tree, sampling, mode, TorchRandomness(0))
        drafter.commit(draft, [])
        pos = state.committed + torch.tensor(draft.tree.depths)
        fwd = []
        for _ in range(3):
            t = time.perf_counter()
            logits = target.forward(state, draft.tokens, pos, draft.tree.ancestors_mask()).logits
            fwd.append(time.perf_counter() - t)
            target.commit(state, [])
        t_fwd = statistics.median(fwd)
        p = logits_to_probs(logits, sampling)
        for spec in VERIFIERS.values():
            if spec.greedy_only or (spec.chain_only and not draft.tree.is_chain) or spec.default_children != mode:
                continue
            times = []
            for r in range(args.repeats):
                rng = TorchRandomness(r)
                t = time.perf_counter()
                spec(draft, p, rng)
                times.append(time.perf_counter() - t)
            rows.append((spec.name, mode, statistics.median(times), t_fwd))
    print(f"tree {args.tree} ({tree.size - 1} drafted nodes), vocabulary {target.vocab_size}, T = {args.temperature}")
    print("| verifier | children | verifier ms/step | target forward ms | fraction |\n|---|---|---|---|---|")
    for name, mode, tv, tf in rows:
        print(f"| {name} | {mode} | {1000 * tv:.2f} | {1000 * tf:.0f} | {100 * tv / tf:.2f}% |")


if __name__ == "__main__":
    main()
