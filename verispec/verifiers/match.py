"""Sampler-match and the canonical two-stage rule (docs/algorithms.md, "Rules that choose one candidate"): two exact
node rules that decide from one candidate, the floor and a selection any multi-draft rule can be compared with.

* ``match`` -- draw ``y ~ p`` from the target; accept the (first) child whose token is ``y``, else emit ``y``. The
  emitted token is ``y`` either way, so its law is ``p`` whatever the children and however they were drawn; the
  accepted child's subtree was drafted after its own token only, so the walk's law is the target's by induction.
  Acceptance at a node: ``sum_x p(x) P(x is a child)``. Engines verify so where their samplers cannot express
  ``q``; every other exact rule must do at least as well.
* ``canonical`` -- Khisti et al. 2024's canonical architecture for K i.i.d. candidates: a selection keeps one
  candidate, then single-draft speculative sampling verifies it against the law of the selected token. The paper
  leaves the selection open (its optimum is a linear program); verispec keeps the candidate earliest in ``ordered``'s
  priority order (the largest ``p(x) / q(x)`` first, ties by id; over a large vocabulary the 2,048 tokens of the
  most ``p + q`` mass first), whose law has a closed form: with ``T(x)`` the draft mass of x and every token after
  it in that order, ``P(selected = x) = T(x)^K - (T(x) - q(x))^K``. Exact by the single-draft lemma with that law as
  the draft's (for any order fixed by ``(p, q)``); the selection reads only this node's candidates, so the selected
  child's subtree is still drawn from ``q`` given its path.
"""

from __future__ import annotations

import torch

from ..probs import point_mass, residual
from .base import NodeOutcome, register_node_rule
from .ordered import priority_order


def _match_rule(draft, node, p, rng) -> NodeOutcome:
    kids = draft.tree.children[node]
    y = int(rng.categorical(p))
    for rank, child in enumerate(kids):
        if int(draft.tokens[child]) == y:
            return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, point_mass(torch.tensor(y), p.shape[-1], p.dtype), len(kids))


def selected_law(p: torch.Tensor, q: torch.Tensor, k: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """The law of the candidate ``canonical`` keeps among ``k`` i.i.d. draws from ``q``: the one earliest in
    ``ordered.priority_order`` (the largest ``p / q`` first; ``order``: that order, if already computed)."""
    p, q = p.double(), q.double()
    order = priority_order(p, q) if order is None else order
    qs = q[order]
    tail = torch.flip(torch.cumsum(torch.flip(qs, [0]), 0), [0]).clamp(0, 1)  # T(x), in that order
    law = torch.zeros_like(q)
    law[order] = tail ** k - (tail - qs).clamp_min(0) ** k
    return law


def _canonical_rule(draft, node, p, rng) -> NodeOutcome:
    kids = draft.tree.children[node]
    q, p = draft.q[node].double(), p.double()
    tokens = [int(draft.tokens[c]) for c in kids]
    if len(kids) == 1:  # one candidate: it is kept, with its own law
        law, x = q, tokens[0]
    else:
        order = priority_order(p, q)
        position = torch.empty_like(order)
        position[order] = torch.arange(order.numel())
        x = min(tokens, key=lambda t: int(position[t]))
        law = selected_law(p, q, len(kids), order)
    rank = tokens.index(x)  # the first child with the kept token
    if rng.bernoulli(torch.tensor(min(1.0, float(p[x]) / float(law[x])) if law[x] > 0 else 0.0,
                                  dtype=torch.float64)):
        return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, residual(p, law), len(kids))


register_node_rule("match", _match_rule, exact=True,
                   note="sampler-match: draw from the target, accept the child that equals it (the floor)")
register_node_rule("canonical", _canonical_rule, exact=True, children="iid",
                   note="canonical multi-draft (Khisti et al. 2024): keep the candidate with the largest p/q, then "
                        "single-draft speculative sampling against its law")
