"""How fast the corpus writer samples (``verispec.eagle.corpus._Writer.sample``): N chat prompts through SLOTS
slots of the target's batched forward, keeping features and labels as a corpus round does, with the target's
forwards timed by kind: prefills, full-batch decoding steps, and the tail (steps with fewer live sequences, the
stage waiting for its longest answers).

    python scripts/experiments/corpus_rate.py --prompts 128 --slots 64 --dtype bfloat16
    python scripts/experiments/corpus_rate.py --prompts 64 --slots 64 --document 800   # as a document round

With ``--rounds``, whole corpus rounds instead (their shapes and seeds by number, nothing saved) through
``_Writer.run`` with ``--at-once`` rounds in flight: tokens sampled per second and the mean live sequences per
decoding step (how full the batch stays while stages wait for their longest answers):

    python scripts/experiments/corpus_rate.py --rounds 19 20 --slots 128 --at-once 1
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.backends import load
from verispec.eagle import corpus
from verispec.eagle.corpus import CorpusConfig, _Writer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--document", type=int, default=0, metavar="WORDS",
                    help="each prompt opens with a text of this many words to be worked on, as a document round's")
    ap.add_argument("--no-features", action="store_true", help="text only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, nargs="*", help="corpus rounds to write (128 items each, as the committed "
                    "corpus), instead of the prompts")
    ap.add_argument("--at-once", type=int, default=corpus.ROUNDS_AT_ONCE, help="rounds in flight (with --rounds)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    if args.rounds:
        return rounds(target, args)
    w = _Writer(target, None if args.no_features else (3, 15, 27), 64, max_batch=args.slots)
    torch.manual_seed(0)
    words = "the old town by the river grew up around a mill that ground grain for farms across the valley".split()
    text = " ".join(words[i % len(words)] for i in range(args.document))
    ask = "Summarise this text in a short paragraph:\n" + text + "\n" if args.document else ""
    prompts = [w.prompt([ask + f"Write a short paragraph about topic number {i}."]) for i in range(args.prompts)]
    log: list[tuple[int, int, float]] = []  # (sequences, rows, seconds) of each forward
    forward = target.forward_batch

    def timed(states, tokens, *a, **k):
        t0 = time.perf_counter()
        out = forward(states, tokens, *a, **k)
        log.append((len(states), sum(len(x) for x in tokens), time.perf_counter() - t0))
        return out

    target.forward_batch = timed
    t0 = time.perf_counter()
    outs, _ = w.sample(prompts, args.max_new_tokens, 0.6, labels_from=[len(p) - 1 for p in prompts])
    dt = time.perf_counter() - t0
    lengths = sorted(len(o) for o in outs)
    steps = [(s, d) for s, r, d in log if r == s]  # one row per sequence: decoding
    full = [d for s, d in steps if s == args.slots]
    tail = [(s, d) for s, d in steps if s < args.slots]
    rate = lambda tokens, seconds: tokens / max(seconds, 1e-9)  # noqa: E731
    print(f"{args.prompts} prompts, {args.slots} slots, {args.dtype}, features {not args.no_features}: "
          f"{sum(lengths)} tokens in {dt:.1f} s = {sum(lengths) / dt:.0f} tokens/s; prefills "
          f"{sum(d for s, r, d in log if r != s):.1f} s; full-batch steps {len(full)}, {sum(full):.1f} s "
          f"({rate(args.slots * len(full), sum(full)):.0f} tokens/s); tail steps {len(tail)}, "
          f"{sum(d for _, d in tail):.1f} s ({rate(sum(s for s, _ in tail), sum(d for _, d in tail)):.0f} tokens/s, "
          f"mean live {sum(s for s, _ in tail) / max(len(tail), 1):.1f}); answers: median "
          f"{lengths[len(lengths) // 2]}, longest {lengths[-1]} tokens")


def rounds(target, args) -> None:
    config = CorpusConfig(rounds=max(args.rounds) + 1, batch=128, layers=None if args.no_features else (3, 15, 27))
    w = _Writer(target, config.layers, 64, args.slots, capacity=corpus.MAX_PROMPT + max(corpus.LIMITS.values()) + 1)
    live: list[int] = []  # sequences of each decoding step
    forward = target.forward_batch

    def counted(states, tokens, *a, **k):
        if all(len(x) == 1 for x in tokens):
            live.append(len(states))
        return forward(states, tokens, *a, **k)

    target.forward_batch = counted
    t0 = time.perf_counter()
    made = dict(w.run((corpus._round_task(w, config, r) for r in args.rounds), at_once=args.at_once))
    dt = time.perf_counter() - t0
    response = sum(b - a for recs in made.values() for r in recs for a, b in r.spans)
    print(f"rounds {args.rounds} ({', '.join(corpus.CYCLE[r % len(corpus.CYCLE)] for r in args.rounds)}), "
          f"{args.slots} slots, {args.at_once} at once, {args.dtype}: {response} response tokens in {dt:.1f} s = "
          f"{response / dt:.0f} tokens/s; {len(live)} decoding steps, mean live {sum(live) / max(len(live), 1):.1f}")


if __name__ == "__main__":
    main()
