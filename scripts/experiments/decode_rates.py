"""Decoding speed without the prompt: each verispec method of a speed run against `ar`, by Spec-Bench category, from
the run's records. A request's tokens/s counts its prefill; where prompts are long (rag, summarization) the prefill is
half a request's time, and at T > 0 two methods draw texts of different lengths for the same prompt and seed, so an
answer that ends early sinks a category's ratio whatever the decoding. Here each method's rate is its tokens over its
wall time less its prefill (``prefill_s``, recorded by verispec's loops only: peers are left out), summed over the
(seed, prompt) cells both methods have, with a 95 % percentile bootstrap over those cells.

    python scripts/experiments/decode_rates.py results/speed_seeds.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json

import numpy as np


def ratio(mine: list[dict], base: list[dict], decode: bool, n: int = 2000, seed: int = 0):
    """Summed tokens over summed seconds of ``mine`` over the same of ``base`` (paired cells), and its interval."""
    def parts(r: dict) -> tuple[float, float]:
        return r["tokens"], r["wall_s"] - (r["prefill_s"] if decode else 0.0)
    a, b = np.array([parts(r) for r in mine]), np.array([parts(r) for r in base])
    idx = np.random.default_rng(seed).integers(0, len(a), size=(n, len(a)))
    draws = (a[idx, 0].sum(1) / a[idx, 1].sum(1)) / (b[idx, 0].sum(1) / b[idx, 1].sum(1))
    low, high = np.percentile(draws, [2.5, 97.5])
    return (a[:, 0].sum() / a[:, 1].sum()) / (b[:, 0].sum() / b[:, 1].sum()), low, high


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="a speed run's records (.jsonl or .jsonl.gz)")
    ap.add_argument("--base", default="ar", help="the method every other is compared with")
    args = ap.parse_args()
    opener = gzip.open if args.records.endswith(".gz") else open
    cells: dict[tuple, dict] = collections.defaultdict(dict)  # (T, method, draft) -> (seed, prompt) -> record
    category: dict[str, str] = {}
    with opener(args.records, "rt") as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") != "prompt" or r.get("prefill_s") is None:
                continue
            c = r["cell"]
            cells[(c["T"], c["method"], c["draft"])][(c["seed"], c["prompt"])] = r
            category[c["prompt"]] = r["category"]
    for (t, method, draft), mine in sorted(cells.items()):
        base = next((v for (bt, m, _), v in cells.items() if bt == t and m == args.base), None)
        if method == args.base or base is None:
            continue
        shared = sorted(set(mine) & set(base))
        print(f"T = {t:g}: {method} ({draft}) against {args.base}, {len(shared)} cells")
        for name in ["all", *sorted({category[p] for _, p in shared})]:
            keys = [k for k in shared if name == "all" or category[k[1]] == name]
            a, b = [mine[k] for k in keys], [base[k] for k in keys]
            w, d = ratio(a, b, decode=False), ratio(a, b, decode=True)
            print(f"  {name:15s} with prefill {w[0]:.2f}x [{w[1]:.2f}, {w[2]:.2f}]   "
                  f"decoding alone {d[0]:.2f}x [{d[1]:.2f}, {d[2]:.2f}]")


if __name__ == "__main__":
    main()
