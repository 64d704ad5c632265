"""Order-statistic testing of i.i.d. children -- exact, and close to the i.i.d. optimum ``alpha*_iid``.

Sequential rules that test i.i.d. candidates in the order they were drawn cannot reach the i.i.d.
optimum ``alpha*_iid = 1 - max_T [q(T)^k - p(T)]``: the best of them (``reserve``) closes most but
not all of the gap. This rule looks at all k candidates first and tests them in a fixed *priority*
order over the vocabulary -- tokens the draft under-proposes first (``p/q`` descending, ties by
token id) -- each against its exact conditional law as an order statistic:

* stage 1 tests ``y_1``, the highest-priority candidate. With ``A(z)`` the draft mass of tokens of
  higher priority than z, its law is ``L_1(z) = (1 - A(z))^k - (1 - A(z) - q(z))^k``;
* stage j >= 2 tests ``y_j``, the next one. Given the tested ``y_1..y_{j-1}`` (the last one ``y`` seen
  ``m`` times among them), the ``n = k - j + 1`` untested candidates all have priority <= y, and
  their multiset has weight ``prod q / C(m + c, c)`` relative to i.i.d. draws, where c counts their
  copies of y (the multinomial factor of the sorted sample). So with ``a = q(y)`` and ``b`` the draft
  mass strictly below y:
      ``L_j(z) = [(1 - A(z))^n - (1 - A(z) - q(z))^n] / W``   for z strictly below y,
      ``L_j(y) = [sum_{c=1..n} C(n,c) a^c b^(n-c) / C(m+c, c)] / W``, ``W = b^n + W_y``, 0 above y.
Each stage accepts with ``min(1, P_j(y_j) / L_j(y_j))`` and otherwise moves to ``norm((P_j - L_j)_+)``.

Why it is exact: the exactness lemma (ALGORITHMS.md section 2) needs, at each stage, the true law of
the tested candidate given everything the rule has used so far (``y_1..y_{j-1}``), and a next target
that does not depend on the rejected candidate; ``L_j`` is that law and ``norm((P_j - L_j)_+)`` that
target (it may depend on the earlier history, which the later laws condition on). The accept coins
are fresh. The audit checks the claim by enumeration.
"""

from __future__ import annotations

import math

import torch

from .base import NodeOutcome, register_node_rule
from .multi import accept


def priority_order(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Token ids, highest priority first: ``p/q`` descending (tokens with q = 0 last), ties by id."""
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, -1.0))
    return torch.sort(ratio, descending=True, stable=True).indices


def _top_law(q_sorted: torch.Tensor, above: torch.Tensor, n: int) -> torch.Tensor:
    """Law (in sorted positions) of the highest-priority of n i.i.d. draws: (1-A)^n - (1-A-q)^n."""
    hi = (1 - above).clamp_min(0)
    lo = (1 - above - q_sorted).clamp_min(0)
    return hi**n - lo**n


def stage_law(q_sorted, above, k: int, tested_pos: list[int]) -> torch.Tensor:
    """Law (over sorted positions) of the next tested candidate given the positions tested so far."""
    if not tested_pos:
        return _top_law(q_sorted, above, k)
    y = tested_pos[-1]
    m = sum(1 for t in tested_pos if t == y)
    n = k - len(tested_pos)
    a = float(q_sorted[y])
    b = max(float(1 - above[y] - q_sorted[y]), 0.0)
    w_y = sum(math.comb(n, c) * a**c * b ** (n - c) / math.comb(m + c, c) for c in range(1, n + 1))
    law = _top_law(q_sorted, above, n)
    law[: y + 1] = 0
    law[y] = w_y
    total = b**n + w_y
    return law / total if total > 0 else law


def _ordered_rule(draft, node, p, rng):
    kids = draft.tree.children[node]
    q = draft.q[node].to(p.dtype)
    order = priority_order(p, q)
    pos_of = torch.empty_like(order)
    pos_of[order] = torch.arange(order.numel())
    q_sorted = q[order]
    above = torch.cumsum(q_sorted, 0) - q_sorted
    P = p[order]  # the current target, in sorted positions
    cand = sorted(int(pos_of[draft.tokens[c]]) for c in kids)  # candidates by priority
    for j, y in enumerate(cand):
        law = stage_law(q_sorted, above, len(kids), cand[:j])
        if accept(rng, P, law, y):
            token = int(order[y])
            return NodeOutcome(next(r for r, c in enumerate(kids) if int(draft.tokens[c]) == token), None, j + 1)
        left = (P - law).clamp_min(0)
        P = left / left.sum() if float(left.sum()) > 0 else P
    out = torch.zeros_like(P)
    out[order] = P
    return NodeOutcome(None, out, len(kids))


register_node_rule("ordered", _ordered_rule, exact=True, children="iid",
                   note="i.i.d. children tested in p/q priority order against their order-statistic laws (this project's rule)")
