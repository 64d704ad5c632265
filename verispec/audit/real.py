"""Real (p, q) pairs: the default model's and a draft's distributions along the target's own samples."""

from __future__ import annotations

import torch

from ..datasets import spec_bench_prompts
from ..decode import generate
from ..drafters import NoDrafter
from ..probs import Sampling, logits_to_probs
from ..tree import Tree
from ..verifiers import get_verifier


def real_pairs(target, drafter, n_prompts: int, positions: int, temperature: float, seed: int = 0):
    """``[(p, q)]`` float64 pairs at ``positions`` response positions of ``n_prompts`` Spec-Bench prompts
    (``real_pairs_by_prompt``'s, one list)."""
    return [pair for pairs in real_pairs_by_prompt(target, drafter, n_prompts, positions, temperature, seed)
            for pair in pairs]


def real_pairs_by_prompt(target, drafter, n_prompts: int, positions: int, temperature: float, seed: int = 0):
    """Per Spec-Bench prompt, the ``[(p, q)]`` float64 pairs at ``positions`` of its response positions.

    The target samples its own response (plain decoding), then one forward of each model over prompt +
    response gives both distributions at every response position. ``drafter`` must hold a ``model``.
    """
    sampling = Sampling(temperature)
    for i, (_, prompt) in enumerate(spec_bench_prompts(n_prompts)):
        out = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(),
                       max_new_tokens=positions, temperature=temperature, seed=seed + i)
        seq, n = out.prompt_ids + out.token_ids, len(out.token_ids)
        with torch.no_grad():
            p_logits = target.hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -n - 1:-1]
            q_logits = drafter.model.hf(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -n - 1:-1]
        yield list(zip(logits_to_probs(p_logits.double(), sampling), logits_to_probs(q_logits.double(), sampling)))
