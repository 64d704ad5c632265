"""A float32 prompt's prefill with its rows on the native linear kernel (``kernels.default_plan()``) against the plan
``verispec.backends.load`` gives (``kernels.prompt_plan()``: more than 16 rows on the kernel ``prompt_entry``
measured faster here, a prompt's rows in blocks of ``LeanLlama.PROMPT_BLOCK``), alternated in one process on the same
random prompt; then, with ``--concurrency``, closed loops of plain decoding (``ar``) of the 18 Spec-Bench requests
of the speed run at each N, the two plans taking turns. A measurement, not the benchmark.

    python scripts/experiments/prompt_kernel.py --tokens 284 --pairs 3
    python scripts/experiments/prompt_kernel.py --pairs 0 --concurrency 1 8 --loop-pairs 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec import load
from verispec.backends import kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=284, help="prompt length (Spec-Bench's mean is about 284)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="prefills timed per plan and pair")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[], help="closed loops at these N (none: skip)")
    ap.add_argument("--loop-pairs", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load("smollm2-135m", dtype="float32")
    ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill() -> float:
        state = target.new_state()
        t = time.perf_counter()
        target.prefill_output(state, ids)
        return time.perf_counter() - t

    plans = {"native": kernels.default_plan(), "prompt": kernels.prompt_plan()}
    times: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(args.pairs):
        for name, plan in plans.items():
            kernels.use_fast_linear(target.hf, plan)
            prefill()  # panels and caches warm
            times[name] += [prefill() for _ in range(args.repeats)]
    for name, ts in times.items():
        if not ts:
            continue
        med = statistics.median(ts)
        print(f"{name} ({plans[name][-1]} for more than {kernels.MAX_ROWS} rows): prefill of {args.tokens} tokens "
              f"{1000 * med:.0f} ms median of {len(ts)} ({args.tokens / med:.0f} tokens/s)")
    if args.pairs:
        print(f"ratio: {statistics.median(times['native']) / statistics.median(times['prompt']):.2f}x")
    print(f"prompt_entry: {kernels.prompt_entry()} (0: the stock kernel, {kernels.NATIVE}: the native one)")
    if not args.concurrency:
        return
    from verispec.bench.concurrency import verispec_loop
    from verispec.datasets import spec_bench_problems
    from verispec.drafters import build_drafter
    from verispec.methods import resolve

    problems = spec_bench_problems(3)
    prompts = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
    plain, drafter = resolve("ar", temperature=0.0), build_drafter("none", target)
    for n in args.concurrency:
        rates: dict[str, list[float]] = {name: [] for name in plans}
        for _ in range(args.loop_pairs):
            for name, plan in plans.items():
                kernels.use_fast_linear(target.hf, plan)
                t = time.perf_counter()
                reqs = verispec_loop(target, plain, drafter, problems, prompts, n, 0.0, 0, 128)
                rates[name].append(sum(len(r.token_ids) for r in reqs) / (time.perf_counter() - t))
        ratios = [b / a for a, b in zip(rates["native"], rates["prompt"])]
        print(f"ar, N = {n}: native " + ", ".join(f"{r:.1f}" for r in rates["native"]) + "; prompt "
              + ", ".join(f"{r:.1f}" for r in rates["prompt"]) + " tokens/s; per pair "
              + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
