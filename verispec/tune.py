"""``verispec tune-tree``: measure a target/draft pair on this machine and pick its tree (``treesearch``)."""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from .backends.costs import target_forward_cost
from .backends.kernels import calibrate, use_fast_linear
from .datasets import spec_bench_prompts
from .decode import generate
from .metrics import per_candidate_acceptance
from .probs import Sampling
from .rng import TorchRandomness
from .tree import Tree
from .treesearch import best_shape, positional_acceptance, tree_spec
from .verifiers import get_verifier

VERIFIER_FOR = {"iid": "specinfer", "swor": "swor", "topk": "topk"}


def draft_cost_model(drafter, context: list[int], sampling: Sampling, children: str, repeats: int = 3):
    """Fit ``seconds = a * depth + b * nodes`` to the drafter's proposals of a few shapes after ``context`` (the
    context the drafter last decoded, so that it holds whatever it needs for it, e.g. the target's features)."""
    shapes = [Tree.chain(1), Tree.chain(4), Tree.complete(4, 1), Tree.complete(2, 3), Tree.complete(4, 2)]
    rows, ys = [], []
    rng = TorchRandomness(0)
    for shape in shapes:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            drafter.propose(context, shape, sampling, children, rng)
            times.append(time.perf_counter() - t)
        rows.append([shape.max_depth, shape.size - 1])
        ys.append(statistics.median(times))
    a, b = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64), torch.tensor(ys, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    return max(a, 0.0), max(b, 0.0)


def loop_step_costs(target, drafter, verifier, prompts: list[list[int]], temperature: float, children: str,
                    max_depth: int, max_new_tokens: int) -> list[float] | None:
    """What a decoding step that drafts a chain of d tokens costs against a plain step, d = 0..``max_depth``, as the
    loop pays it: the mean of whole steps (the draft with its catch-up on the tokens the last step committed, the
    target's forward, verification) of ``generate`` with a fixed chain of each depth on the same prompts, the depths
    taking turns prompt by prompt, over the steps that drafted that deep; a prompt's first step (the draft's catch-up
    on the whole prompt) left out. Never decreasing; None where some depth ran no such step."""
    seconds: dict[int, list[float]] = {d: [] for d in range(max_depth + 1)}
    for i, prompt in enumerate(prompts):
        for d in range(max_depth + 1):
            out = generate(target, drafter, verifier, prompt, tree=Tree.chain(d) if d else Tree.root_only(),
                           children=children, policy="fixed", max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=i)
            seconds[d] += [s.draft_s + s.target_s + s.verify_s for s in out.steps[1:] if s.draft_depth == d]
    if not all(seconds.values()):
        return None
    plain = statistics.fmean(seconds[0])
    return list(itertools.accumulate((statistics.fmean(seconds[d]) / plain for d in range(max_depth + 1)), max))


def tune_tree(target, drafter, *, temperature: float = 0.0, children: str = "iid", prompts: int = 4,
              max_new_tokens: int = 48, width: int = 4, max_nodes: int = 48, max_depth: int = 8, log=print,
              calibrate_kernels: bool = True) -> dict:
    """Measure and search (see the module docstring). For a float32 Hugging Face target the linear-kernel plan is
    calibrated first (``verispec.backends.kernels``) and used for every measurement that follows."""
    texts = [p for _, p in spec_bench_prompts(prompts, from_end=True)]  # never the benchmark's first questions
    ids = [target.encode_prompt(t) for t in texts]
    sizes = sorted({1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, max_nodes + 1})
    kernel = None
    if calibrate_kernels and target.backend == "hf" and next(target.hf.parameters()).dtype == torch.float32:
        log("choosing the linear kernel per row count ...")
        kernel = calibrate(target)
        use_fast_linear(target.hf, tuple(kernel["plan"]))
    log("measuring the target's forward cost by tree size ...")
    fwd = target_forward_cost(target, ids[0], sizes)
    log("measuring acceptance ...")
    probe = Tree.complete(width, 2)
    steps = []
    for i, prompt in enumerate(ids):
        out = generate(target, drafter, get_verifier(VERIFIER_FOR[children]), prompt, tree=probe, policy="fixed",
                       children=children,
                       max_new_tokens=max_new_tokens, temperature=temperature, seed=i)
        steps += out.steps
    conditional = per_candidate_acceptance(steps, width)
    p = positional_acceptance(conditional)
    log("measuring the draft's cost by depth and size ...")
    a, b = draft_cost_model(drafter, out.prompt_ids + out.token_ids, Sampling(temperature), children)

    def fwd_cost(n: int) -> float:
        lo = max(s for s in sizes if s <= n)
        hi = min((s for s in sizes if s >= n), default=lo)
        if hi == lo:
            return fwd[lo]
        return fwd[lo] + (fwd[hi] - fwd[lo]) * (n - lo) / (hi - lo)

    def step_cost(n: int, d: int) -> float:
        return fwd_cost(n + 1) + a * d + b * n

    best, choices = best_shape(p, step_cost, max_nodes=max_nodes, max_depth=max_depth)
    # a chain of d drafted tokens against a plain step by the parts above (never cheaper deeper, timing noise aside)
    model_costs = list(itertools.accumulate((step_cost(d, d) / fwd_cost(1) if d else 1.0
                                             for d in range(max_depth + 1)), max))
    # and as whole steps of the loop cost it: what the auto policy weighs depths by (the parts above leave out the
    # verification, the draft's catch-up and the loop's own work: docs/design.md, "Step costs as the loop pays them")
    log("measuring whole decoding steps by drafted depth ...")
    step_costs = loop_step_costs(target, drafter, get_verifier(VERIFIER_FOR[children]), ids, temperature, children,
                                 max_depth, max_new_tokens)
    chain = max((c for c in choices if c.tree.is_chain or c.nodes == 0), key=lambda c: c.tokens_per_cost)
    if step_costs:
        log(f"a step drafting 1..{max_depth} tokens costs {[round(c, 2) for c in step_costs[1:]]} plain steps "
            f"(by parts: {[round(c, 2) for c in model_costs[1:]]})")
    log(f"per-candidate acceptance {[round(x, 3) for x in conditional]}; best tree {best.nodes} nodes, depth "
        f"{best.depth}: {best.accepted:.2f} tokens per step, predicted {best.tokens_per_cost / (1 / fwd[1]):.2f}x "
        f"plain decoding (best chain: {chain.nodes} tokens, {chain.tokens_per_cost / (1 / fwd[1]):.2f}x)")
    return {
        "target": target.name, "draft": drafter.name, "temperature": temperature, "children": children,
        "conditional_acceptance": conditional, "positional_acceptance": p,
        "target_forward_s": {str(k): v for k, v in fwd.items()}, "draft_s_per_depth": a, "draft_s_per_node": b,
        "best": {"tree": tree_spec(best.tree), "nodes": best.nodes, "depth": best.depth, "accepted": best.accepted,
                 "predicted_speedup": best.tokens_per_cost * fwd[1]},
        "best_chain": {"tree": tree_spec(chain.tree), "accepted": chain.accepted,
                       "predicted_speedup": chain.tokens_per_cost * fwd[1]},
        "step_costs": step_costs or model_costs, "step_costs_from": "loop" if step_costs else "parts",
        "step_costs_by_parts": model_costs,
        "kernel_plan": None if kernel is None else kernel["plan"],
        "kernel_ms": None if kernel is None else kernel["ms"],
    }
