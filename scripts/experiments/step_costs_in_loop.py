"""What a decoding step cost in a benchmark run's loop, read from its records (``verispec bench``; not timed anew):
per method and temperature, by draft source and drafted depth, the steps' mean drafting, target and verification
milliseconds, accepted length, milliseconds per emitted token, and the whole step against the mean plain step of
the ``ar`` cell at the same temperature (the cost the ``auto`` policy weighs a depth by). A prompt's first step (the
draft's catch-up on the whole prompt) is left out.

    python scripts/experiments/step_costs_in_loop.py results/speed_norm.jsonl.gz --methods ar default
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records")
    ap.add_argument("--methods", nargs="+", default=["ar", "default"])
    args = ap.parse_args()
    with gzip.open(args.records, "rt") as f:
        steps = [r for r in map(json.loads, f) if r.get("type") == "step" and r.get("i", 0) > 0]
    temperatures = sorted({r["cell"]["T"] for r in steps})
    for t in temperatures:
        plain = [r["draft_s"] + r["target_s"] + r["verify_s"] for r in steps
                 if r["cell"]["T"] == t and r["cell"]["method"] == "ar"]
        base = statistics.fmean(plain) if plain else float("nan")
        for method in args.methods:
            groups = collections.defaultdict(list)
            for r in steps:
                if r["cell"]["T"] == t and r["cell"]["method"] == method:
                    groups[(r.get("source") or "-", r.get("draft_depth", 0))].append(r)
            print(f"T = {t}, {method}: {sum(map(len, groups.values()))} steps (a plain ar step: {base * 1e3:.2f} ms)")
            for (source, depth), rs in sorted(groups.items()):
                d, g, v = (statistics.fmean(r[k] for r in rs) * 1e3 for k in ("draft_s", "target_s", "verify_s"))
                acc = statistics.fmean(r["accepted_length"] for r in rs)
                print(f"  {source:>6} depth {depth}: {len(rs):5d} steps, draft {d:5.2f} target {g:5.2f} "
                      f"verify {v:4.2f} ms, accepted {acc:.2f}, {(d + g + v) / acc:5.2f} ms a token, "
                      f"{(d + g + v) / 1e3 / base:.2f} plain steps")


if __name__ == "__main__":
    main()
