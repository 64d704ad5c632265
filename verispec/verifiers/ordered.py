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

Why it is exact: the lemma (docs/algorithms.md) needs, at each stage, the true law of the tested candidate
given everything the rule has used so far (``y_1..y_{j-1}``), and a next target that does not depend on the
rejected candidate; ``L_j`` is that law and ``norm((P_j - L_j)_+)`` that target (it may depend on the earlier
history, which the later laws condition on). The accept coins are fresh. The audit checks the claim by enumeration.

Never below ``specinfer``: when ``p`` is close to ``q`` the top order statistic's law is far from ``p`` and priority
testing accepts less than testing in draw order. So each node chooses, from ``(p, q, k)`` alone (which keeps it
exact), between plans "priority-test the first m drawn candidates, then test the rest in draw order" for
m in ``verispec.verifiers.reserve.horizons(k)`` (every m up to 4, then about 1.5 times the last; m = 1 is
``specinfer``), by a guaranteed acceptance: ``specinfer``'s in closed form, and for m >= 2 the
priority stages' exact acceptance when their histories are few (``exact_acceptance``), else a lower bound that
costs one pass over the vocabulary (``lower_bound``). The chosen plan therefore never accepts less than
``specinfer``; with exact acceptances (small supports) it also never accepts less with an extra candidate. On a tree
whose later children have shallower subtrees, priority testing (which may keep any of the candidates it covers)
covers only the leading children whose subtrees are as deep as the first's.
"""

from __future__ import annotations

import math

import torch

from .base import NodeOutcome, register_node_rule
from .multi import accept
from .reserve import horizons, plan_masses, subtree_weights


SORTED = 2048  # tokens sorted by priority at most: those of the most p + q mass; the others follow by id


def priority_order(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Token ids, highest priority first: ``p/q`` descending (tokens with q = 0 last), ties by id. Over a large
    vocabulary only the ``SORTED`` tokens of the most ``p + q`` mass are sorted so, and the others follow them by id:
    any order fixed by ``(p, q)`` keeps the rule exact (its stage laws are computed for the order it uses); this one
    moves acceptance by the little mass those tokens carry, and saves a sort of the whole vocabulary."""
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, -1.0))
    if ratio.numel() <= SORTED:
        return torch.sort(ratio, descending=True, stable=True).indices
    top = torch.topk(p + q, SORTED).indices.sort().values  # by id, then stably by priority
    first = top[torch.sort(ratio[top], descending=True, stable=True).indices]
    rest = torch.ones_like(ratio, dtype=torch.bool)
    rest[top] = False
    return torch.cat([first, torch.nonzero(rest).flatten()])


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


class _Sorted:
    """A node's laws in priority order (``order[i]`` is the token at position i)."""

    def __init__(self, p: torch.Tensor, q: torch.Tensor):
        self.order = priority_order(p, q)
        self.pos_of = torch.empty_like(self.order)
        self.pos_of[self.order] = torch.arange(self.order.numel())
        self.q = q[self.order]
        self.above = torch.cumsum(self.q, 0) - self.q
        self.p = p[self.order]


