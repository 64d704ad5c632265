"""Greedy verification (temperature 0): follow the child equal to ``argmax p`` while one exists,
then emit ``argmax p``. Works on any tree. Exact for greedy decoding only: it ignores the sampling
temperature and always reproduces the target's greedy output."""

from __future__ import annotations

import torch

from ..probs import argmax, point_mass
from .base import NodeOutcome, register_node_rule


def _greedy_rule(draft, node, p, rng):
    best = int(argmax(p))
    kids = draft.tree.children[node]
    for rank, child in enumerate(kids):
        if int(draft.tokens[child]) == best:
            return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, point_mass(torch.tensor(best), p.numel(), p.dtype), len(kids))


register_node_rule("greedy", _greedy_rule, exact=True, greedy_only=True,
                   note="argmax walk; equals the target's greedy decoding (temperature 0)")
