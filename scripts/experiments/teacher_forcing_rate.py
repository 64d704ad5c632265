"""How fast teacher forcing computes a corpus round's features (``verispec.eagle.corpus._teacher_forced``, as
``train-draft`` runs it where a round's features are missing), with the output layer on every row or only on the
rows whose labels are kept (``logits_from``: from the first response token on). The two ways alternate, on the same
forwards of up to ``PREFILL_ROWS`` rows; nothing is written.

    python scripts/experiments/teacher_forcing_rate.py --round 69 --records 96 --pairs 3
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from verispec.backends import load
from verispec.eagle import corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus/smollm2-135m")
    ap.add_argument("--round", type=int, default=69)
    ap.add_argument("--records", type=int, default=96, help="N records spread over the round")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    records = [r for r in corpus.read_corpus(args.corpus) if r.round == args.round]
    records = records[::max(1, len(records) // args.records)][:args.records]  # spread over the round
    if not records:
        raise SystemExit(f"round {args.round} of {args.corpus} has no records")
    target = load("smollm2-135m", dtype=args.dtype)
    tokens = sum(len(r.tokens) for r in records)
    labelled = sum(len(r.tokens) - max(r.spans[0][0] - 1, 0) for r in records)
    print(f"round {args.round}: {len(records)} records, {tokens:,} tokens, {labelled:,} from the first response "
          f"token on ({labelled / tokens:.0%})")
    groups = corpus._by_rows([(i, len(r.tokens)) for i, r in enumerate(records)], corpus.PREFILL_ROWS)
    forward = target.forward_batch

    def every_row(*a, **k):
        k.pop("logits_from", None)
        return forward(*a, **k)

    def run(skip: bool) -> float:
        target.forward_batch = forward if skip else every_row
        t0 = time.perf_counter()
        for g in groups:
            corpus._teacher_forced(target, [records[i] for i in g], 64, (3, 15, 27), writer_labels=True)
        target.forward_batch = forward
        return time.perf_counter() - t0

    run(True)  # warm-up
    ratios = []
    for k in range(args.pairs):
        order = (False, True) if k % 2 == 0 else (True, False)
        t = {skip: run(skip) for skip in order}
        ratios.append(t[False] / t[True])
        print(f"pair {k + 1}: every row {tokens / t[False]:.0f} tokens/s, labelled rows only "
              f"{tokens / t[True]:.0f} tokens/s ({ratios[-1]:.3f}x)")
    print(f"geometric mean {math.prod(ratios) ** (1 / len(ratios)):.3f}x over {len(ratios)} pairs")


if __name__ == "__main__":
    main()
