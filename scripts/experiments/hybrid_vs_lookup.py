"""The hybrid default against prompt lookup alone in speed runs' records: per temperature, the geometric mean over
prompts (and seeds, where a run has several) of `default`'s tokens/s with draft `auto` over its tokens/s with draft
`ngram` on the same prompt and seed, with a 95 % bootstrap interval over those pairs (4,000 resamples, seed 0).
Reads records only.

    python scripts/experiments/hybrid_vs_lookup.py results/speed_loopcosts.jsonl.gz results/speed_verify.jsonl.gz \\
        results/speed_lookup.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", help="speed runs' .jsonl.gz records (`default` with drafts auto and ngram)")
    args = ap.parse_args()
    for path in args.records:
        speed = {}
        with gzip.open(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                if r.get("type") == "prompt" and r["cell"]["method"] == "default" and not r.get("error"):
                    c = r["cell"]
                    speed[(c["T"], (c["prompt"], c.get("seed")), c["draft"])] = r["tokens"] / r["wall_s"]
        for t in sorted({k[0] for k in speed}):
            logs = [math.log(speed[(t, p, "auto")] / speed[(t, p, "ngram")])
                    for (tt, p, d) in speed if tt == t and d == "auto" and (t, p, "ngram") in speed]
            if not logs:
                continue
            rng = random.Random(0)
            means = sorted(statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(4000))
            print(f"{path}: T = {t}: hybrid / lookup alone {math.exp(statistics.fmean(logs)):.3f}x "
                  f"[{math.exp(means[100]):.3f}, {math.exp(means[3899]):.3f}] over {len(logs)} pairs")


if __name__ == "__main__":
    main()
