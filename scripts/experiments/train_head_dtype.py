"""The restricted output head in bfloat16 against float32 while training (``train.TRAIN_HEAD_DTYPE``): two heads
trained alike on the same corpus rounds (same seed, order and schedule), the only difference that layer's dtype;
prints each one's time and, for each, the held-out rounds' validation as drafting reads the saved head (its output
layer in bfloat16, ``EagleHead.load``) and with that layer in float32.

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
from verispec.eagle import EagleHead
from verispec.eagle.corpus import read_corpus


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
    corpus = Path(args.corpus)
    records = [r for r in read_corpus(corpus) if r.round < args.rounds]
    _, val_idx = module._split(records, config)
    feats = module._Features(corpus, records, recipe["corpus"], config.layers(), config.top_k,
                             target.config.hidden_size, target.num_layers)
    val = [feats[i] for i in val_idx[:module.VALIDATION]]
    results = {}
    for dtype in (torch.bfloat16, torch.float32):
        module.TRAIN_HEAD_DTYPE = dtype
        with tempfile.TemporaryDirectory() as out:
            t = time.perf_counter()
            path = module.train(target, out, config, progress=False, log=lambda *a: None, corpus_dir=args.corpus)
            seconds = time.perf_counter() - t
            drafting = EagleHead.load(path, target)  # its output layer in bfloat16, as drafting reads it
            exact = EagleHead(target, drafting.vocab, head_dtype=torch.float32, feature_layers=drafting.feature_layers)
            exact.load_state_dict(drafting.head_state(), strict=False)
            results[f"trained {str(dtype).removeprefix('torch.')}"] = {
                "seconds": round(seconds, 1), "steps": torch.load(path, weights_only=False)["meta"]["steps"],
                **{f"evaluated {name}": {k: round(v, 4) for k, v in module.evaluate(h, val, 3).items()}
                   for name, h in (("bfloat16", drafting), ("float32", exact))}}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
