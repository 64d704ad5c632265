"""What free draft sources would accept at T = 0, replayed on the target's own greedy answers (no timing).

For each Spec-Bench prompt (the benchmark's first ``--limit`` of each category) the target's greedy answer is decoded
with ``ar``, then teacher-forced once to get the target's logits at every answer position. The decoding loop is
replayed on that answer: each step a source drafts after the committed text, the longest drafted path that equals
the answer is accepted, plus one token. Sources:

* ``ngram``: the prompt-lookup drafter verispec ships (``NgramDrafter``, its greedy chain);
* ``recycle``: token recycling, "token -> the target's top-k after it, the last time it was seen", updated from
  the rows of the replayed step's forward that the answer has (the root and each accepted node; a rejected node's
  row is not replayed, so the loop's table, which keeps those too, knows a little more);
* ``suffix``: the suffix drafter's chain (the longest earlier match in the context, no length limit);
* ``hybrid``: lookup where its match is at least 2 tokens long, recycling elsewhere; ``suffix+recycle`` the same
  with the suffix drafter.

Each source is replayed at several chain depths and small trees; the table prints accepted tokens per step, the
rows a step runs, and what that gives against plain decoding for a per-row cost ``--row-cost`` (a drafted row's
cost as a fraction of a one-row forward: measure it with ``scripts/experiments/drafted_rows.py``).

    python scripts/experiments/free_drafts.py --limit 3 --row-cost 0.1
"""

from __future__ import annotations

import argparse
import json

import torch

import verispec
from verispec.datasets import load_prompts
from verispec.drafters import NgramDrafter
from verispec.drafters.suffix import SuffixDrafter
from verispec.probs import Sampling
from verispec.rng import TorchRandomness
from verispec.tree import Tree


def greedy_answer(target, prompt_ids, n):
    out = verispec.generate(target, verispec.build_drafter("none", target), "chain", prompt_ids, tree="none",
                            temperature=0.0, max_new_tokens=n)
    return out.token_ids


def answer_topk(target, prompt_ids, answer, k):
    """Top-k of the target's logits after each of prompt[-1], answer[:-1] ... (row j predicts answer[j])."""
    ids = prompt_ids + answer
    state = target.new_state()
    target.prefill(state, ids[:len(prompt_ids) - 1])
    rows = ids[len(prompt_ids) - 1:]
    n = len(rows)
    out = target.forward(state, torch.tensor(rows), state.committed + torch.arange(n),
                         torch.ones(n, n, dtype=torch.bool).tril())
    return out.logits.topk(k, -1).indices  # [len(answer) + 1, k]


def replay(answer, top, prompt_ids, source, shape, table, ngram, suffix):
    """(steps, accepted drafted tokens, rows) of the loop replayed with ``source`` drafting ``shape``
    (a tuple of branching per depth, e.g. (1, 1, 1) a chain of 3, (2, 1) two chains of 2)."""
    ctx = list(prompt_ids)
    i, steps, accepted, rows = 0, 0, 0, 0
    while i < len(answer):
        use = source
        if source == "hybrid":
            use = "ngram" if ngram.match_length(ctx) >= 2 else "recycle"
        if source == "suffix+recycle":
            use = "suffix" if suffix.match_length(ctx) >= 2 else "recycle"
        paths = []  # drafted paths (lists of tokens)
        if use in ("ngram", "suffix"):
            d = (ngram if use == "ngram" else suffix).propose(ctx, Tree.parse("chain:%d" % len(shape)), Sampling(0.0), "topk", TorchRandomness(0))
            if d.num_drafted:
                path, node = [], d.tree.size - 1
                toks = d.tokens.tolist()
                while node > 0:
                    path.append(toks[node])
                    node = d.tree.parents[node]
                paths = [path[::-1][:k] for k in range(1, len(path) + 1)]
        else:
            frontier = [[]]
            for width in shape:
                nxt = []
                for p in frontier:
                    last = p[-1] if p else ctx[-1]
                    succ = table.get(last)
                    if succ is None:
                        continue
                    for x in succ[:width]:
                        nxt.append(p + [x])
                paths += nxt
                frontier = nxt
        drafted = len(paths)
        best = 0
        for p in paths:
            if answer[i:i + len(p)] == p:
                best = max(best, len(p))
        # the forward's rows: the root and each drafted node; each updates the table with the target's top-k after it
        # (the root's and the accepted nodes' rows are the answer's own; a rejected node's row we do not have: skip)
        table[ctx[-1]] = top[i].tolist()
        for j in range(best):
            if i + j + 1 < len(top):
                table[answer[i + j]] = top[i + j + 1].tolist()
        m = min(best + 1, len(answer) - i)
        ctx += answer[i:i + m]
        i += m
        steps += 1
        accepted += best
        rows += 1 + drafted
    return steps, accepted, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--row-cost", type=float, default=0.1)
    ap.add_argument("--shared", action="store_true", help="keep the recycling table across prompts")
    args = ap.parse_args()
    target = verispec.load()
    problems = load_prompts("spec-bench", args.limit)
    shapes = [(1,), (1, 1), (1, 1, 1), (1, 1, 1, 1, 1), (2,), (2, 1), (2, 1, 1), (3, 1), (4,)]
    sources = ["ngram", "suffix", "recycle", "hybrid", "suffix+recycle"]
    tally = {(s, sh): [0, 0, 0, 0] for s in sources for sh in shapes}
    shared_table: dict = {}
    for pi, prob in enumerate(problems):
        prompt_ids = target.encode_prompt(prob.prompt, chat=prob.chat)
        answer = greedy_answer(target, prompt_ids, args.max_new_tokens)
        top = answer_topk(target, prompt_ids, answer, 4)
        for s in sources:
            for sh in shapes:
                if s in ("ngram", "suffix") and any(w > 1 for w in sh):
                    continue
                table = dict(shared_table) if args.shared else {}
                steps, acc, rows = replay(answer, top, prompt_ids, s, sh, table, NgramDrafter(target.vocab_size),
                                           SuffixDrafter(target.vocab_size))
                t = tally[(s, sh)]
                t[0] += steps
                t[1] += len(answer)
                t[2] += rows
                t[3] += 1
        if args.shared:  # carry the table: the whole answer's rows
            for j, x in enumerate([prompt_ids[-1]] + answer[:-1]):
                shared_table[x] = top[j].tolist()
        print(f"{pi + 1}/{len(problems)} {prob.category}: {len(answer)} tokens", flush=True)
    print(f"{'source':8} {'shape':12} {'tok/step':>8} {'rows/step':>9} {'speedup@rc':>10}")
    rows_out = []
    for (s, sh), (steps, toks, rows, n) in tally.items():
        if not steps:
            continue
        per = toks / steps
        rps = rows / steps
        cost = 1 + args.row_cost * (rps - 1)
        print(f"{s:8} {str(sh):12} {per:8.3f} {rps:9.2f} {per / cost:10.3f}")
        rows_out.append({"source": s, "shape": sh, "tokens_per_step": per, "rows_per_step": rps,
                         "speedup": per / cost})
    print(json.dumps({"row_cost": args.row_cost, "shared": args.shared, "rows": rows_out}))


if __name__ == "__main__":
    main()
