"""ResiSpec exactly as published (docs/algorithms.md, "ResiSpec as published, and why it is not exact") -- NOT exact; kept to measure its bias.

Children are i.i.d. from ``q``. A candidate ``x0`` is tested with ``min(1, R(x0) / q(x0))`` against the
current target ``R`` (``R = p`` at the first candidate). After a rejection, GetProxy builds a proxy ``k``
and the next target is ``norm((R - k)_+)``:

1. budgeting: ``Z = |q(x0) - R(x0)|``; initial projection ``r = min(Z q, R)`` (clipping);
2. capacity-aware redistribution: the deficit ``Z - sum r`` is water-filled onto tokens with
   ``R > r`` without exceeding ``R``, so that ``sum r = Z``. The paper leaves the filling rule open;
   here the water level rises along the draft's shape, ``r = min(t q, R)`` with the smallest ``t >= Z``
   that reaches ``Z``; if tokens with ``q > 0`` cannot hold ``Z``, the rest is spread over the
   remaining capacity ``R - r`` in proportion to it;
3. proxy: ``k = R - r`` then ``k(x0) = q(x0)`` ("local alignment"), so ``(R - k)_+ = r`` off ``x0`` and 0 at ``x0``.

Why it is not exact: the shaped residual depends on which candidate was rejected, and its mixture over
rejected candidates is not ``R - q a``; the lemma (docs/algorithms.md) fails. The audit flags it.
"""

from __future__ import annotations

import torch

from .base import register_node_rule
from .multi import sequential_tests


def water_fill(R: torch.Tensor, q: torch.Tensor, Z: float) -> torch.Tensor:
    """``r <= R`` with ``sum r = Z``: ``r = min(t q, R)`` for the smallest level ``t >= Z`` reaching ``Z``
    (vectorised: sort the breakpoints ``R/q`` and solve the piecewise-linear equation), then any
    remaining deficit spread over ``R - r`` in proportion to it."""
    Z = min(float(Z), float(R.sum()))
    pos = q > 0
    ratio = torch.where(pos, R / q.clamp_min(1e-300), torch.full_like(R, float("inf")))
    order = torch.argsort(ratio)
    b, qs, Rs = ratio[order], q[order], R[order]
    # f(t) = sum_{b_i <= t} R_i + t * sum_{b_i > t} q_i, evaluated at each finite breakpoint
    capped = torch.cumsum(Rs, 0)
    q_above = q.sum() - torch.cumsum(qs, 0)
    finite = torch.isfinite(b)
    f_at = torch.where(finite, capped + torch.where(finite, b, torch.zeros_like(b)) * q_above, torch.full_like(b, float("inf")))
    hit = torch.nonzero(f_at >= Z).flatten()
    if hit.numel():
        j = int(hit[0])
        below_R = float(capped[j - 1]) if j > 0 else 0.0
        rest_q = float(q_above[j - 1]) if j > 0 else float(q.sum())
        t = max((Z - below_R) / rest_q, Z) if rest_q > 0 else Z
        r = torch.minimum(t * q, R)
    else:  # even t = inf on q's support falls short: fill the rest by remaining capacity
        r = torch.where(pos, R, torch.zeros_like(R))
    deficit = Z - float(r.sum())
    if deficit > 1e-15:
        room = R - r
        r = r + room * (deficit / float(room.sum()))
    return r


def resispec_residual(R: torch.Tensor, q: torch.Tensor, x0: int) -> torch.Tensor:
    """The published next target after rejecting ``x0``: ``norm((R - k)_+)`` with GetProxy's ``k``."""
    Z = abs(float(q[x0]) - float(R[x0]))
    r = water_fill(R, q, Z)
    k = R - r
    k[x0] = q[x0]
    res = (R - k).clamp_min(0)
    total = float(res.sum())
    return res / total if total > 0 else R


def _resispec_rule(draft, node, p, rng):
    return sequential_tests(draft, node, p, rng, resispec_residual)


register_node_rule("resispec", _resispec_rule, exact=False, children="iid",
                   note="ResiSpec as published; NOT exact: its shaped residual depends on the rejected candidate")
