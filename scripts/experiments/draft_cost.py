"""What drafting costs a step for the drafts that run no model: ``propose`` of a chain of 1, 3 and 5 after a
Spec-Bench context (a summarization prompt and 40 tokens of the target's greedy answer), each draft growing its tree
on its few tokens a row (``SparseRows``) and the same draft answering whole rows (a subclass with dense hooks, as
every draft did before), taking turns. A measurement on a quiet machine, not the benchmark; ``--json`` keeps it.

    python scripts/experiments/draft_cost.py --json results/draft_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import verispec
from verispec.bench.records import git_revision, machine
from verispec.datasets import load_prompts
from verispec.drafters import NgramDrafter, SuffixDrafter
from verispec.drafters.base import DraftControl, whole_rows
from verispec.policies import AutoDepth
from verispec.probs import Sampling
from verispec.rng import TorchRandomness
from verispec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    revision = git_revision()
    target = verispec.load()
    problem = load_prompts("spec-bench:summarization", 1)[0]
    ids = target.encode_prompt(problem.prompt)
    answer = verispec.generate(target, verispec.build_drafter("none", target), "chain", ids, tree="none",
                               temperature=0.0, max_new_tokens=40).token_ids
    context = ids + answer
    control, rng = DraftControl.of(AutoDepth()), TorchRandomness(0)
    rows = []
    for t in (0.0, 0.6):
        for cls in (NgramDrafter, SuffixDrafter):
            for depth in (1, 3, 5):
                tree, sampling = Tree.chain(depth), Sampling(t)
                ways = {"sparse": cls(target.vocab_size), "dense": whole_rows(cls)(target.vocab_size)}
                times = {k: [] for k in ways}
                for _ in range(args.repeats):
                    for name, d in ways.items():
                        t0 = time.perf_counter()
                        d.propose(context, tree, sampling, "iid", rng, control)
                        times[name].append(time.perf_counter() - t0)
                drafted = ways["sparse"].propose(context, tree, sampling, "iid", rng, control).num_drafted
                row = {"T": t, "draft": cls.name, "depth": depth, "drafted": drafted,
                       **{f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items()}}
                rows.append(row)
                print(f"T = {t:g} {cls.name} chain:{depth} (drafted {drafted}): whole rows {row['dense_ms']:.3f} ms, "
                      f"a few tokens a row {row['sparse_ms']:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": ["python", *sys.argv], "git": revision, "machine": machine(), "rows": rows}, f)


if __name__ == "__main__":
    main()
