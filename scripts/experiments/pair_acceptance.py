"""Two candidates a node on the real model: SpecHub's hub pairs against i.i.d. pairs and pairs without replacement.

At every response position of the target's own sampled answers to Spec-Bench prompts (``audit.real.real_pairs``: one
forward of each model over prompt + response gives the target's law p and a model draft's law q there), each rule's
exact acceptance with two candidates, by closed forms over the whole vocabulary (each checked against the
enumerating audit in tests/test_spechub.py):

* ``specinfer`` over two i.i.d. draws (SpecHub's "RRS"), ``swor`` over two draws without replacement ("RRS without
  replacement"), ``spechub`` over its hub pairs;
* the best any exact rule reaches with i.i.d. pairs (``alpha*_iid``) and with hub pairs (``alpha*_hub``).

Means over positions; intervals (95 %) by a bootstrap over prompts, paired for the differences. A node's acceptance is
what a step's tokens are built of; a step of a tree adds these up over its depths.

    python scripts/experiments/pair_acceptance.py --drafts int8 layerskip:0-11,18-29 --prompts 12 --positions 32 \\
        --temperatures 0.6 1.0 --json results/pair_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verispec import load
from verispec.audit.optimum import alpha_star_hub, alpha_star_iid, sequential_acceptance, swor_acceptance_k2
from verispec.audit.real import real_pairs_by_prompt
from verispec.bench.records import git_revision, machine
from verispec.bench.stats import ratio_of_sums
from verispec.drafters import build_drafter
from verispec.verifiers.spechub import hub_acceptance

RULES = {
    "specinfer": lambda p, q: sequential_acceptance(p, q, 2, reserve=False),
    "swor": swor_acceptance_k2,
    "spechub": hub_acceptance,
    "alpha*_iid": lambda p, q: alpha_star_iid(p, q, 2),
    "alpha*_hub": alpha_star_hub,
}


def measure(target, draft: str, prompts: int, positions: int, temperature: float, seed: int) -> dict:
    drafter = build_drafter(draft, target)
    per_prompt = {name: [] for name in RULES}
    counts = []
    for pairs in real_pairs_by_prompt(target, drafter, prompts, positions, temperature, seed):  # the bootstrap's unit
        counts.append(len(pairs))
        for name, rule in RULES.items():
            per_prompt[name].append(sum(rule(p, q) for p, q in pairs))
    row = {"draft": draft, "temperature": temperature, "prompts": prompts, "positions": sum(counts)}
    for name in RULES:
        row[name] = ratio_of_sums(per_prompt[name], counts)
    for name in ("spechub", "swor"):
        row[f"{name} - specinfer"] = ratio_of_sums(
            [a - b for a, b in zip(per_prompt[name], per_prompt["specinfer"])], counts)
    row["spechub - swor"] = ratio_of_sums([a - b for a, b in zip(per_prompt["spechub"], per_prompt["swor"])], counts)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafts", nargs="+", default=["int8", "layerskip:0-11,18-29"], help="model drafts")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--positions", type=int, default=32, help="response positions per prompt")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 1.0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    target = load(args.target)
    start, rows = time.time(), []
    print("| draft | T | positions | specinfer | swor | spechub | alpha*_iid | alpha*_hub | spechub - specinfer | "
          "spechub - swor |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for draft in args.drafts:
        for t in args.temperatures:
            r = measure(target, draft, args.prompts, args.positions, t, args.seed)
            rows.append(r)
            cells = " | ".join(f"{r[n][0]:.4f}" for n in RULES)
            print(f"| {draft} | {t} | {r['positions']} | {cells} | {r['spechub - specinfer'][0]:+.4f} | "
                  f"{r['spechub - swor'][0]:+.4f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", *sys.argv]), "git": git_revision(), "machine": machine(),
                       "seconds": round(time.time() - start, 1), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