def exact_acceptance(s: _Sorted, m: int, work: int = 2_000_000) -> float | None:
    """Acceptance of priority-testing m i.i.d. candidates, summed over every history of rejected candidates (None
    when that would take more than about ``work`` operations: one pass over the vocabulary per history)."""
    max_histories = max(1, work // s.p.numel())
    total, frontier = 0.0, [((), 1.0, s.p)]
    for j in range(m):
        new = []
        for hist, reach, P in frontier:
            law = stage_law(s.q, s.above, m, list(hist))
            total += reach * float(torch.minimum(P, law).sum())
            if j + 1 == m:
                continue
            rejected = (law - P).clamp_min(0)
            left = (P - law).clamp_min(0)
            if float(left.sum()) <= 0:
                continue
            ys = torch.nonzero(rejected > 0).flatten()
            if len(new) + ys.numel() > max_histories:  # checked before the Python loop over the rejected tokens
                return None
            nxt = left / left.sum()
            new += [((*hist, y), reach * w, nxt) for y, w in zip(ys.tolist(), rejected[ys].tolist())]
        frontier = new
    return total


def lower_bound(s: _Sorted, m: int) -> float:
    """A lower bound on ``exact_acceptance`` in one pass over the vocabulary: stage 1 exactly, stage 2 with its
    normaliser bounded by 1 (``W <= 1``: the conditional laws are at least their unnormalised weights), later
    stages as 0."""
    L1 = _top_law(s.q, s.above, m)
    first = float(torch.minimum(s.p, L1).sum())
    left = (s.p - L1).clamp_min(0)
    if m < 2 or float(left.sum()) <= 0:
        return first
    P2 = left / left.sum()
    reach = (L1 - s.p).clamp_min(0)
    n = m - 1
    a, b = s.q, (1 - s.above - s.q).clamp_min(0)
    w_y = sum(math.comb(n, c) * a**c * b ** (n - c) / math.comb(1 + c, c) for c in range(1, n + 1))
    below = torch.minimum(P2, _top_law(s.q, s.above, n))
    suffix = torch.flip(torch.cumsum(torch.flip(below, [0]), 0), [0]) - below  # sum over positions after y
    return first + float((reach * (torch.minimum(P2, w_y) + suffix)).sum())


def guaranteed(s: _Sorted, m: int) -> float:
    exact = exact_acceptance(s, m)
    return exact if exact is not None else lower_bound(s, m)


def best_prefix(p: torch.Tensor, q: torch.Tensor, k: int, limit: int | None = None) -> tuple[int, _Sorted]:
    """How many of the first drawn candidates to priority-test (1 = none: ``specinfer``; at most ``limit``), and the
    sorted laws."""
    s = _Sorted(p, q)
    key = (p.double().numpy().tobytes(), q.double().numpy().tobytes(), k, limit) if p.numel() <= 64 else None
    if key is not None and key in _MEMO:  # the audit replays a node's rule once per enumerated outcome
        return _MEMO[key], s
    best, best_value = 1, sum(plan_masses(p, q, k, 1))
    for m in horizons(min(k, limit or k))[1:]:
        value = guaranteed(s, m)
        if value > best_value + 1e-12:
            best, best_value = m, value
    if key is not None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        _MEMO[key] = best
    return best, s


_MEMO: dict = {}


def _ordered_rule(draft, node, p, rng):
    kids = draft.tree.children[node]
    q = draft.q[node].to(p.dtype)
    weights = subtree_weights(draft.tree, node)
    equal = next((i for i, w in enumerate(weights) if w != weights[0]), len(weights))  # leading equal subtrees
    m, s = best_prefix(p, q, len(kids), equal)
    P = s.p  # the current target, in priority positions
    tested = 0
    if m > 1:
        first = kids[:m]
        cand = sorted(int(s.pos_of[draft.tokens[c]]) for c in first)  # the first m candidates by priority
        for j, y in enumerate(cand):
            law = stage_law(s.q, s.above, m, cand[:j])
            tested += 1
            if accept(rng, P, law, y):
                token = int(s.order[y])
                return NodeOutcome(next(r for r, c in enumerate(first) if int(draft.tokens[c]) == token), None, tested)
            left = (P - law).clamp_min(0)
            P = left / left.sum() if float(left.sum()) > 0 else P
    qs = s.q
    for rank in range(m if m > 1 else 0, len(kids)):  # the rest in draw order, each with law q
        y = int(s.pos_of[draft.tokens[kids[rank]]])
        tested += 1
        if accept(rng, P, qs, y):
            return NodeOutcome(rank, None, tested)
        left = (P - qs).clamp_min(0)
        P = left / left.sum() if float(left.sum()) > 0 else P
    out = torch.zeros_like(P)
    out[s.order] = P
    return NodeOutcome(None, out, len(kids))


register_node_rule("ordered", _ordered_rule, exact=True, children="iid",
                   note="i.i.d. children tested in p/q priority order as order statistics, never below specinfer "
                        "(this project's rule)")
