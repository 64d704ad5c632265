"""Where a draft head's depth-1 agreement is lost: the held-out Spec-Bench answers of ``verispec eval-draft`` (the
target's greedy answers, response positions only), binned by the target's own top-1 probability at the predicted
position, with the head's agreement in each bin and the share of positions there. A position where the target
itself puts 0.3 on its choice is one a cheap head can match only by computing what the target computes there.
Beside it, a reference that reads no features: the corpus's trigram table (the commonest token after the two before
the predicted one, else after the one before; the head sees those two tokens too, with the target's features of
the first).

    python scripts/experiments/agreement_by_confidence.py --draft eagle:runs/cap-L1/head.pt --per-group 10 \
        --corpus data/corpus/smollm2-135m --rounds 32 --json > results/head_epochs/confidence_1.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import Counter, defaultdict

import torch

from verispec import cache
from verispec.backends import load
from verispec.bench.agreement import spec_bench_answers
from verispec.bench.records import git_revision
from verispec.eagle.corpus import features, read_corpus
from verispec.eagle.head import EagleHead, shipped_head
from verispec.eagle.train import _labels, depth_outputs

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0001)


def trigram_table(folder: str, rounds: int) -> tuple[dict, dict]:
    """The commonest next token after each token pair, and after each token, in the corpus's first ``rounds``."""
    tri, bi = defaultdict(Counter), defaultdict(Counter)
    for r in read_corpus(folder):
        if r.round < rounds:
            t = r.tokens
            for a, b, c in zip(t, t[1:], t[2:]):
                tri[(a, b)][c] += 1
                bi[b][c] += 1
    return ({k: c.most_common(1)[0][0] for k, c in tri.items()}, {k: c.most_common(1)[0][0] for k, c in bi.items()})


def _bins(conf: torch.Tensor, hit: torch.Tensor) -> list[dict]:
    out = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (conf >= lo) & (conf < hi)
        out.append({"target_top1": [lo, min(hi, 1.0)], "share": float(m.float().mean()),
                    "agreement": float(hit[m].mean()) if m.any() else float("nan")})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="eagle", help="eagle (the shipped head) or eagle:PATH")
    ap.add_argument("--per-group", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--corpus", default=None, help="a corpus folder: also the agreement of its trigram table")
    ap.add_argument("--rounds", type=int, default=32, help="the corpus rounds the trigram table counts")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m")
    path = shipped_head("smollm2-135m") if args.draft == "eagle" else args.draft.removeprefix("eagle:")
    head = EagleHead.load(path, target)
    kept = cache.path("answers", f"{target.name}-{args.per_group}x{args.max_new_tokens}.jsonl")
    answers = spec_bench_answers(target, args.per_group, args.max_new_tokens, cache=kept)
    tri, bi = trigram_table(args.corpus, args.rounds) if args.corpus else ({}, {})
    conf, hit, gram, group = [], [], [], []
    with torch.no_grad():
        for r in answers:
            data = features(target, r, 1, head.feature_layers)
            (_, rows, _, logits), = depth_outputs(head, data, 1)
            pred = rows + 2
            keep = pred <= len(r.tokens) - 1
            keep[keep.clone()] = data["mask"][pred[keep]]
            _, _, top1 = _labels(head, data, (rows + 1)[keep])
            conf.append(data["p"][(rows + 1)[keep], 0].float())
            hit.append(logits[keep].max(-1).indices == top1)
            t = r.tokens
            gram.append(torch.tensor([tri.get((t[j], t[j + 1]), bi.get(t[j + 1], -1)) for j in rows[keep].tolist()])
                        == data["i"][(rows + 1)[keep], 0])
            group += [r.shape] * int(keep.sum())
    conf, hit, gram = torch.cat(conf), torch.cat(hit).float(), torch.cat(gram).float()
    bins = _bins(conf, hit)
    out = {"command": "python scripts/experiments/agreement_by_confidence.py " + shlex.join(sys.argv[1:]),
           "git": git_revision(), "draft": args.draft, "per_group": args.per_group, "positions": len(hit), "agreement": float(hit.mean()),
           "target_top1_mean": float(conf.mean()), "bins": bins,
           **({"trigram": {"corpus": args.corpus, "rounds": args.rounds, "agreement": float(gram.mean()),
                           "bins": _bins(conf, gram)}} if args.corpus else {}),
           "groups": {g: {"agreement": float(hit[torch.tensor([x == g for x in group])].mean()),
                          "target_top1_mean": float(conf[torch.tensor([x == g for x in group])].mean())}
                      for g in dict.fromkeys(group)}}
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"{args.draft}: {out['positions']} response positions, depth-1 agreement {out['agreement']:.3f}, the "
          f"target's own top-1 probability {out['target_top1_mean']:.3f} on average")
    tri_bins = out.get("trigram", {}).get("bins", [{"agreement": float("nan")}] * len(bins))
    print("| target's top-1 probability | share of positions | head agrees | trigram table agrees |")
    print("|---|---|---|---|")
    for b, g in zip(bins, tri_bins):
        lo, hi = b["target_top1"]
        print(f"| {lo:.1f}-{hi:.1f} | {b['share']:.3f} | {b['agreement']:.3f} | {g['agreement']:.3f} |")
    print("| group | head agrees | target's top-1 probability |")
    print("|---|---|---|")
    for g, v in out["groups"].items():
        print(f"| {g} | {v['agreement']:.3f} | {v['target_top1_mean']:.3f} |")


if __name__ == "__main__":
    main()
