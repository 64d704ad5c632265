"""The draft head's restricted output layer (``eagle.head._SubsetHead``: 16,384 rows of the default model's output
head) in the arithmetics it can draft in: the native kernel on the target's Q8_0 blocks (the default for a float32
target since this script's commit: no rounding), the native kernel on float16 panels (the default before it where
bfloat16 arithmetic is missing), and oneDNN's bfloat16 (the default before it where it is present). First the layer
alone for 1 to 16 rows; then the default's closed loops on Spec-Bench requests with the old default's arithmetic
and the new one's, taking turns (greedy: the same tokens, only the drafts' cost and acceptance differ). A
measurement, not the benchmark.

    python scripts/experiments/subset_head.py --concurrency 1 2 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from verispec import load
from verispec.backends import kernels
from verispec.bench.concurrency import verispec_loop
from verispec.datasets import spec_bench_problems
from verispec.drafters import build_drafter
from verispec.eagle.head import _SubsetHead
from verispec.methods import resolve


def subset(full, vocab, how: str) -> _SubsetHead:
    """The layer in one arithmetic, packed now (float16 panels: packed with the GGUF blocks turned off)."""
    if how == "bfloat16":
        return _SubsetHead(full, vocab, torch.bfloat16)
    layer = _SubsetHead(full, vocab, torch.float32)
    if how == "float16":
        os.environ[kernels.FLOAT_PANELS] = "1"
    try:
        with torch.inference_mode():
            layer(torch.zeros(1, layer.weight.shape[1]))
    finally:
        os.environ.pop(kernels.FLOAT_PANELS, None)
    return layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    target = load("smollm2-135m")
    drafter = build_drafter("auto", target)
    head = drafter.model.head
    full, vocab = target.hf.get_output_embeddings(), head.vocab
    ways = {how: subset(full, vocab, how) for how in ("q8_0 blocks", "float16", "bfloat16")}
    if not kernels.packing_available():
        del ways["bfloat16"]
    print("the layer alone, ms (median of 100, the arithmetics taking turns):")
    for rows in (1, 2, 3, 4, 8, 16):
        x = torch.randn(rows, full.weight.shape[1])
        times: dict[str, list[float]] = {how: [] for how in ways}
        with torch.inference_mode():
            for r in range(110):
                for how in (list(ways) if r % 2 else list(ways)[::-1]):
                    t0 = time.perf_counter()
                    ways[how](x)
                    times[how].append(time.perf_counter() - t0)
        medians = {how: statistics.median(t[10:]) * 1e3 for how, t in times.items()}
        print(f"  {rows:2d} rows: " + ", ".join(f"{how} {ms:.3f}" for how, ms in medians.items()))

    old = "bfloat16" if "bfloat16" in ways else "float16"
    loops = {f"before ({old})": ways[old], "now (q8_0 blocks)": ways["q8_0 blocks"]}
    problems = spec_bench_problems(args.limit)
    ids = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
    plan = resolve("default", temperature=0.0)
    for n in args.concurrency:
        verispec_loop(target, plan, drafter, problems[:n], ids[:n], n, 0.0, 0, 16)  # warm: costs measured, kernels
        rates: dict[str, list[float]] = {name: [] for name in loops}
        texts: dict[str, list] = {}
        for r in range(args.rounds):
            for name in (list(loops) if r % 2 == 0 else list(loops)[::-1]):
                head.lm.hf.set_output_embeddings(loops[name])
                t0 = time.perf_counter()
                reqs = verispec_loop(target, plan, drafter, problems, ids, n, 0.0, 0, args.max_new_tokens)
                wall = time.perf_counter() - t0
                tokens = sum(len(q.token_ids) for q in reqs)
                steps = sum(len(q.steps) for q in reqs)
                rates[name].append(tokens / wall)
                texts[name] = [q.token_ids for q in reqs]
                print(f"N = {n}, round {r + 1}, {name}: {tokens / wall:.1f} tokens/s, {tokens / steps:.2f} tokens a "
                      "request step", flush=True)
        a, b = (statistics.mean(v) for v in rates.values())
        print(f"N = {n}: now / before {b / a:.3f} (mean of {args.rounds} rounds each); greedy tokens equal: "
              f"{texts[list(loops)[0]] == texts[list(loops)[1]]}")
    head.lm.hf.set_output_embeddings(ways["q8_0 blocks"])


if __name__ == "__main__":
    main()
