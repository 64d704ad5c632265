"""What each tree rule's verification costs per step on the default model's vocabulary, against the target forward
it verifies (issue 67: a tree rule's verification should cost at most 10 % of that forward).

    python scripts/experiments/verify_cost.py [--repeats 20] [--out results/verify_cost.json]

For each rule and tree shape: a draft of that shape over 49,152 tokens whose laws are softmaxes of random logits at
T = 0.6 (children drawn in the rule's child mode), the target's logits the draft's disturbed so that some candidates
are accepted and some rejected; ``step_verdict`` (what the loop calls: laws from logits, then the rule) timed, the
mean over ``--repeats`` steps after warm-up, the rules taking turns within each round. The forward of the same rows
is the default model's (one sequence, float32, 256 tokens of context, ``backends.costs.target_forward_cost``: the
median of 9).
Run on a quiet machine; the JSON keeps the command, revision, CPU and date.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from verispec import load  # noqa: E402
from verispec.backends.costs import target_forward_cost  # noqa: E402
from verispec.bench.records import git_revision, machine  # noqa: E402
from verispec.drafters.base import Draft, _draw_children  # noqa: E402
from verispec.probs import Sampling, logits_to_probs  # noqa: E402
from verispec.rng import TorchRandomness  # noqa: E402
from verispec.tree import Tree  # noqa: E402
from verispec.verifiers import get_verifier  # noqa: E402
from verispec.verifiers.base import step_verdict  # noqa: E402

RULES = {  # rule -> its child mode
    "chain": "iid", "block": "iid", "specinfer": "iid", "swor": "swor", "topk": "topk", "reserve": "iid",
    "ordered": "iid", "traversal": "iid", "canonical": "iid", "match": "iid", "spechub": "hub", "hsd": "iid",
    "resispec": "iid"}
TREES = ["chain:4", "2x2", "3x2"]


def step(tree: Tree, children: str, vocab: int, sampling: Sampling, gen: torch.Generator, rng) -> tuple[Draft, torch.Tensor]:
    """A draft of ``tree``'s shape and the target's logits for its rows (see the module docstring)."""
    logits = torch.randn(tree.size, vocab, generator=gen) * 3
    q = logits_to_probs(logits, sampling)
    tokens = torch.zeros(tree.size, dtype=torch.long)
    child_prob = torch.ones(tree.size)
    for node in range(tree.size):
        kids = tree.children[node]
        if not kids:
            q[node] = 0.0
            continue
        xs, probs = _draw_children(q[node], logits[node], len(kids), children, rng)
        for child, x, pr in zip(kids, xs, probs):
            tokens[child], child_prob[child] = x, pr
    return Draft(tree, tokens, q, child_prob, children), logits + torch.randn(tree.size, vocab, generator=gen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "verify_cost.json")
    args = ap.parse_args()
    target = load()
    forward = target_forward_cost(target, [5] * 255 + [7], sorted({Tree.parse(t).size for t in TREES}), repeats=9)
    sampling = Sampling(0.6)
    gen, rng = torch.Generator().manual_seed(0), TorchRandomness(0)
    cases = [(rule, shape) for shape in TREES for rule in RULES
             if (shape.startswith("chain") or not get_verifier(rule).chain_only)
             and (RULES[rule] != "hub" or Tree.parse(shape).branching <= 2)]  # hub children come in pairs
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for k in range(args.repeats + 3):
        for rule, shape in cases:
            tree, spec = Tree.parse(shape), get_verifier(rule)
            draft, logits = step(tree, RULES[rule], target.vocab_size, sampling, gen, rng)
            t = time.perf_counter()
            step_verdict(spec, draft, logits, sampling, rng)
            if k >= 3:  # warm-up rounds untimed
                times[(rule, shape)].append(time.perf_counter() - t)
    rows = []
    for (rule, shape), ts in times.items():
        size = Tree.parse(shape).size
        fwd = forward[size]
        ms = 1000 * statistics.fmean(ts)
        rows.append({"verifier": rule, "tree": shape, "rows": size, "verify_ms": round(ms, 3),
                     "forward_ms": round(1000 * fwd, 2) if fwd else None,
                     "share_of_forward": round(ms / (1000 * fwd), 3) if fwd else None})
        print(f"{rule:10} {shape:8} {ms:7.2f} ms" + (f"  {ms / (1000 * fwd):6.1%} of a forward of {size} rows"
                                                     if fwd else ""), flush=True)
    out = {"command": "python scripts/experiments/verify_cost.py" + (f" --repeats {args.repeats}"
                                                                     if args.repeats != 20 else ""),
           "git": git_revision(), "machine": machine(), "date": time.strftime("%Y-%m-%d"), "temperature": 0.6,
           "vocab": target.vocab_size, "rows": rows}
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
