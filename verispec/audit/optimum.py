"""Acceptance optima and closed-form acceptance of the sequential rules at one node.

``alpha_star_iid(p, q, k) = 1 - max_T [q(T)^k - p(T)]`` (Hu et al. 2025) is the best acceptance any
exact rule can reach with k i.i.d. candidates from q. The maximising T is a prefix of the tokens
sorted by ``p/q`` ascending (tokens with q = 0 last), so it costs one sort.
"""

from __future__ import annotations

import torch

from ..verifiers.ordered import priority_order, stage_law
from ..verifiers.reserve import best_plan, plan_masses
from ..verifiers.spechub import hub_laws


def alpha_star_iid(p: torch.Tensor, q: torch.Tensor, k: int) -> float:
    p, q = p.double(), q.double()
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    order = torch.argsort(ratio)
    gap = torch.cumsum(q[order], 0) ** k - torch.cumsum(p[order], 0)
    return 1.0 - max(0.0, float(gap.max()))


def alpha_star_hub(p: torch.Tensor, q: torch.Tensor) -> float:
    """The best acceptance any exact rule has with SpecHub's pairs (``drafters.base.hub_pair``): every pair holds the
    hub ``a``, and ``{i, a}`` has mass ``m(i) = q(i) (1 + q(a) / sum_{j != a} q(j))``. A max-flow min-cut over sets H
    of tokens (cost ``p(H)`` plus the pairs not inside H) gives ``min(1, 1 + p(a) - sum_{i != a} (m(i) - p(i))_+)``:
    each ``i`` only by its own pair, the hub by what the pairs have left."""
    p, q = p.double(), q.double()
    a, q1, q2 = hub_laws(q)
    if float(q1.sum()) <= 0:  # q all on the hub: one candidate
        return min(float(p[a]), 1.0)
    spare = (q1 + q2 - p).clamp_min(0)  # m(i) = Q_1(i) + Q_2(i), zero at the hub
    spare[a] = 0
    return min(1.0, 1.0 + float(p[a]) - float(spare.sum()))


def sequential_acceptance(p: torch.Tensor, q: torch.Tensor, k: int, reserve: bool) -> float:
    """Exact acceptance of ``specinfer`` (``reserve=False``) or ``reserve`` at a node with k i.i.d. children.

    Both rules' targets after a rejection do not depend on the rejected token, so a node's whole plan, and its
    acceptance, follow from ``(p, q, k)`` in one pass over the stages (``verispec.verifiers.reserve.plan_masses``)."""
    return sum(best_plan(p, q, k)[0] if reserve else plan_masses(p, q, k, 1))


def swor_acceptance_k2(p: torch.Tensor, q: torch.Tensor) -> float:
    """Acceptance of ``swor`` at a node with 2 children drawn without replacement, in O(V log V).

    Stage 1 accepts ``sum min(p, q)``. A first token y is refused with mass ``(q - p)_+(y)``; the target is then
    ``r = norm((p - q)_+)``, positive only where ``p > q`` (never at y), and the second candidate has law
    ``q / (1 - q(y))`` off y, so stage 2 adds ``sum_y (q - p)_+(y) f(1 / (1 - q(y)))`` with
    ``f(c) = sum_z min(r(z), c q(z))``, read off the ratios ``r / q`` sorted once."""
    p, q = p.double(), q.double()
    first = float(torch.minimum(p, q).sum())
    gain = (p - q).clamp_min(0)
    refused = (q - p).clamp_min(0)
    if float(gain.sum()) <= 0 or float(refused.sum()) <= 0 or int((q > 0).sum()) < 2:  # no second stage
        return first
    r = gain / gain.sum()
    z = torch.nonzero(gain > 0).flatten()
    ratio, order = torch.sort(r[z] / q[z].clamp_min(1e-300))
    rs, qs = r[z][order], q[z][order]
    r_below = torch.cat([torch.zeros(1, dtype=p.dtype), torch.cumsum(rs, 0)])  # r of the first j ratios
    q_above = torch.flip(torch.cumsum(torch.flip(qs, [0]), 0), [0])
    q_above = torch.cat([q_above, torch.zeros(1, dtype=p.dtype)])  # q from the j-th ratio on
    y = torch.nonzero(refused > 0).flatten()
    c = 1 / (1 - q[y]).clamp_min(1e-300)
    j = torch.searchsorted(ratio, c, right=True)  # ratios <= c give r(z), the others c q(z)
    f = (r_below[j] + c * q_above[j]).clamp_max(1.0)
    return first + float((refused[y] * f).sum())


def ordered_acceptance_k2(p: torch.Tensor, q: torch.Tensor, chunk: int = 256, slack: float = 0.0) -> float:
    """Acceptance of ``ordered`` at a node with 2 i.i.d. children, in O(U V) for U rejectable tokens.

    Stage 1 accepts ``sum min(p, L_1)``. Stage 2 is reached with the first tested token y with mass
    ``(L_1 - p)_+(y)``; given y the other candidate has law ``L_2(.|y)`` and the target is
    ``P_2 = norm((p - L_1)_+)``, so stage 2 adds ``sum_y (L_1 - p)_+(y) * sum_z min(P_2(z), L_2(z|y))``.
    Exact with ``slack = 0``; with ``slack > 0`` the least likely first tokens holding at most ``slack`` of the
    stage-2 mass are skipped, which makes the result a lower bound within ``slack`` (for full vocabularies).
    """
    p, q = p.double(), q.double()
    order = priority_order(p, q)
    P, qs = p[order], q[order]
    above = torch.cumsum(qs, 0) - qs
    L1 = stage_law(qs, above, 2, [])
    first = float(torch.minimum(P, L1).sum())
    left = (P - L1).clamp_min(0)
    if float(left.sum()) <= 0:
        return first
    P2 = left / left.sum()
    reach = (L1 - P).clamp_min(0)
    ys = torch.nonzero(reach > 0).flatten()
    if slack > 0:
        by_mass = ys[torch.argsort(reach[ys], descending=True)]
        dropped = float(reach.sum()) - torch.cumsum(reach[by_mass], 0)
        ys = by_mass[: int((dropped > slack).sum()) + 1]
    # for n = 1, m = 1: L_2(z|y) = q(z) / W for z below y, (a/2) / W at y, W = b + a/2
    below_mass = (1 - above - qs).clamp_min(0)
    second = 0.0
    for start in range(0, ys.numel(), chunk):
        y = ys[start:start + chunk]
        a, b = qs[y], below_mass[y]
        W = b + a / 2
        idx = torch.arange(P.numel())[None, :]
        law = torch.where(idx > y[:, None], qs[None, :] / W[:, None], torch.zeros(1, dtype=P.dtype))
        law[torch.arange(y.numel()), y] = (a / 2) / W
        second += float((reach[y] * torch.minimum(P2[None, :], law).sum(1)).sum())
    return first + second
