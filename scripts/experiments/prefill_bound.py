"""How far a closed loop's throughput can grow with the requests in flight when every prompt must be prefilled: read
from a concurrency run's records (``verispec bench --concurrency``), not timed anew.

At N = 1 a request's prefill runs alone, so the cell's prefill seconds ``P`` (the sum of its requests' ``prefill_s``)
and decoding seconds ``D1 = wall - P`` are measured apart. A prompt token costs about the same in any forward here
(a prompt chunk's rows are compute-bound on this CPU), so batching shrinks ``D`` and leaves ``P``: a loop at N runs
at most ``(P + D1) / P`` times its N = 1, and ``k`` times only if its decoding runs ``D1 / ((P + D1) / k - P)``
times faster than at N = 1. This prints both beside the measured ratio and the decoding speed-up it implies.

    python scripts/experiments/prefill_bound.py results/concurrency_verified.jsonl.gz --times 3
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def _key(cell: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in cell.items() if k not in ("prompt", "round")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="a concurrency run's records (.jsonl or .jsonl.gz)")
    ap.add_argument("--times", type=float, default=3.0, help="the growth over N = 1 asked of the largest N")
    args = ap.parse_args()
    opener = gzip.open if args.records.endswith(".gz") else open
    with opener(args.records, "rt") as f:
        recs = [json.loads(line) for line in f]
    prefill = collections.defaultdict(float)  # (cell without round) -> prefill seconds over all rounds
    walls = collections.defaultdict(list)
    for r in recs:
        if r.get("type") == "prompt" and r.get("prefill_s") is not None:
            prefill[_key(r["cell"])] += r["prefill_s"]
        elif r.get("type") == "cell":
            walls[_key(r["cell"])].append(r["wall_s"])
    groups = collections.defaultdict(dict)  # (method, draft, T) -> N -> key
    for key in walls:
        c = dict(key)
        if c.get("method") in ("ar", "default"):
            groups[c["method"], c["draft"], c["T"]][c["concurrency"]] = key
    print("| method | T | P (s, N = 1) | D1 (s) | P share | bound (P + D1) / P | N | wall (s) | wall ratio to N = 1 "
          f"| decoding speed-up implied | asked of it for {args.times:g}x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (method, _, temp), by_n in sorted(groups.items()):
        if 1 not in by_n:
            continue
        rounds = len(walls[by_n[1]])
        w1 = statistics.fmean(walls[by_n[1]])
        p = prefill[by_n[1]] / rounds
        d1 = w1 - p
        need = d1 / ((p + d1) / args.times - p) if (p + d1) / args.times > p else float("inf")
        for n in sorted(by_n):
            if n == 1:
                continue
            wn = statistics.fmean(walls[by_n[n]])
            implied = d1 / (wn - p) if wn > p else float("inf")
            print(f"| {method} | {temp:g} | {p:.1f} | {d1:.1f} | {p / w1:.0%} | {w1 / p:.2f}x | {n} | {wn:.1f} "
                  f"| {w1 / wn:.2f}x | {implied:.2f}x | {need:.2f}x |")


if __name__ == "__main__":
    main()
