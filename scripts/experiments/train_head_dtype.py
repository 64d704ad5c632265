"""The restricted output head in bfloat16 against float32 while training (``train.training_head_dtype``): two heads
trained alike on the same corpus rounds (same seed, order and schedule), the only difference that layer's dtype;
prints each one's time and its validation on the held-out rounds.

    python scripts/experiments/train_head_dtype.py runs/eagle3-smollm2-135m --rounds 6 --max-tokens 120000
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
from pathlib import Path

import torch

from verispec.backends import load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus", help="a train-draft run folder holding the corpus")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=120_000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = importlib.import_module("verispec.eagle.train")  # the module (the package exports its train function)
    recipe = json.loads((Path(args.corpus) / "config.json").read_text())
    config = module.TrainConfig(rounds=args.rounds, gen_batch=recipe["gen_batch"], feature_layers=recipe["feature_layers"],
                                depths=recipe["depths"], epochs=1, max_tokens=args.max_tokens, checkpoint_every=10 ** 6)
    target = load("smollm2-135m")
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        module.training_head_dtype = lambda d=dtype: d
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            head = module.train(target, out, config, progress=False, log=lambda *a: None, corpus_dir=args.corpus)
            meta = torch.load(head, map_location="cpu", weights_only=False)["meta"]
            results[str(dtype).removeprefix("torch.")] = {"seconds": round(time.perf_counter() - t, 1),
                                                          "steps": meta["steps"], "validation": meta["validation"]}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
