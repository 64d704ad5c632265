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

from verispec.bench.records import Results
from verispec.bench.stats import ratio_of_rates


def ratio(mine: list[dict], base: list[dict], decode: bool) -> tuple[float, float, float]:
    """Summed tokens over summed seconds of ``mine`` over the same of ``base`` (paired cells), and its interval."""
    def seconds(r: dict) -> float:
        return r["wall_s"] - (r["prefill_s"] if decode else 0.0)
    return ratio_of_rates([r["tokens"] for r in mine], [seconds(r) for r in mine],
                          [r["tokens"] for r in base], [seconds(r) for r in base])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", help="a speed run's records (.jsonl or .jsonl.gz)")
    ap.add_argument("--base", default="ar", help="the method every other is compared with")
    args = ap.parse_args()
    cells: dict[tuple, dict] = collections.defaultdict(dict)  # (T, method, draft) -> (seed, prompt) -> record
    category: dict[str, str] = {}
    for r in Results.load(args.records).prompts:
        if r.get("prefill_s") is None:
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
