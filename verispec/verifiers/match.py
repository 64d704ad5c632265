"""Sampler-match and the canonical two-stage rule (docs/algorithms.md, "Rules that choose one candidate"): two exact
node rules that decide from one candidate, the floor and a selection any multi-draft rule can be compared with.

* ``match`` -- draw ``y ~ p`` from the target; accept the (first) child whose token is ``y``, else emit ``y``. The
  emitted token is ``y`` either way, so its law is ``p`` whatever the children and however they were drawn; the
  accepted child's subtree was drafted after its own token only, so the walk's law is the target's by induction.
  Acceptance at a node: ``sum_x p(x) P(x is a child)``. Engines verify so where their samplers cannot express
  ``q``; every other exact rule must do at least as well.
* ``canonical`` -- Khisti et al. 2024's canonical architecture for K i.i.d. candidates: a selection keeps one
  candidate, then single-draft speculative sampling verifies it against the law of the selected token. The paper
  leaves the selection open (its optimum is a linear program); verispec keeps the candidate with the largest
  ``p(x) / q(x)`` (ties: the smaller token id), whose law has a closed form: with tokens ordered best first and
  ``T(x)`` the draft mass of x and every token after it, ``P(selected = x) = T(x)^K - (T(x) - q(x))^K``. Exact by
  the single-draft lemma with that law as the draft's; the selection reads only this node's candidates, so the
  selected child's subtree is still drawn from ``q`` given its path.
"""

from __future__ import annotations

import torch

from ..probs import point_mass, residual
from .base import NodeOutcome, register_node_rule


def _match_rule(draft, node, p, rng) -> NodeOutcome:
    kids = draft.tree.children[node]
    y = int(rng.categorical(p))
    for rank, child in enumerate(kids):
        if int(draft.tokens[child]) == y:
            return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, point_mass(torch.tensor(y), p.shape[-1], p.dtype), len(kids))


def selected_law(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """The law of the candidate ``canonical`` keeps among ``k`` i.i.d. draws from ``q``: the best by ``p / q``."""
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, -1.0))
    ids = torch.arange(p.numel())
    order = ids[torch.argsort(-ratio[ids], stable=True)]  # best first; ties keep the smaller id first
    tail = torch.flip(torch.cumsum(torch.flip(q[order], [0]), 0), [0]).clamp(0, 1)  # T(x), in that order
    law = torch.zeros_like(q)
    law[order] = tail ** k - (tail - q[order]).clamp_min(0) ** k
    return law


def _canonical_rule(draft, node, p, rng) -> NodeOutcome:
    """Keep the best candidate by ``p / q``; its law at the kept token needs only the draft mass of the tokens at or
    after it in that order (no sort), and the whole law (one sort) only after a rejection, for the residual."""
    kids = draft.tree.children[node]
    q, p = draft.q[node].double(), p.double()
    tokens = [int(draft.tokens[c]) for c in kids]
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(q, -1.0))
    best = max(range(len(kids)), key=lambda i: (float(ratio[tokens[i]]), -tokens[i], -i))
    x, rank = tokens[best], tokens.index(tokens[best])  # the first child with that token
    r = ratio[x]
    after = (ratio < r) | ((ratio == r) & (torch.arange(q.numel()) >= x))  # x and every token after it
    tail = float(q[after].sum())
    kept = tail ** len(kids) - max(tail - float(q[x]), 0.0) ** len(kids)  # P(selected = x)
    if rng.bernoulli(torch.tensor(min(1.0, float(p[x]) / kept) if kept > 0 else 0.0, dtype=torch.float64)):
        return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, residual(p, q if len(kids) == 1 else selected_law(p, q, len(kids))), len(kids))


register_node_rule("match", _match_rule, exact=True,
                   note="sampler-match: draw from the target, accept the child that equals it (the floor)")
register_node_rule("canonical", _canonical_rule, exact=True, children="iid",
                   note="canonical multi-draft (Khisti et al. 2024): keep the candidate with the largest p/q, then "
                        "single-draft speculative sampling against its law")
