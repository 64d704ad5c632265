"""How often the target accepts a one-token draft of the shipped head, against the temperature the draft samples at.

The chain rule accepts a drafted token x ~ q with probability min(1, p(x) / q(x)), so a one-token draft is accepted
with probability sum_x min(p(x), q(x)) (computed here exactly, no sampling), whatever q is: the rule stays exact for
any draft law, and the law the draft samples from is a free choice. The loop samples the head at the target's own
temperature; this measures, on held-out Spec-Bench answers (teacher forcing, depth 1), what a sharper or flatter draft
would be accepted with, and the argmax draft (temperature 0: a point mass on the head's top token, accepted with
probability p(top)). The answers are the target's greedy ones (the cached set of ``verispec eval-draft``).

    python scripts/experiments/draft_temperature.py --per-group 10 --temperatures 0.6 1.0
"""

from __future__ import annotations

import argparse

import torch

from verispec import cache, load
from verispec.bench.agreement import spec_bench_answers
from verispec.drafters import build_drafter
from verispec.eagle.corpus import features
from verispec.eagle.train import depth_outputs

DRAFT_TEMPERATURES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-group", type=int, default=10, help="held-out Spec-Bench answers per category")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0], help="the target's temperatures")
    ap.add_argument("--top-k", type=int, default=512, help="target probabilities kept per position")
    args = ap.parse_args()
    target = load("smollm2-135m")
    head = build_drafter("eagle", target).head
    answers = spec_bench_answers(target, args.per_group, 96,
                                 cache=cache.path("answers", f"{target.name}-{args.per_group}x96.jsonl"))
    sums = {(t, d): 0.0 for t in args.temperatures for d in DRAFT_TEMPERATURES}
    n = 0
    with torch.no_grad():
        for record in answers:
            data = features(target, record, args.top_k, head.feature_layers)
            (_, rows, _, logits), = depth_outputs(head, data, 1)
            keep = (rows + 2 < len(data["tokens"])) & data["mask"][(rows + 2).clamp(max=len(data["tokens"]) - 1)]
            rows, logits = rows[keep], logits[keep].float()
            if not len(rows):
                continue
            full = head.full_logits(logits)  # [n, V], -inf outside the head's vocabulary
            top_p, top_i = data["p"][rows + 1].float(), data["i"][rows + 1].long()  # the target's law at T = 1
            for t in args.temperatures:
                p = top_p.clamp(min=1e-30) ** (1 / t)
                p = p / p.sum(-1, keepdim=True)  # its law at t, over its top-k (the rest is negligible at t <= 1)
                for d in DRAFT_TEMPERATURES:
                    if d == 0:
                        q_at = (top_i == full.argmax(-1, keepdim=True)).float()
                    else:
                        q_at = torch.softmax(full / d, -1).gather(1, top_i)
                    sums[t, d] += float(torch.minimum(p, q_at).sum())
            n += len(rows)
    print(f"{len(answers)} held-out Spec-Bench answers, {n} positions; acceptance of a one-token draft of the shipped "
          "head, sum_x min(p(x), q(x)):")
    for t in args.temperatures:
        cells = ", ".join(f"{'argmax' if d == 0 else f'{d:g}'} {sums[t, d] / n:.3f}" for d in DRAFT_TEMPERATURES)
        print(f"  target T = {t:g}; draft at {cells}")


if __name__ == "__main__":
    main()
