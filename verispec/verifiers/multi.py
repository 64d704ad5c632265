"""Multi-candidate tree verifiers built on sequential sibling tests (docs/algorithms.md, "Tree rules over one draft").

The lemma (docs/algorithms.md, "The lemma: testing candidates one at a time"): a node tests its candidates one at a time; at stage j it holds a current
target ``r_j`` and the true conditional law ``q_j`` of candidate ``x_j`` given all earlier draws, and
accepts with ``min(1, r_j(x)/q_j(x))``. The emitted token has law ``r_1 = p`` iff, after a rejection, the
next target is ``norm((r_j - q_j)_+)`` -- the same whichever candidate was rejected. Each rule below
differs only in the law ``q_j`` its children were drawn from:

* ``specinfer`` -- i.i.d. children: ``q_j = q`` for every j (duplicates included: a repeated rejected
  token must still update the residual, or the law is biased);
* ``swor`` -- without replacement: ``q_j = norm(q * [x not in x_1..x_{j-1}])``;
* ``topk`` -- deterministic top-k children: ``q_j`` is a point mass on ``x_j``, so the test accepts with
  ``r_j(x_j)`` and the residual is ``norm(r_j * [x != x_j])``.
All rejected: the recovered token is drawn from the last residual.
"""

from __future__ import annotations

import torch

from ..probs import residual
from .base import NodeOutcome, register_node_rule


def accept(rng, r: torch.Tensor, law: torch.Tensor, x: int) -> bool:
    """One coin with probability ``min(1, r(x) / law(x))`` (0 where the law has no mass)."""
    ratio = float(r[x]) / float(law[x]) if float(law[x]) > 0 else 0.0
    return bool(rng.bernoulli(torch.tensor(min(1.0, ratio), dtype=torch.float64)))


def sequential_tests(draft, node, p, rng, update) -> NodeOutcome:
    """Test the i.i.d. children of ``node`` in draw order against a running law ``r`` (``p`` at first):
    accept child ``x`` with ``min(1, r(x) / q(x))``; after a rejection ``r = update(r, q, x)``. The law
    left after the last rejection is where the recovered token is drawn from."""
    q, r = draft.q[node], p
    for rank, child in enumerate(draft.tree.children[node]):
        x = int(draft.tokens[child])
        if accept(rng, r, q, x):
            return NodeOutcome(rank, None, rank + 1)
        r = update(r, q, x)
    return NodeOutcome(None, r, len(draft.tree.children[node]))


def _iid_rule(draft, node, p, rng):
    return sequential_tests(draft, node, p, rng, lambda r, q, x: residual(r, q))


def _swor_rule(draft, node, p, rng):
    law, r = draft.q[node], p
    for rank, child in enumerate(draft.tree.children[node]):
        x = int(draft.tokens[child])
        if accept(rng, r, law, x):
            return NodeOutcome(rank, None, rank + 1)
        r = residual(r, law)
        law = law.clone()
        law[x] = 0
        law = law / law.sum() if float(law.sum()) > 0 else law
    return NodeOutcome(None, r, len(draft.tree.children[node]))


def _topk_rule(draft, node, p, rng):
    r = p
    for rank, child in enumerate(draft.tree.children[node]):
        x = int(draft.tokens[child])
        if accept(rng, r, torch.ones_like(r), x):
            return NodeOutcome(rank, None, rank + 1)
        r = r.clone()
        r[x] = 0
        r = r / r.sum()
    return NodeOutcome(None, r, len(draft.tree.children[node]))


register_node_rule("specinfer", _iid_rule, exact=True, children="iid",
                   note="multi-step speculative sampling over i.i.d. children (SpecInfer)")
register_node_rule("swor", _swor_rule, exact=True, children="swor",
                   note="recursive rejection over children drawn without replacement (RSD/Sequoia)")
register_node_rule("topk", _topk_rule, exact=True, children="topk",
                   note="deterministic top-k children, accept with p(x) (EAGLE-2 style)")
