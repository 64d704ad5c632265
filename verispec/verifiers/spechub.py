"""SpecHub (Sun et al. 2024, "Provable Acceleration to Multi-Draft Speculative Decoding"; docs/algorithms.md,
"SpecHub: two candidates through a hub"): a node rule for the ``hub`` child mode's pairs.

The draft draws pairs that always hold the hub ``a`` (``q``'s first maximum, ``drafters.base.hub_pair``): ``(i, a)``
with law ``Q_1(i) = q(i)`` and ``(a, i)`` with law ``Q_2(i) = q(a) q(i) / sum_{j != a} q(j)``, ``i != a``. The rule
is a transport plan in four stages, each handing out target mass ``r`` that the stages before left:

1. a pair ``(i, a)`` offers ``i``: accept with ``min(1, r(i) / Q_1(i))``, i.e. ``min(r, Q_1)`` of mass;
2. a pair ``(a, i)`` offers ``i``: accept with ``min(1, r(i) / Q_2(i))``;
3. a pair ``(a, i)`` whose ``i`` was refused offers the hub: accept with ``min(1, r(a) / R_2)``, ``R_2`` the
   refused mass of all such pairs (one coin for all of them);
4. a pair ``(i, a)`` whose ``i`` was refused offers the hub: likewise against ``R_1``.

Each stage takes ``min(mass offered, mass left)`` of every token, so a token is emitted by acceptance with
probability ``p(x) - r_end(x)``, and a rejection (probability ``sum r_end``) draws ``norm(r_end)``: the emitted law
is ``p``. Tokens ``i != a`` are served only by their pair (mass ``Q_1(i) + Q_2(i)``), and the hub by what every pair
has left, so the rule attains the best acceptance any exact rule has for this pair law
(``audit.optimum.alpha_star_hub``). The authors' code (github.com/MasterGodzilla/Speculative_decoding_OT) also
accepts the hub outright where ``p(a) > 0.999``, which is not exact; verispec leaves that out. With one child (a
tree slot of one, or ``q`` all on the hub) it is single-draft speculative sampling.
"""

from __future__ import annotations

import torch

from ..probs import argmax, residual
from .base import NodeOutcome, register_node_rule
from .multi import accept


def hub_laws(q: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The hub ``a`` and the pair laws ``Q_1(i)`` of ``(i, a)`` and ``Q_2(i)`` of ``(a, i)`` (zero at ``a``)."""
    a = int(argmax(q))
    first = q.clone()
    first[a] = 0
    off = first.sum()
    second = first * (q[a] / off) if float(off) > 0 else first
    return a, first, second


def hub_stages(p: torch.Tensor, q: torch.Tensor):
    """The plan's masses: ``(a, Q_1, Q_2, r_1, r_2, R_1, R_2)``, ``r_j`` the target left after stage j's tokens
    ``i != a`` (``r_j(a) = p(a)``) and ``R_j`` the mass of pairs ``j`` whose ``i`` was refused."""
    a, q1, q2 = hub_laws(q)
    r1 = p - torch.minimum(p, q1)
    r2 = r1 - torch.minimum(r1, q2)
    return a, q1, q2, r1, r2, float((q1 - p).clamp_min(0).sum()), float((q2 - r1).clamp_min(0).sum())


def hub_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """The probability that a node with a hub pair accepts one of them (exact, O(V))."""
    p, q = p.double(), q.double()
    a, q1, q2, _, r2, refused1, refused2 = hub_stages(p, q)
    hub3 = min(float(p[a]), refused2)
    hub4 = min(float(p[a]) - hub3, refused1)
    return float((p - r2).sum()) + hub3 + hub4


def _coin(rng, mass: float, offered: float) -> bool:
    ratio = mass / offered if offered > 0 else 0.0
    return bool(rng.bernoulli(torch.tensor(min(1.0, ratio), dtype=torch.float64)))


def _spechub_rule(draft, node, p, rng) -> NodeOutcome:
    kids = draft.tree.children[node]
    q = draft.q[node]
    if len(kids) == 1:
        x = int(draft.tokens[kids[0]])
        return NodeOutcome(0, None, 1) if accept(rng, p, q, x) else NodeOutcome(None, residual(p, q), 1)
    x1, x2 = (int(draft.tokens[c]) for c in kids)
    a, q1, q2, r1, r2, refused1, refused2 = hub_stages(p, q)
    hub_first = x1 == a  # the pair (a, i), i = x2; else (i, a), i = x1
    if not hub_first and accept(rng, p, q1, x1):  # stage 1
        return NodeOutcome(0, None, 1)
    if hub_first and accept(rng, r1, q2, x2):  # stage 2
        return NodeOutcome(1, None, 1)
    hub = float(p[a])
    if hub_first and _coin(rng, hub, refused2):  # stage 3
        return NodeOutcome(0, None, 2)
    hub -= min(hub, refused2)
    if not hub_first and _coin(rng, hub, refused1):  # stage 4
        return NodeOutcome(1, None, 2)
    hub -= min(hub, refused1)
    left = r2.clone()
    left[a] = hub
    total = float(left.sum())
    return NodeOutcome(None, left / total if total > 0 else p, 2)


register_node_rule("spechub", _spechub_rule, exact=True, children="hub",
                   note="SpecHub (Sun et al. 2024): two candidates that always hold q's top token, a transport "
                        "plan through that hub (--children hub)")
