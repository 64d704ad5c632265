"""Traversal verification (Weng et al., NeurIPS 2025): verify a tree from its leaves towards the root, accepting
whole root-to-node sequences at once. There is no official code; this is verispec's reconstruction, and the
exhaustive audit checks that it is exact.

Each node u carries a target law ``M_b(.|u)`` (at first the target's ``p`` after u), the law ``M_s(.|u)`` of its
next untested child (``q`` for i.i.d. children; ``q`` without the already-tested tokens, renormalised, for children
drawn without replacement; a point mass on that child for top-k children; for SpecHub's hub pairs the hub after
any other first token, ``q`` without the hub after the hub), and a *sequence acceptance*
``alpha(u)``: ``alpha(root) = 1`` and, for a child c of u, ``alpha(c) = min(1, alpha(u) M_b(x_c|u) / M_s(x_c|u))`` --
the probability of keeping the whole sequence from the root to c, as block verification computes it for a chain.
It is computed when the walk first reaches c (with u's values at that moment) and afterwards changed only by
rejections below c.

The walk: go down from the root through the first untested child at every level to a node with none left (a
leaf, or a node whose children were all rejected), and flip a coin with probability ``alpha`` of that node.

* heads: keep the sequence from the root to that node, and emit one token from its current ``M_b``;
* tails (a drafted node u with parent v): remove u, and update v as block verification updates a prefix whose next
  token was rejected -- with ``S = sum_x (alpha(v) M_b(x|v) - M_s(x|v))_+``, set
  ``M_b(.|v) = norm((alpha(v) M_b(.|v) - M_s(.|v))_+)``, ``alpha(v) = S / (S + 1 - alpha(v))`` (so the root stays
  at 1), and move ``M_s(.|v)`` on to the law of v's next child. Then walk again.

If every child of the root is removed, the root is kept and the token comes from its residual ``M_b``. On a chain
this is block verification exactly (the ``block`` verifier); on a tree it also keeps good sequences below a
rejected-looking first token, which token-by-token rules throw away with their parent.
"""

from __future__ import annotations

import torch

from ..probs import argmax, point_mass
from .base import Verdict, register


def _next_law(draft, node: int, tested: list[int]) -> torch.Tensor:
    """``M_s``: the law of ``node``'s next untested child given the tokens of the ones already tested."""
    kids = draft.tree.children[node]
    q = draft.q[node]
    if draft.children == "topk":
        return torch.nn.functional.one_hot(draft.tokens[kids[len(tested)]], q.shape[-1]).to(q.dtype)
    if draft.children == "hub" and tested:  # SpecHub's pair: the hub after any other token, else q without the hub
        a = int(argmax(q))
        if tested[0] != a:
            return point_mass(torch.tensor(a), q.shape[-1], q.dtype)
    if draft.children in ("swor", "hub") and tested:
        left = q.clone()
        left[torch.tensor(tested)] = 0
        total = left.sum()
        return left / total if float(total) > 0 else left
    return q


def traverse(draft, p: torch.Tensor, rng, residual_update: bool = True) -> Verdict:
    """``residual_update=False`` skips the update of ``M_b`` after a rejection: the negative control."""
    tree = draft.tree
    p = p.double()
    Mb: dict[int, torch.Tensor] = {}  # nodes whose target law has been updated
    Ms: dict[int, torch.Tensor] = {}
    alpha: list[float | None] = [None] * tree.size  # set when a node is first reached, then only by updates
    alpha[0] = 1.0
    removed: list[list[int]] = [[] for _ in range(tree.size)]  # tokens of each node's rejected children, in order
    while True:
        node, path = 0, []
        while len(removed[node]) < len(tree.children[node]):  # descend through the first untested child
            child = tree.children[node][len(removed[node])]
            law = Ms.setdefault(node, _next_law(draft, node, removed[node]).double())
            if alpha[child] is None:  # first visit; later visits keep what rejections below it made of it
                x = int(draft.tokens[child])
                target = Mb.get(node, p[node])
                alpha[child] = min(1.0, alpha[node] * float(target[x]) / float(law[x])) if float(law[x]) > 0 else 0.0
            node = child
            path.append(child)
        target = Mb.get(node, p[node])
        if node == 0 or bool(rng.bernoulli(torch.tensor(alpha[node], dtype=torch.float64))):
            tested = [len(removed[n]) + 1 for n in [0, *path[:-1]]] if path else []  # rejected siblings + the kept
            if removed[node]:  # below the kept node, every child was tested and rejected
                tested.append(len(removed[node]))
            return Verdict(tuple(path), int(rng.categorical(target)), tuple(tested))
        parent = tree.parents[node]
        law, a = Ms.pop(parent), alpha[parent]
        if residual_update:
            left = (a * Mb.get(parent, p[parent]) - law).clamp_min(0)
            s = float(left.sum())
            if s > 0:
                Mb[parent] = left / s
            alpha[parent] = 1.0 if parent == 0 else s / (s + 1 - a) if s + 1 - a > 0 else 0.0
        removed[parent].append(int(draft.tokens[node]))


@register("traversal", exact=True, note="traversal verification (Weng et al. 2025): leaf to root, whole sequences")
def traversal(draft, p, rng) -> Verdict:
    return traverse(draft, p, rng)
