"""The shipped EAGLE head with its own layers' weights rounded to GGUF blocks (Q8_0 or Q4_1 values), against the
head as saved (float16 values, read from float16 panels), in the decoding loop: what the head's drafting costs a
step and how often the target accepts its drafts. (``build_drafter`` drafts from Q8_0 blocks since this measured them
faster on an Intel Xeon: ``EagleHead.draft_from_blocks``.)

A draft's weights may be anything: the verifier is exact for any draft law, so rounding them changes how often
drafts are accepted, never the output law. The native kernel reads a weight that is the de-quantisation of such
blocks from the blocks themselves (``kernels._pack_exact``: 1.125 or 0.75 bytes a weight against 2), and the head's
restricted output layer (rows of the target's own table, de-quantised GGUF blocks) already is one. In the loop the
target's forward leaves the head's weights out of the caches, so the head reads them from memory every step.

Per prompt (Spec-Bench, the last questions of each category: never a benchmark's), each variant in turn (the order
alternating prompt by prompt), ``generate`` with a fixed greedy chain of each depth 0..D: per variant and depth the
mean drafting and whole-step milliseconds over the steps that drafted that deep (a prompt's first step left out),
the whole step against the same variant's plain step, and at depth D the tokens a step (greedy text is the target's
either way, so both variants are judged on the same text). The ratio of the two variants' drafting milliseconds
comes with a 95 % bootstrap interval over prompts. A timing: run it on a quiet machine.

    python scripts/experiments/head_quantised.py --format q8_0 --prompts 6 --depths 3
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from verispec import generate, load
from verispec.backends import kernels
from verispec.datasets import spec_bench_prompts
from verispec.drafters.eagle import EagleDrafter
from verispec.eagle import EagleHead
from verispec.eagle.head import shipped_head
from verispec.tree import Tree

QB = 32  # weights a GGUF block


def rounded(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w [N, K]`` rounded to the values GGUF ``fmt`` blocks of 32 weights de-quantise to (float16 scales)."""
    if fmt == "q8_0":
        return kernels.q8_0_values(w.float())
    b = w.float().reshape(w.shape[0], -1, QB)
    lo = b.amin(-1, keepdim=True).half().float()  # q4_1: d * q + m, m the block's minimum as a float16
    d = ((b.amax(-1, keepdim=True) - lo) / 15).half().float()
    q = torch.where(d > 0, torch.round((b - lo) / torch.where(d > 0, d, 1)), 0).clamp(0, 15)
    return torch.addcmul(lo, d, q).reshape(w.shape)  # d * q + m, rounded once as the kernel computes it


def quantise(head, fmt: str) -> int:
    """Round the weights of ``head``'s own linear layers in place; returns how many of them the kernel then reads as
    blocks (the others stay float16 panels: a width not a multiple of 32, or a rounding it does not recognise)."""
    blocks = 0
    for part in (head.fuse, head.fc, head.body):
        if part is None:
            continue
        for m in part.modules():
            if type(m) is torch.nn.Linear and m.weight.shape[1] % QB == 0:
                with torch.no_grad():
                    m.weight.copy_(rounded(m.weight, fmt))  # a new weight version: packed again at first use
                blocks += kernels._pack_exact(m.weight.detach(), half=True).dtype == torch.uint8
    return blocks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--format", choices=("q8_0", "q4_1"), default="q8_0")
    ap.add_argument("--prompts", type=int, default=6, help="Spec-Bench questions, the last of each category first")
    ap.add_argument("--depths", type=int, default=3, help="D: chains of 0..D tokens")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype="float32")
    variants = {fmt: EagleDrafter(EagleHead.load(shipped_head(target.name), target)) for fmt in ("float16", args.format)}
    n_linear = sum(type(m) is torch.nn.Linear for p in (variants[args.format].head.fuse, variants[args.format].head.fc,
                                                        variants[args.format].head.body) if p is not None
                   for m in p.modules())
    print(f"{args.format}: {quantise(variants[args.format].head, args.format)} of the head's {n_linear} linear "
          "layers read as blocks", flush=True)
    ids = [target.encode_prompt(p) for _, p in spec_bench_prompts(args.prompts, from_end=True)]
    names = list(variants)
    # per variant, depth: per prompt the mean drafting / whole-step seconds; at depth D the tokens a step
    draft = {v: {d: [] for d in range(args.depths + 1)} for v in names}
    whole = {v: {d: [] for d in range(args.depths + 1)} for v in names}
    tokens = {v: [] for v in names}
    for i, prompt in enumerate(ids):
        for v in (names if i % 2 == 0 else names[::-1]):
            for d in range(args.depths + 1):
                out = generate(target, variants[v], "chain", prompt, tree=Tree.chain(d) if d else Tree.root_only(),
                               children="topk", policy="fixed", max_new_tokens=args.max_new_tokens, temperature=0.0,
                               seed=i)
                steps = [s for s in out.steps[1:] if s.draft_depth == d]
                if not steps:
                    continue
                draft[v][d].append(statistics.fmean(s.draft_s for s in steps))
                whole[v][d].append(statistics.fmean(s.draft_s + s.target_s + s.verify_s for s in steps))
                if d == args.depths:
                    tokens[v].append(len(out.token_ids) / len(out.steps))
        print(f"prompt {i + 1} of {len(ids)} done", flush=True)
    rnd = random.Random(0)
    for d in range(1, args.depths + 1):
        n = min(len(draft[v][d]) for v in names)
        ratios = [draft[names[1]][d][k] / draft[names[0]][d][k] for k in range(n)]
        boot = sorted(statistics.fmean(rnd.choices(ratios, k=n)) for _ in range(2000)) if n else [float("nan")] * 2000
        cells = []
        for v in names:
            plain = statistics.fmean(whole[v][0])
            cells.append(f"{v}: draft {statistics.fmean(draft[v][d]) * 1e3:.2f} ms, step "
                         f"{statistics.fmean(whole[v][d]) * 1e3:.2f} ms = {statistics.fmean(whole[v][d]) / plain:.3f} "
                         "plain steps")
        print(f"chain of {d}: " + "; ".join(cells) + f"; drafting {names[1]} / {names[0]} "
              f"{statistics.fmean(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}] over {n} prompts")
    for v in names:
        print(f"{v}: {statistics.fmean(tokens[v]):.3f} tokens a step at a chain of {args.depths} "
              f"(per prompt: {', '.join(f'{x:.2f}' for x in tokens[v])})")


if __name__ == "__main__":
    main()
