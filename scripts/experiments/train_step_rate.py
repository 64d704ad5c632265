"""How fast the draft head trains: ``--steps`` optimiser steps of 4 records of one corpus round (after one
warm-up step), the default recipe (EAGLE-3 features of layers 3/15/27, 3 depths, 16,384-token draft vocabulary),
with the sum of their losses, so that two versions of the training code can be timed against each other on the
same work (equal sums: the same training). A step's records go through the head one after another, or with
``--packed`` as one packed forward a depth (``head_loss`` of the list, as ``train-draft`` runs it).

    python scripts/experiments/train_step_rate.py --round 1 --steps 10
    python scripts/experiments/train_step_rate.py --round 1 --steps 10 --packed
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from verispec.backends import load
from verispec.eagle.corpus import read_corpus, round_features
from verispec.eagle.head import EagleHead
from verispec.eagle.train import TRAIN_HEAD_DTYPE, draft_vocabulary, head_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="data/corpus/smollm2-135m")
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--packed", action="store_true", help="a step's records in one packed forward a depth")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = Path(args.corpus)
    target = load("smollm2-135m", dtype="float32")
    for p in target.hf.parameters():
        p.requires_grad_(False)
    recs = [r for r in read_corpus(folder) if r.round == args.round]
    data = round_features(folder, args.round, recs)[:4 * (args.steps + 1)]
    vocab = draft_vocabulary([r.tokens for r in recs], 16384, target.vocab_size, always=target.eos_token_ids)
    head = EagleHead(target, vocab, head_dtype=TRAIN_HEAD_DTYPE, feature_layers=(3, 15, 27))
    opt = torch.optim.AdamW(head.trainable(), lr=1e-3)
    head.train()

    def step(batch) -> float:
        opt.zero_grad()
        total = 0.0
        if args.packed:
            loss, _ = head_loss(head, batch, 3, 0.05, 1.0, 0.8)
            loss.backward()
            total = float(loss) * len(batch)
        for d in batch if not args.packed else []:
            loss, _ = head_loss(head, d, 3, 0.05, 1.0, 0.8)
            (loss / len(batch)).backward()
            total += float(loss)
        opt.step()
        return total

    step(data[:4])
    t0 = time.perf_counter()
    losses = [step(data[b:b + 4]) for b in range(4, len(data), 4)]
    dt = time.perf_counter() - t0
    tokens = sum(int(d["mask"].sum()) for d in data[4:])
    kind = "packed steps" if args.packed else "steps"
    print(f"{len(losses)} {kind} of round {args.round}: {dt:.2f} s, {tokens / dt:.0f} response tokens/s, "
          f"loss sum {sum(losses):.6f}")


if __name__ == "__main__":
    main()
