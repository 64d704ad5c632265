"""The `auto` policy of a bfloat16 target with the shipped head's step costs (measured by ``tune-tree`` on the
float32 target) against the same policy with the bfloat16 target's own measured forwards (what
``build_drafter`` gives it since the costs apply to float32 only): the method ``default`` on Spec-Bench prompts,
the two in turn on each prompt in one process, so that a slow spell of the machine falls on both.

Reports per temperature the geometric mean of the per-prompt ratios of tokens per second after the prefill (own
costs over the sidecar's), a 95 % bootstrap interval over the prompts of both temperatures, the pooled tokens per
second and the tokens per step. A timing: run it on a quiet machine.

    python scripts/experiments/step_costs_dtype.py --prompts 12 --max-new-tokens 96
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from verispec import build_drafter, generate, load, resolve  # noqa: E402
from verispec.datasets import spec_bench_prompts  # noqa: E402
from verispec.drafters.eagle import shipped_head_path, sidecar  # noqa: E402
from verispec.methods import step_costs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="Spec-Bench prompts, round-robin over its categories")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6])
    args = ap.parse_args()
    target = load(dtype="bfloat16")
    side = tuple(sidecar(shipped_head_path(target)).get("step_costs") or ())
    if not side:
        sys.exit("the shipped head has no step costs in its sidecar")
    drafters = {"own": build_drafter("auto", target), "sidecar": build_drafter("auto", target)}
    drafters["sidecar"].model.step_costs = side
    for name, d in drafters.items():
        print(name, "step costs", [round(x, 2) for x in step_costs(target, d.model)], flush=True)
    prompts = [p for _, p in spec_bench_prompts(args.prompts)]
    logs: dict[float, list[float]] = {t: [] for t in args.temperatures}
    tokens = {k: 0 for k in drafters}
    wall = {k: 0.0 for k in drafters}
    steps = {k: 0 for k in drafters}
    for i, (t, p) in enumerate((t, p) for t in args.temperatures for p in prompts):
        rate = {}
        for name in (("own", "sidecar") if i % 2 == 0 else ("sidecar", "own")):
            d = drafters[name]
            run = resolve("default", temperature=t).build(target, d)
            out = generate(target, d, run.verifier, p, tree=run.tree, policy=run.policy, children=run.children,
                           verifier_state=run.verifier_state, max_new_tokens=args.max_new_tokens, temperature=t,
                           seed=i)
            decode_s = out.wall_s - out.prefill_s  # at T > 0 the two sample texts of other lengths: the prompt's
            rate[name] = len(out.token_ids) / decode_s  # prefill would weigh on the shorter one
            tokens[name] += len(out.token_ids)
            wall[name] += decode_s
            steps[name] += len(out.steps)
        logs[t].append(math.log(rate["own"] / rate["sidecar"]))
        print(f"T={t:g} prompt {i % len(prompts)}: own {rate['own']:.1f}, sidecar {rate['sidecar']:.1f} tokens/s",
              flush=True)
    every = [x for v in logs.values() for x in v]
    rng = random.Random(0)
    boot = sorted(math.exp(statistics.mean(rng.choice(every) for _ in every)) for _ in range(2000))
    print(json.dumps({
        "own_over_sidecar": {f"T={t:g}": round(math.exp(statistics.mean(v)), 3) for t, v in logs.items()},
        "all": round(math.exp(statistics.mean(every)), 3), "interval_95": [round(boot[50], 3), round(boot[1949], 3)],
        "tokens_per_s": {k: round(tokens[k] / wall[k], 1) for k in drafters},
        "tokens_per_step": {k: round(tokens[k] / steps[k], 2) for k in drafters},
    }, indent=1))


if __name__ == "__main__":
    main()
