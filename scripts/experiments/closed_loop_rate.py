"""Tokens per second of ``generate_batch`` on Spec-Bench prompts with N in flight (a finished prompt's slot goes to
the next): a quick check of the batched engine's speed, not the benchmark (``verispec bench --concurrency``).

    python scripts/experiments/closed_loop_rate.py --prompts 16 --max-batch 8 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec import generate_batch, load
from verispec.datasets import spec_bench_problems
from verispec.drafters import NoDrafter, build_drafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft", default="none", help="none (plain decoding, `ar`) or a draft spec, e.g. auto")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype=args.dtype)
    prompts = [p.prompt for p in spec_bench_problems(2)][:args.prompts]
    draft = NoDrafter() if args.draft == "none" else build_drafter(args.draft, target, dtype=args.dtype)
    tree = "none" if args.draft == "none" else "auto"
    generate_batch(target, draft, "chain", prompts[:2], tree=tree, policy="fixed", max_new_tokens=4,
                   temperature=args.temperature)
    t = time.perf_counter()
    res = generate_batch(target, draft, "chain", prompts, tree=tree, policy="fixed", max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, max_batch=args.max_batch)
    seconds = time.perf_counter() - t
    tokens = sum(len(r.token_ids) for r in res)
    print(f"{len(prompts)} prompts, {args.max_batch} in flight, {args.dtype}, draft {args.draft}, T = "
          f"{args.temperature}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s")


if __name__ == "__main__":
    main()
