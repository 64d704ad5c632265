"""Where the EAGLE head's drafting spends its time in the steady state of a decoding loop: after a prompt, each round
commits K new tokens (the head's catch-up pairs; their features random, as the timing does not depend on them) and
drafts a chain of D tokens with ``propose``, as one sequence's step does. Per (K, D): the median whole ``propose``,
and the mean of its parts: the committed pairs' inputs (``target_inputs``: the fused features and ``fc``), the
drafted pairs' inputs (``draft_inputs``), the head's forwards (its one layer, norm and restricted output layer),
``full_logits`` (the restricted logits back over the whole vocabulary), and the rest (the tree's growth: laws,
children, the draft's vocabulary-sized rows). Drafting asks a control that reads no laws, as the ``auto`` policy's
(``--read-laws``: one that does, as the entropy and confidence policies'). A measurement, not the benchmark: run it
on a quiet machine.

    python scripts/experiments/head_split.py --catch-up 1 2 4 --depths 1 2 3
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from verispec import load
from verispec.drafters import build_drafter
from verispec.drafters.base import DraftControl
from verispec.eagle.head import EagleHead
from verispec.probs import Sampling
from verispec.rng import TorchRandomness
from verispec.tree import Tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--catch-up", type=int, nargs="+", default=[1, 2, 4], help="K: tokens committed a round")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3], help="D: the chain drafted a round")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-laws", action="store_true", help="a control that reads the draft's laws at each depth")
    ap.add_argument("--evict", type=int, default=0, metavar="MB",
                    help="read this many MB between rounds, as the target's forward does in a loop (its float32 "
                         "weights: about 540), so the head's weights are not in the caches when it drafts")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype="float32")
    drafter = build_drafter("eagle", target, dtype="float32")
    lm = drafter.lm
    width = len(drafter.feature_layers) * target.config.hidden_size
    spent: dict[str, float] = collections.defaultdict(float)

    def timed(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def run(*a, **kw):
            t = time.perf_counter()
            out = inner(*a, **kw)
            spent[label] += time.perf_counter() - t
            return out

        setattr(owner, name, run)

    timed(EagleHead, "target_inputs", "committed pairs' inputs")
    timed(EagleHead, "draft_inputs", "drafted pairs' inputs")
    timed(EagleHead, "full_logits", "full_logits")
    timed(type(lm), "forward", "head forwards")  # its prefills of the committed pairs call it too
    rng, sampling = TorchRandomness(0), Sampling(0.0)
    control = DraftControl(lambda *a, **kw: True, reads_laws=args.read_laws)
    evict = torch.ones(args.evict * 2**18) if args.evict else None
    for k in args.catch_up:
        for d in args.depths:
            context = list(range(1000, 1000 + args.context))
            drafter.reset(context)
            drafter.observe(torch.randn(len(context), width))
            tree = Tree.chain(d)
            whole = []
            spent.clear()
            for r in range(args.rounds + 5):
                if r == 5:  # the first rounds warm up (and catch up on the prompt)
                    spent.clear()
                context += [1500 + r % 7] * k
                drafter.observe(torch.randn(k, width))
                if evict is not None:
                    evict.sum()
                t = time.perf_counter()
                draft = drafter.propose(context, tree, sampling, "topk", rng, control)
                if r >= 5:
                    whole.append(time.perf_counter() - t)
                drafter.commit(draft, [])
            mean = {name: s / args.rounds * 1e3 for name, s in spent.items()}
            rest = statistics.fmean(whole) * 1e3 - sum(mean.values())
            parts = ", ".join(f"{name} {ms:.2f}" for name, ms in sorted(mean.items())) + f", the rest {rest:.2f}"
            print(f"K = {k}, D = {d}: propose {statistics.median(whole) * 1e3:.2f} ms (median; mean "
                  f"{statistics.fmean(whole) * 1e3:.2f}): {parts} ms", flush=True)


if __name__ == "__main__":
    main()
