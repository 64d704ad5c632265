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

* plan ``H`` (``H = 1..k``) reserves as if only the first ``H`` candidates existed -- the back-loaded plan below over
  ``H`` stages -- and tests any later candidate at full acceptance. Plan 1 is ``specinfer``; plan k is the
  back-loaded plan over all candidates. Taking the best of them, the rule never accepts less than ``specinfer``
  and never less with an extra candidate than without it (plan H at k candidates accepts at least what the best
  plan accepted at H).
* the back-loaded plan over m stages: in masses relative to reaching this stage, let ``rho_1 = 1, rho_2, ...,
  rho_m`` be the probabilities of reaching each stage and ``S_j = rho_j + ... + rho_m``. Token x can be accepted at
  most ``q(x) S_1`` in total and at most ``P(x)``; fill ``T(x) = min(P(x), q(x) S_1)`` from the last stage
  backwards, so stages j..m accept ``min(T(x), q(x) S_j)``. The reach probabilities solve
  ``rho_j = (1 - sum_x T(x)) + sum_x min(T(x), q(x) S_j)``, found by iteration from ``rho = 1``. The stage-1
  reservation is then ``min(P, S_2 q)``; the plan is recomputed at every stage from the current target. Any error
  in the fixed point only changes acceptance, never exactness -- and the family above keeps even that from
  costing acceptance below ``specinfer``.

On a tree, candidates with deeper subtrees are worth more: the plans are compared by acceptance weighted per stage
by ``1 + sum_{d=1..h} 0.5^d`` for a child whose subtree is h levels deep (a nominal acceptance of 0.5 per level);
the weights come from the tree's shape, known before drafting. On a complete tree all weights are equal and the
choice is by acceptance alone.
"""

from __future__ import annotations

import torch

from .base import NodeOutcome, register_node_rule
from .multi import accept

NOMINAL = 0.5  # per-level acceptance the subtree weights assume


def plan_reach(P: torch.Tensor, q: torch.Tensor, m: int, iters: int = 60, tol: float = 1e-10) -> torch.Tensor:
    """Reach probabilities ``[rho_1 = 1, ..., rho_m]`` of the back-loaded plan (see the module docstring)."""
    rho = torch.ones(m, dtype=torch.float64)
    P, q = P.double(), q.double()
    for _ in range(iters):
        S = torch.flip(torch.cumsum(torch.flip(rho, [0]), 0), [0])  # S[j] = rho_j + ... + rho_m
        T = torch.minimum(P, q * S[0])
        end = 1.0 - float(T.sum())
        filled = torch.minimum(T[None, :], q[None, :] * S[1:, None]).sum(1)  # [m - 1]
        new = torch.cat([torch.ones(1, dtype=torch.float64), end + filled]).clamp(0.0, 1.0)
        if float((new - rho).abs().max()) < tol:
            return new
        rho = new
    return rho


def reservation(P: torch.Tensor, q: torch.Tensor, remaining: int) -> torch.Tensor:
    """The mass to keep back for the ``remaining - 1`` later candidates: ``min(P, S_2 q)``."""
    if remaining <= 1:
        return torch.zeros_like(P)
    later = float(plan_reach(P, q, remaining)[1:].sum())
    return torch.minimum(P, later * q.to(P.dtype))


def stage_plan(p: torch.Tensor, q: torch.Tensor, k: int, horizon: int):
    """Plan ``horizon`` over k stages: (acceptance mass of each stage, acceptance function of each stage, the
    law to draw from after all k rejections). Stage j reserves for ``horizon - j`` later stages (none past the
    horizon)."""
    p, q = p.double(), q.double()
    M, rho = p.clone(), 1.0  # target mass still owed, probability of reaching the stage
    masses, funcs = [], []
    for j in range(k):
        if rho <= 1e-15:
            masses.append(0.0)
            funcs.append(torch.zeros_like(p))
            continue
        P = M / rho
        free = (P - reservation(P, q, horizon - j)).clamp_min(0) if horizon - j > 1 else P
        a = torch.where(q > 0, free / q.clamp_min(1e-300), torch.zeros_like(q)).clamp(max=1.0)
        A = rho * q * a
        M = (M - A).clamp_min(0)
        rho -= float(A.sum())
        masses.append(float(A.sum()))
        funcs.append(a)
    total = float(M.sum())
    return masses, funcs, (M / total if total > 0 else p)


def subtree_weights(tree, node: int) -> list[float]:
    """Per child of ``node``: ``1 + sum_{d=1..h} NOMINAL^d`` for a subtree h levels deep below the child."""
    def height(n: int) -> int:
        return 1 + max((height(c) for c in tree.children[n]), default=0) if tree.children[n] else 0

    return [1 + sum(NOMINAL**d for d in range(1, height(c) + 1)) for c in tree.children[node]]


_MEMO: dict = {}  # small vocabularies only (the audit replays a node's rule once per enumerated outcome)


def best_plan(p: torch.Tensor, q: torch.Tensor, k: int, weights: list[float] | None = None):
    """The plan of the family (horizons 1..k) with the most (weighted) acceptance; returns ``stage_plan``'s tuple."""
    weights = weights or [1.0] * k
    key = None
    if p.numel() <= 64:
        key = (p.double().numpy().tobytes(), q.double().numpy().tobytes(), k, tuple(weights))
        if key in _MEMO:
            return _MEMO[key]
    best, best_value = None, -1.0
    for horizon in range(1, k + 1):
        plan = stage_plan(p, q, k, horizon)
        value = sum(w * m for w, m in zip(weights, plan[0]))
        if value > best_value + 1e-15:
            best, best_value = plan, value
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
