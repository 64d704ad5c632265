"""Collect the validation curves of several `verispec train-draft` runs into one JSON file, for the head comparison
in docs/results.md (`python scripts/make_results.py --render` draws it).

    python scripts/experiments/head_variants.py runs/e3 runs/e1 --out results/head_variants.json

Each run contributes its training options (config.json) and, for every checkpoint of its last training from
scratch, the number of training sequences seen so far and the held-out agreement per depth (``val_top1_k``) and
greedy chain acceptance (``val_chain_k``) -- agreement against data seen, within one schedule.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path) -> dict:
    config = json.loads((run / "config.json").read_text())
    log = [json.loads(line) for line in (run / "log.jsonl").open()]
    log = log[max(i for i, r in enumerate(log) if r["step"] == 1):]  # the last training from scratch
    points = []
    for r in log:
        if "val_top1_1" in r:
            depths = sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("val_top1_"))
            points.append({"step": r["step"], "sequences_seen": r["step"] * config["batch"],
                           "agreement": [r[f"val_top1_{k}"] for k in depths],
                           "chain": [r[f"val_chain_{k}"] for k in depths]})
    elapsed = sum(r["elapsed_s"] for i, r in enumerate(log) if i + 1 == len(log) or log[i + 1]["elapsed_s"] < r["elapsed_s"])
    return {"run": str(run), "config": config, "points": points, "elapsed_s": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="folders of 'verispec train-draft' runs")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    data = {Path(r).name: curve(Path(r)) for r in args.runs}
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(f"wrote {args.out}: " + ", ".join(f"{k} ({len(v['points'])} checkpoints)" for k, v in data.items()))


if __name__ == "__main__":
    main()
