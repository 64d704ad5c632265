"""How much of the gap between ``specinfer`` and the i.i.d. optimum ``alpha*_iid`` the exact rules close.

Per-node acceptance with k i.i.d. candidates, all computed exactly (closed forms, checked against the
enumeration audit in the tests): ``specinfer`` and ``reserve`` (one pass over the stages), ``ordered``
(k = 2 only; a lower bound within 1e-4, skipping the least likely first candidates), and ``alpha*_iid``. Two populations:

* random small cases: Dirichlet target/draft pairs at vocabularies 6, 50 and 1000;
* real (p, q) pairs: target and draft distributions of the default model along its own sampled
  responses to Spec-Bench prompts (one forward of each model over prompt + response).

    python scripts/experiments/reserve_gap.py --prompts 6 --positions 20 --temperatures 0.6 1.0
"""

from __future__ import annotations

import argparse

import torch

from verispec import load
from verispec.audit.optimum import alpha_star_iid, ordered_acceptance_k2, sequential_acceptance
from verispec.audit.real import real_pairs
from verispec.drafters import build_drafter


def rates(pairs, k):
    out = {"specinfer": 0.0, "reserve": 0.0, "alpha*": 0.0}
    if k == 2:
        out["ordered"] = 0.0
    for p, q in pairs:
        out["specinfer"] += sequential_acceptance(p, q, k, reserve=False)
        out["reserve"] += sequential_acceptance(p, q, k, reserve=True)
        out["alpha*"] += alpha_star_iid(p, q, k)
        if k == 2:
            out["ordered"] += ordered_acceptance_k2(p, q, slack=1e-4)  # a lower bound within 1e-4
    return {name: v / len(pairs) for name, v in out.items()}


def report(label, pairs, ks):
    for k in ks:
        r = rates(pairs, k)
        gap = r["alpha*"] - r["specinfer"]
        closed = {n: (r[n] - r["specinfer"]) / gap if gap > 1e-12 else float("nan") for n in ("reserve", "ordered") if n in r}
        cells = " | ".join(f"{r[n]:.4f}" if n in r else "-" for n in ("specinfer", "reserve", "ordered", "alpha*"))
        gaps = " | ".join(f"{100 * closed[n]:.1f}%" if n in closed else "-" for n in ("reserve", "ordered"))
        print(f"| {label} | {len(pairs)} | {k} | {cells} | {gaps} |", flush=True)


def random_pairs(vocab, n, conc, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch._standard_gamma(torch.full((vocab,), conc, dtype=torch.float64), generator=gen)
        q = torch._standard_gamma(torch.full((vocab,), conc, dtype=torch.float64), generator=gen)
        out.append((p / p.sum(), q / q.sum()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="layerskip:0-11,18-29", help="a model draft (layerskip or model:...)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--positions", type=int, default=20, help="response positions per prompt")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--random-cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    print("| population | pairs | k | specinfer | reserve | ordered | alpha*_iid | reserve closes | ordered closes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for vocab, conc in ((6, 1.0), (50, 0.5), (1000, 0.1)):
        report(f"random V={vocab} Dir({conc})", random_pairs(vocab, args.random_cases, conc, args.seed), (2, 3))
    target = load(args.target)
    for T in args.temperatures:
        pairs = real_pairs(target, build_drafter(args.draft, target), args.prompts, args.positions, T, args.seed)
        report(f"{args.target} + {args.draft}, T={T}", pairs, (2, 3))


if __name__ == "__main__":
    main()
