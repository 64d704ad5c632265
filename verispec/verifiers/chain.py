"""Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023) -- exact.

Drafts ``x_1..x_g`` with ``x_i ~ q_i``. Accept ``x_i`` with probability ``min(1, p_i(x_i) / q_i(x_i))``;
at the first rejection emit ``y ~ norm((p_i - q_i)_+)``; if all are accepted emit the bonus ``y ~ p_{g+1}``.
Why it is exact: at one position the accepted mass is ``min(p, q)`` and the rejected mass
``1 - sum min(p, q) = sum (p - q)_+`` is refilled by the residual, so the emitted token has law ``p``;
accepting ``x_i`` is conditioned on the same prefix the target conditions on, so by induction the
whole chain has the target's law. All coins are drawn at once (vectorised); those past the first
rejection are unused.
"""

from __future__ import annotations

import torch

from ..probs import residual
from .base import Verdict, first_child_law, register


@register("chain", exact=True, note="chain speculative sampling (Leviathan/Chen 2023)", chain_only=True)
def chain(draft, p, rng) -> Verdict:
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x = draft.tokens[1:]  # [g] drafted tokens; x[i] is the child of node i
    laws = torch.stack([first_child_law(draft, i) for i in range(g)])  # [g, V]
    px = p[:g].gather(1, x[:, None]).squeeze(1).double()
    qx = laws.gather(1, x[:, None]).squeeze(1).double()
    ratio = torch.where(qx > 0, px / qx.clamp_min(1e-300), torch.zeros_like(px)).clamp(max=1.0)
    accepted = rng.bernoulli(ratio)  # [g]
    n = int(accepted.long().cumprod(0).sum())  # number accepted before the first rejection
    path = tuple(range(1, n + 1))
    tested = (1,) * min(n + 1, g)
    if n == g:
        return Verdict(path, int(rng.categorical(p[g])), tested)
    return Verdict(path, int(rng.categorical(residual(p[n], laws[n]))), tested)
