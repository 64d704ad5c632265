"""Exact residual shaping by reservation (docs/algorithms.md, "Accepting less now to accept more later").

Setting: a node with k i.i.d. children from ``q``, tested one at a time. At stage j the rule holds the current
target ``P`` and keeps a *reservation* ``r <= P`` for the later candidates: it accepts the candidate ``x`` with
``a(x) = min(1, (P(x) - r(x))_+ / q(x))`` and, on rejection, moves to ``norm(P - q a)``. **Exact for any
reservation** ``0 <= r <= P``: ``a <= min(1, P/q)`` and the next target is the one the lemma demands for that ``a``,
whichever candidate was rejected. The reservation decides how much is accepted, never what law comes out.

Because the next target never depends on the rejected candidate, the whole sequence of targets and acceptance
functions of a node is fixed by ``(p, q, k)`` before any candidate is looked at, and so is the node's acceptance.
The rule computes it for a family of plans and runs the best (the choice depends on ``p``, ``q``, ``k`` and the
tree's shape only, so exactness is untouched):

* plan ``H`` reserves as if only the first ``H`` candidates existed -- the back-loaded plan below over ``H``
  stages -- and tests any later candidate at full acceptance. Plan 1 is ``specinfer``; plan k is the back-loaded
  plan over all candidates. The family tried is ``horizons(k)``: every H up to 4, then about 1.5 times the last
  (6, 9, 13, ...), cut at k. Taking the best of them, the rule never accepts less than ``specinfer`` and never less
  with an extra candidate than without it (the family at k + 1 holds the best plan at k, and plan H at k + 1
  candidates accepts at least what it accepted at k: the first k stages are the same).
* the back-loaded plan over m stages: in masses relative to reaching this stage, let ``rho_1 = 1, rho_2, ...,
  rho_m`` be the probabilities of reaching each stage and ``S_j = rho_j + ... + rho_m``. Token x can be accepted at
  most ``q(x) S_1`` in total and at most ``P(x)``; fill ``T(x) = min(P(x), q(x) S_1)`` from the last stage
  backwards, so stages j..m accept ``min(T(x), q(x) S_j)``. The reach probabilities solve
  ``rho_j = (1 - sum_x T(x)) + sum_x min(T(x), q(x) S_j)``, solved by ``plan_reach`` (one sort of the ratios
  ``P / q``, then bisection on a scalar; the fixed point iteration from ``rho = 1`` can stall or cycle). The stage-1
  reservation is then ``min(P, S_2 q)``; the plan is recomputed at every stage from the current target. Any error
  in the fixed point only changes acceptance, never exactness -- and the family above keeps even that from
  costing acceptance below ``specinfer``.

On a tree, candidates with deeper subtrees are worth more: the plans are compared by acceptance weighted per stage
by ``1 + sum_{d=1..h} 0.5^d`` for a child whose subtree is h levels deep (a nominal acceptance of 0.5 per level);
the weights come from the tree's shape, known before drafting. On a complete tree all weights are equal and the
choice is by acceptance alone.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import NodeOutcome, register_node_rule
from .multi import accept

NOMINAL = 0.5  # per-level acceptance the subtree weights assume


def _np(x) -> np.ndarray:
    return x.double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


SORTED = 2048  # tokens a plan sorts at most: those of the most p + q mass; the rest count as one token


def ratio_order(p, q) -> np.ndarray:
    """The tokens with ``q > 0`` by increasing ``p / q``. Every stage of every plan keeps this order: a stage maps
    the ratio ``u = P / q`` to a multiple of ``u - min(1, (u - L)_+)`` (``L`` its reservation level), which never
    decreases with ``u``; so one sort per node serves all of its plans. Over a large vocabulary only the ``SORTED``
    tokens of the most ``p + q`` mass are sorted (one partition, then a sort of those), and ``plan_reach`` counts the
    others as one token of their summed masses: the plan's reach probabilities are then approximate, which moves
    acceptance a little and exactness not at all (any reservation ``0 <= r <= P`` is exact)."""
    p, q = _np(p), _np(q)
    keep = np.flatnonzero(q > 0)
    if keep.size > SORTED:
        keep = keep[np.argpartition(-(p[keep] + q[keep]), SORTED)[:SORTED]]
    return keep[np.argsort(p[keep] / q[keep], kind="stable")]


def plan_reach(P: np.ndarray, q: np.ndarray, m: int, order: np.ndarray) -> np.ndarray:
    """Reach probabilities ``[rho_1 = 1, ..., rho_m]`` of the back-loaded plan (see the module docstring), solved
    exactly up to float rounding (over ``order``'s tokens; a partial order's other tokens count as one).

    With ``f(s) = sum_x min(P(x), s q(x))``, ``sum_x T(x) = f(S_1)`` and, as ``S_j <= S_1``,
    ``sum_x min(T(x), q(x) S_j) = f(S_j)``; so with ``c = 1 - f(S_1)`` the fixed point reads
    ``S_j - f(S_j) = c + S_(j+1)`` for j = m..2 and ``S_1 = 1 + S_2``. ``s - f(s)`` is piecewise linear and
    nondecreasing (its breakpoints are the sorted ratios ``P / q``), so each ``S_j`` follows from ``c`` by a
    binary search (where the solution is not unique, the greatest: the one iteration from ``rho = 1`` reaches), and
    ``c - 1 + f(S_1(c))`` increases with ``c``: bisection on ``c`` in [0, 1]. ``order`` is ``ratio_order``'s (no
    sort here): a few cumulative sums over the vocabulary, then work on m numbers. Exactness never depends on this
    plan, only acceptance does."""
    Ps, qs = P[order], q[order]
    pos = q > 0
    rest_p, rest_q = float(P[pos].sum()) - float(Ps.sum()), float(q[pos].sum()) - float(qs.sum())
    if rest_q > 1e-15:  # a partial order: the tokens left out, as one token of their masses, in its place
        at = int(np.searchsorted(Ps / qs, max(rest_p, 0.0) / rest_q))
        Ps, qs = np.insert(Ps, at, max(rest_p, 0.0)), np.insert(qs, at, rest_q)
    u = np.maximum.accumulate(Ps / qs)  # sorted already, up to rounding
    cp = np.concatenate([[0.0], np.cumsum(Ps)])  # cp[i]: P of the i smallest ratios
    cq = np.concatenate([[0.0], np.cumsum(qs)])
    slope = 1.0 - cq[-1] + cq  # d/ds (s - f(s)) while i ratios are below s
    slope[slope < 1e-12] = 0.0  # flat (q sums to 1 up to rounding)
    breaks = np.maximum.accumulate(u * slope[:-1] - cp[:-1])  # s - f(s) at each ratio (nondecreasing)

    def f(s: np.ndarray) -> np.ndarray:
        i = np.searchsorted(u, s, side="right")
        return cp[i] + s * (cq[-1] - cq[i])

    def tails(c: np.ndarray) -> np.ndarray:  # S_1..S_m (rows) for each c (columns); S_j solves s - f(s) = c + S_(j+1)
        S = np.zeros((m + 1, len(c)))
        for j in range(m - 1, 0, -1):
            k = c + S[j + 1]
            i = np.searchsorted(breaks, k, side="right")  # the first ratio where s - f(s) exceeds k: the greatest
            S[j] = (k + cp[i]) / np.maximum(slope[i], 1e-300)  # solution where s - f(s) is flat at k
        S[0] = 1.0 + S[1]
        return S

    lo, hi = 0.0, 1.0
    for _ in range(6):  # bisection on c, 64 points at a time: width 64^-6 ~ 1.5e-11
        c = np.linspace(lo, hi, 65)
        up = c - 1.0 + f(tails(c)[0]) >= 0
        i = int(np.argmax(up)) if up.any() else 64
        lo, hi = c[max(i - 1, 0)], c[i]
    S = tails(np.array([hi]))[:, 0]
    rho = np.clip(S[:m] - S[1:], 0.0, 1.0)
    rho[0] = 1.0
    return rho


def _stage_plan(p: np.ndarray, q: np.ndarray, k: int, horizon: int, order: np.ndarray):
    M, rho = p.copy(), 1.0  # target mass still owed, probability of reaching the stage
    masses, funcs = [], []
    pos = q > 0
    for j in range(k):
        if rho <= 1e-15:
            masses.append(0.0)
            funcs.append(np.zeros_like(p))
            continue
        P = M / rho
        if horizon - j > 1:  # keep back min(P, S_2 q) for the later stages of the horizon
            later = float(plan_reach(P, q, horizon - j, order)[1:].sum())
            free = np.maximum(P - np.minimum(P, later * q), 0.0)
        else:
            free = P
        a = np.zeros_like(q)
        a[pos] = np.minimum(free[pos] / q[pos], 1.0)
        A = rho * q * a
        M = np.maximum(M - A, 0.0)
        mass = float(A.sum())
        rho -= mass
        masses.append(mass)
        funcs.append(a)
    total = float(M.sum())
    return masses, funcs, (M / total if total > 0 else p)


def _torch_plan(plan, like: torch.Tensor):
    masses, funcs, fallback = plan
    return masses, [torch.from_numpy(a).to(like.dtype) for a in funcs], torch.from_numpy(fallback).to(like.dtype)


def plan_masses(p: torch.Tensor, q: torch.Tensor, k: int, horizon: int) -> list[float]:
    """Acceptance mass of each of the k stages of plan ``horizon`` (stage j reserves for ``horizon - j`` later
    stages, none past the horizon); plan 1 is ``specinfer``."""
    pn, qn = _np(p), _np(q)
    order = ratio_order(pn, qn) if horizon > 1 else np.zeros(0, dtype=np.int64)  # plan 1 reserves nothing
    return _stage_plan(pn, qn, k, horizon, order)[0]


def subtree_weights(tree, node: int) -> list[float]:
    """Per child of ``node``: ``1 + sum_{d=1..h} NOMINAL^d`` for a subtree h levels deep below the child."""
    def height(n: int) -> int:
        return 1 + max((height(c) for c in tree.children[n]), default=0) if tree.children[n] else 0

    return [1 + sum(NOMINAL**d for d in range(1, height(c) + 1)) for c in tree.children[node]]


def horizons(k: int) -> list[int]:
    """The plans tried at a node of k candidates: horizons 1, 2, 3, 4, then each about 1.5 times the last (6, 9,
    13, 19, 28, 42, ...), up to k. A fixed sequence cut at k, so a node with one more candidate tries every plan the
    smaller one tried (monotonicity below); with k <= 4 that is every horizon."""
    out, h = [h for h in (1, 2, 3, 4) if h <= k], 4
    while (h := h * 3 // 2) <= k:
        out.append(h)
    return out


_MEMO: dict = {}  # small vocabularies only (the audit replays a node's rule once per enumerated outcome)


def best_plan(p: torch.Tensor, q: torch.Tensor, k: int, weights: list[float] | None = None):
    """The plan of the family (``horizons(k)``) with the most (weighted) acceptance: (acceptance mass of each
    stage, acceptance function of each stage, the law to draw from after all k rejections)."""
    weights = weights or [1.0] * k
    key = None
    if p.numel() <= 64:
        key = (p.double().numpy().tobytes(), q.double().numpy().tobytes(), k, tuple(weights))
        if key in _MEMO:
            return _MEMO[key]
    pn, qn = _np(p), _np(q)
    order = ratio_order(pn, qn) if k > 1 else np.zeros(0, dtype=np.int64)  # plan 1 alone reserves nothing
    best, best_value = None, -1.0
    for horizon in horizons(k):
        plan = _stage_plan(pn, qn, k, horizon, order)
        value = sum(w * m for w, m in zip(weights, plan[0]))
        if value > best_value + 1e-15:
            best, best_value = plan, value
    best = _torch_plan(best, p.double())
    if key is not None:
        if len(_MEMO) > 4096:
            _MEMO.clear()
        _MEMO[key] = best
    return best


def _reserve_rule(draft, node, p, rng):
    kids = draft.tree.children[node]
    q = draft.q[node].to(p.dtype)
    _, funcs, fallback = best_plan(p, q, len(kids), subtree_weights(draft.tree, node))
    ones = torch.ones_like(q)
    for rank, (child, a) in enumerate(zip(kids, funcs)):
        x = int(draft.tokens[child])
        if accept(rng, a, ones, x):  # a coin with probability a(x)
            return NodeOutcome(rank, None, rank + 1)
    return NodeOutcome(None, fallback.to(p.dtype), len(kids))


register_node_rule("reserve", _reserve_rule, exact=True, children="iid",
                   note="exact residual shaping by reservation, best of a family of plans (this project's rule)")
