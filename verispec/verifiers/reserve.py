"""Exact residual shaping by reservation (ALGORITHMS.md section 7): this project's answer to residual drift.

Setting: a node with k i.i.d. children from ``q``, tested one at a time. At stage j the rule holds the
current target ``P`` and keeps a *reservation* ``r <= P`` for the later candidates: it accepts the
candidate ``x`` with ``a(x) = min(1, (P(x) - r(x))_+ / q(x))`` and, on rejection, moves to
``norm(P - q a)``. **Exact for any reservation** ``0 <= r <= P``: ``a <= min(1, P/q)`` and the next target
is the one the exactness lemma (section 2) demands for that ``a``, whichever candidate was rejected.
So the reservation only decides *how much* is accepted, never *what* law comes out.

Why reserve at all: multi-step speculative sampling (``specinfer``) accepts greedily, so the first
candidate uses up the target mass where the draft is confident and later candidates -- drawn from
the same ``q`` -- land where nothing is left (residual drift). Accepting a token later instead of
earlier costs nothing if a later candidate will still take it, and keeps the probability of reaching
later stages higher, which lets under-drafted tokens accept more.

The rule ("back-loaded plan"). Work in masses relative to reaching this stage: let
``rho_1 = 1, rho_2, ..., rho_m`` be the probabilities of reaching each of the m remaining stages and
``S_j = rho_j + ... + rho_m``. Token x can be accepted at most ``q(x) S_1`` in total and at most ``P(x)``;
fill ``T(x) = min(P(x), q(x) S_1)`` *from the last stage backwards*, so stages j..m accept
``min(T(x), q(x) S_j)``. Consistency of the reach probabilities gives the fixed point

    rho_j = (1 - sum_x T(x)) + sum_x min(T(x), q(x) S_j),     j = 2..m,

solved by iteration from ``rho = 1`` (a few vectorised passes over the vocabulary). The stage-1
acceptance is then ``min(q, (P - q S_2)_+)``, i.e. the reservation is ``r = min(P, S_2 q)`` -- the
draft's shape, clipped by the target. The plan is recomputed at every stage from the current target.
For k = 2 this equals the best any sequential-test rule can do (checked against a linear program);
the i.i.d. optimum ``alpha*_iid`` is higher because it may look at all candidates at once (see ``ordered``).
Any approximation in the fixed point only changes acceptance, never exactness.
"""

from __future__ import annotations

import torch

from .base import NodeOutcome, register_node_rule
from .multi import accept


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


def _reserve_rule(draft, node, p, rng):
    kids = draft.tree.children[node]
    q, P = draft.q[node].to(p.dtype), p
    for rank, child in enumerate(kids):
        x = int(draft.tokens[child])
        free = (P - reservation(P, q, len(kids) - rank)).clamp_min(0)  # P - r
        if accept(rng, free, q, x):
            return NodeOutcome(rank, None, rank + 1)
        a = torch.where(q > 0, free / q.clamp_min(1e-300), torch.zeros_like(q)).clamp(max=1.0)
        left = (P - q * a).clamp_min(0)
        P = left / left.sum() if float(left.sum()) > 0 else P
    return NodeOutcome(None, P, len(draft.tree.children[node]))


register_node_rule("reserve", _reserve_rule, exact=True, children="iid",
                   note="exact residual shaping by reservation (back-loaded plan; this project's rule)")
