"""Two verispec methods' closed loops on the same requests, alternating in one process (A B B A ...), so that a slow
spell of the machine falls on both: the bench runs one cell after another, and on this machine the same plain
forward of 8 sequences was seen to cost 15-20 % more in one cell than in the next. A quick check of a ratio the
bench left unresolved, not the benchmark (``verispec bench --concurrency``).

    python scripts/experiments/ab_concurrency.py --methods ar default --concurrency 8 --temperature 0 --pairs 3

A method named ``M:plain`` is M whose batched steps never draft (``Engine._nothing_pays`` says so whenever two or more
sequences decode; its drafter still receives the target's features): what M costs beside ``ar`` besides its drafts.
A method named ``M:margin=X`` is M whose load-aware plan asks a move to raise the batch's rate by more than X
(``planner.BATCH_MARGIN``) before it drafts; ``M:unverified`` is M whose plan does not charge drafting sequences their
verification (``Engine._verifying``); the two combine (``default:margin=0.1:unverified``). ``M:own`` is M whose
sequences each draft what their own policy plans alone (``Engine.depths`` as at one in flight), whatever the batch.
``M:measured`` is M whose policies weigh a draft head's depths by this machine's measured costs (the target's
forwards, ``forward_costs``, and the head's drafting, ``draft_costs`` of one sequence) instead of the step costs
its sidecar brought from the machine that tuned it.
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np
import torch

from verispec import planner
from verispec import load
from verispec import methods as methods_module
from verispec.backends.costs import forward_costs
from verispec.bench.concurrency import verispec_loop
from verispec.datasets import spec_bench_problems
from verispec.drafters import build_drafter
from verispec.drafters.costs import draft_costs
from verispec.engine import Engine
from verispec.methods import resolve
from verispec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs=2, default=["ar", "default"])
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3, help="rounds of each method (in the order A B B A A B ...)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    drafter = build_drafter(args.draft, target, dtype=args.dtype)
    problems = spec_bench_problems(args.limit)
    ids = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
    plans = {m: resolve(m.split(":")[0], temperature=args.temperature) for m in args.methods}
    pays, verifying, depths = Engine._nothing_pays, Engine._verifying, Engine.depths

    sidecar_costs = methods_module.step_costs

    def measured(target_, drafter_):
        fwd, head = forward_costs(target_), draft_costs(target_, drafter_)
        if head is None or not fwd:
            return sidecar_costs(target_, drafter_)
        return tuple(fwd[d] / fwd[0] + (head.first[0] + (d - 1) * head.further[0]) / fwd[0] if d else 1.0
                     for d in range(len(fwd)))

    def own(self, seqs, prompt_rows=0):
        return [s.policy.planned_depth(s.tree.max_depth) if isinstance(s.tree, Tree) else None for s in seqs]

    default_margin, batch_depths, one_pays = planner.BATCH_MARGIN, planner.batch_depths, planner.pays

    def set_margin(m: str) -> None:
        margin = float(m.split(":margin=")[1].split(":")[0]) if ":margin=" in m else default_margin
        planner.BATCH_MARGIN = margin  # read by ``planner.nothing_pays``; the two below take it as an argument
        planner.batch_depths = lambda *a, **k: batch_depths(*a, **{**k, "margin": margin})
        planner.pays = lambda plan, i: one_pays(plan, i, margin)

    def loop(m: str, n: int | None = None) -> float:
        set_margin(m)
        Engine._nothing_pays = (lambda self, seqs, *rest: len(seqs) >= 2) if m.endswith(":plain") else \
            (lambda self, seqs, *rest: False) if ":own" in m else pays
        Engine._verifying = (lambda self, seqs: [None] * len(seqs)) if ":unverified" in m else verifying
        Engine.depths = own if ":own" in m else depths
        methods_module.step_costs = measured if ":measured" in m else sidecar_costs
        reqs = verispec_loop(target, plans[m], drafter, problems[:n] if n else problems, ids[:n] if n else ids,
                             args.concurrency, args.temperature, 0, args.max_new_tokens if n is None else 8)
        wall = max(r.finished for r in reqs) - min(r.submitted for r in reqs)
        return sum(len(r.token_ids) for r in reqs) / wall

    for m in args.methods:  # warm up: first forwards allocate, the batch costs get measured
        loop(m, n=args.concurrency)
    rates: dict[str, list[float]] = {m: [] for m in args.methods}
    a, b = args.methods
    for k in range(args.pairs):
        for m in ((a, b) if k % 2 == 0 else (b, a)):
            rates[m].append(loop(m))
            print(f"round {k + 1}: {m} {rates[m][-1]:.1f} tokens/s", flush=True)
    ratios = [y / x for x, y in zip(rates[a], rates[b])]
    geo, low, high = rounds_interval(ratios)
    print(f"N = {args.concurrency}, T = {args.temperature:g}: {b} / {a} per round "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; geometric mean {geo:.2f}x [{low:.2f}, {high:.2f}] (95 % "
          f"bootstrap over rounds); {a} {statistics.median(rates[a]):.1f}, {b} {statistics.median(rates[b]):.1f} "
          "tokens/s (medians)")


def rounds_interval(ratios: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float, float]:
    """The geometric mean of the rounds' ratios and its 95 % percentile bootstrap interval over rounds (each round a
    pair of loops run back to back: the machine's spells are what the rounds sample)."""
    logs = np.log(np.asarray(ratios, dtype=float))
    draws = logs[np.random.default_rng(seed).integers(0, len(logs), size=(n, len(logs)))].mean(1)
    low, high = np.percentile(draws, [2.5, 97.5])
    return math.exp(logs.mean()), math.exp(low), math.exp(high)


if __name__ == "__main__":
    main()
