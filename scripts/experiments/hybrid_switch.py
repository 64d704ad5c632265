"""Which draft source to use where: on the held-out Spec-Bench answers of ``verispec eval-draft`` (the target's greedy
answers, response positions only), at every step start the greedy chain each source would have had accepted --
prompt lookup (``NgramDrafter``: its most frequent continuation, node after node) and a draft head (teacher forced:
the head's depths 1..D on the target's features, its own features from depth 2 on, exactly as ``eval-draft``) --
binned by the length of the longest earlier match of the context's last tokens, which is what the hybrid draft
switches on (``HybridDrafter.min_match``). A count, not a timing: it runs beside other work.

Each bin reports, for chains of 1..D drafted tokens, the mean tokens each source would have had accepted (the
accepted drafted tokens; a step adds one more of the target's own). Lookup costs nothing to draft; the head costs
about a tenth of a plain step per depth, so where both give about the same the lookup is the better source.

    python scripts/experiments/hybrid_switch.py --draft eagle:data/heads/smollm2-135m-eagle3-3epochs.pt --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import torch

from verispec import cache
from verispec.backends import load
from verispec.bench.agreement import spec_bench_answers
from verispec.bench.records import git_revision
from verispec.drafters.ngram import NgramDrafter
from verispec.eagle.corpus import features
from verispec.eagle.head import EagleHead, shipped_head
from verispec.eagle.train import _labels, depth_outputs
from verispec.probs import argmax


def head_chains(head: EagleHead, record, depths: int) -> dict[int, int]:
    """For each row j (the context ends at token j + 1), how many of the head's greedy chain tokens x_{j+2}, ... are
    the target's, up to ``depths`` (only rows whose first drafted token is a response token)."""
    data = features(head.target, record, 1, head.feature_layers)
    tokens, resp = data["tokens"], data["mask"]
    T = len(tokens)
    hits: dict[int, list[bool]] = {}
    with torch.no_grad():
        for k, rows, _, logits in depth_outputs(head, data, depths):
            _, _, top1 = _labels(head, data, (rows + k).clamp(max=T - 1))
            hit = (logits.max(-1).indices == top1).tolist()
            for j, h in zip(rows.tolist(), hit):
                if j + k + 1 <= T - 1 and resp[j + 2] and (k == 1 or len(hits.get(j, ())) == k - 1):
                    hits.setdefault(j, []).append(bool(h) and resp[j + k + 1].item())
    out = {}
    for j, hs in hits.items():
        n = 0
        while n < len(hs) and hs[n]:
            n += 1
        out[j] = n
    return out


def lookup_chain(lookup: NgramDrafter, context: list[int], truth: list[int], depth: int) -> tuple[int, int]:
    """(match length at the root, how many of the lookup's greedy chain of ``depth`` tokens equal ``truth``)."""
    law = lookup._root_logits(context)
    if law is None:
        return 0, 0
    n = lookup._match[0][0]
    got, seq = 0, list(context)
    for want in truth[:depth]:
        guess = int(argmax(law))
        if guess != want:
            break
        got += 1
        seq.append(guess)
        law = lookup._root_logits(seq)
        if law is None:
            break
    return n, got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="eagle", help="eagle (the shipped head) or eagle:PATH")
    ap.add_argument("--per-group", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depths", type=int, default=3, help="the head's chain depths")
    ap.add_argument("--lookup-depth", type=int, default=5, help="the lookup's chain depths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m")
    head = EagleHead.load(shipped_head(target.name) if args.draft == "eagle" else args.draft.split(":", 1)[1], target)
    kept = cache.path("answers", f"{target.name}-{args.per_group}x{args.max_new_tokens}.jsonl")
    answers = spec_bench_answers(target, args.per_group, args.max_new_tokens, cache=kept)
    lookup = NgramDrafter(vocab_size=target.vocab_size)
    # bins by match length: [positions, head accepted by chain depth 1..D, lookup accepted by depth 1..L]
    bins: dict[int, list] = {}
    for r in answers:
        chains = head_chains(head, r, args.depths)
        toks = list(r.tokens)
        for j, h in sorted(chains.items()):
            context, truth = toks[:j + 2], toks[j + 2:]
            n, got = lookup_chain(lookup, context, truth, args.lookup_depth)
            b = bins.setdefault(n, [0, [0] * args.depths, [0] * args.lookup_depth])
            b[0] += 1
            for d in range(args.depths):
                b[1][d] += min(h, d + 1)
            for d in range(args.lookup_depth):
                b[2][d] += min(got, d + 1)
    total = sum(b[0] for b in bins.values())
    rows = [{"match": n, "positions": b[0], "share": b[0] / total,
             "head_accepted": [x / b[0] for x in b[1]], "lookup_accepted": [x / b[0] for x in b[2]]}
            for n, b in sorted(bins.items())]
    report = {"draft": args.draft, "answers": len(answers), "positions": total, "bins": rows,
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "git": git_revision()}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print("| match length | share | head accepted, chain 1.." + str(args.depths) + " | lookup accepted, chain 1.."
          + str(args.lookup_depth) + " |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['match']} | {r['share']:.3f} | " + " / ".join(f"{x:.2f}" for x in r["head_accepted"]) + " | "
              + " / ".join(f"{x:.2f}" for x in r["lookup_accepted"]) + " |")


if __name__ == "__main__":
    main()
