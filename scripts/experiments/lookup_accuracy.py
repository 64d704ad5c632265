"""How often prompt lookup's top guess is the target's next token, by the length of the match it found.

Reads the greedy answers of plain decoding (`ar`, T = 0) from a benchmark's records, rebuilds each prompt's token ids
with the target's tokenizer and chat template, and at every answer position asks the lookup (`NgramDrafter`, n-grams
of up to 3 tokens) for its longest match and its most frequent continuation. This is what chose the hybrid draft's
threshold (`verispec/drafters/hybrid.py`): lookup where a match of 2 or more tokens exists, the head elsewhere.

    python scripts/experiments/lookup_accuracy.py results/speed.jsonl.gz --target smollm2-135m
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from verispec.backends.hf import CausalLM
from verispec.backends.loading import tokenizer_for
from verispec.bench.records import Results
from verispec.datasets import load_prompts
from verispec.drafters.ngram import NgramDrafter
from verispec.probs import argmax


class _Tokenizer:  # what CausalLM.encode_prompt reads: the tokenizer alone, no model
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", help="a benchmark's records (.jsonl) with `ar` at temperature 0 on Spec-Bench")
    ap.add_argument("--target", default="smollm2-135m", help="the target the records were made with (its tokenizer)")
    args = ap.parse_args()
    res = Results.load(args.records)
    holder = _Tokenizer(tokenizer_for(args.target))
    problems = {p.id: p for p in load_prompts("spec-bench")}
    lookup = NgramDrafter(vocab_size=len(holder.tokenizer))
    count = defaultdict(lambda: [0, 0])  # (category, match length) -> [positions, top guess right]
    for rec in res.prompts:
        cell = rec["cell"]
        if cell["method"] != "ar" or cell["T"] != 0 or cell["prompt"] not in problems:
            continue
        ids = CausalLM.encode_prompt(holder, problems[cell["prompt"]].prompt)
        answer = rec["token_ids"]
        for i, token in enumerate(answer):
            law = lookup._root_logits(ids + answer[:i])  # the draft's own log-counts after the context, or None
            n = lookup._match[0][0] if law is not None else 0
            right = law is not None and int(argmax(law)) == token  # its top guess (ties: the lowest token id)
            for key in ((rec["category"], n), ("all", n)):
                count[key][0] += 1
                count[key][1] += right
    print("| category | match length | positions | share of the category | top guess right |")
    print("|---|---|---|---|---|")
    totals = defaultdict(int)
    for (cat, _), (pos, _) in count.items():
        totals[cat] += pos
    for (cat, n), (pos, right) in sorted(count.items(), key=lambda kv: (kv[0][0] != "all", kv[0])):
        print(f"| {cat} | {n} | {pos} | {pos / totals[cat]:.2f} | {right / pos:.2f} |" if n else
              f"| {cat} | none | {pos} | {pos / totals[cat]:.2f} | - |")


if __name__ == "__main__":
    main()
