"""What one llama.cpp decode of k chained tokens costs against one token, with logits for every row (what verification
needs) and for the last row only (what plain decoding of a prompt chunk asks for), for the built-in GGUF models.

    python scripts/experiments/llama_batch_costs.py            # needs llama-cpp-python (bash scripts/install_llama.sh); about a minute
    -> results/llama_batch_costs.json, read by scripts/make_results.py

Run it on a quiet machine: each figure is the median of 9 decodes after a 120-token context.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from verispec.backends import load
from verispec.bench.records import git_revision, machine

ROOT = Path(__file__).resolve().parents[2]
SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
MODELS = ("smollm2-135m", "gemma3-270m")


def decode_seconds(target, context: list[int], k: int, last_only: bool, repeats: int = 9) -> float:
    times = []
    for _ in range(repeats):
        state = target.new_state()
        target.prefill(state, context[:-1])
        tokens = torch.tensor(context[-1:] + [300 + i for i in range(k - 1)])
        positions = state.committed + torch.arange(k)
        attend = torch.tril(torch.ones(k, state.pending + k, dtype=torch.bool), diagonal=state.pending)
        t = time.perf_counter()
        target.forward(state, tokens, positions, attend, last_logits_only=last_only)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "results" / "llama_batch_costs.json"))
    args = ap.parse_args()
    out = {"threads": args.threads, "sizes": list(SIZES), "models": {}, "git": git_revision(),
           "command": " ".join(["python scripts/experiments/llama_batch_costs.py", *sys.argv[1:]]),
           "machine": machine()}
    for name in MODELS:
        target = load(name, backend="llama", threads=args.threads)
        context = target.encode_prompt("Write a long story about a river and a mill. " * 8)
        one = decode_seconds(target, context, 1, True)
        rows = {"one_token_ms": 1000 * one,
                "all_logits": [decode_seconds(target, context, k, False) / one for k in SIZES],
                "last_logits": [decode_seconds(target, context, k, True) / one for k in SIZES]}
        out["models"][name] = rows
        print(name, f"{rows['one_token_ms']:.1f} ms;", "all logits",
              " ".join(f"{k}:{x:.2f}" for k, x in zip(SIZES, rows["all_logits"])), "| last only",
              " ".join(f"{k}:{x:.2f}" for k, x in zip(SIZES, rows["last_logits"])))
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
