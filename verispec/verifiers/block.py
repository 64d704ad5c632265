"""Block verification for chains (Sun et al. 2024; docs/algorithms.md, "Chain rules"; a reconstruction) -- exact.

Instead of stopping at the first rejected draft token, block verification decides how many tokens of
the chain to keep jointly, which accepts at least as much as token-by-token speculative sampling.
With weights ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i))``,
``S_i = sum_x (w_i p_{i+1}(x) - q_{i+1}(x))_+`` and ``h_i = S_i / (S_i + 1 - w_i)`` for i < g, ``h_g = w_g``:
draw ``u_i ~ U(0, 1)``, keep ``x_1..x_tau`` where tau is the last i with ``u_i <= h_i`` (0 if none),
then emit ``y ~ norm((w_tau p_{tau+1} - q_{tau+1})_+)`` (or ``p_{g+1}`` when tau = g).
"""

from __future__ import annotations

import torch

from .base import Verdict, first_child_law, register


@register("block", exact=True, chain_only=True, note="block verification of a chain (Sun et al. 2024)")
def block(draft, p, rng) -> Verdict:
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x = draft.tokens[1:]
    laws = torch.stack([first_child_law(draft, i) for i in range(g)]).to(p.dtype)  # [g, V]; row i: law of x_{i+1}
    P = p.to(laws.dtype)
    px = P[:g].gather(1, x[:, None]).squeeze(1)
    qx = laws.gather(1, x[:, None]).squeeze(1)
    w = [1.0]
    for i in range(g):
        ratio = float(px[i]) / float(qx[i]) if float(qx[i]) > 0 else 0.0
        w.append(min(1.0, w[-1] * ratio))
    h = []
    for i in range(1, g + 1):
        if i == g:
            h.append(w[g])
            continue
        S = float((w[i] * P[i] - laws[i]).clamp_min(0).sum())
        denom = S + 1 - w[i]
        h.append(S / denom if denom > 0 else 1.0)
    return kept_prefix_verdict(h, w, P, laws, rng)


def kept_prefix_verdict(h, w, P: torch.Tensor, laws: torch.Tensor, rng) -> Verdict:
    """A chain's verdict from its stopping coins: draw ``u_i <= h[i - 1]`` for i = 1..g, keep ``x_1..x_tau`` for the
    last i that holds (0 if none), then emit from ``norm((w_tau p_{tau+1} - q_{tau+1})_+)`` (``p_{tau+1}`` where that
    is empty), or the bonus token from ``p_{g+1}`` when the whole chain is kept. Block verification's, and HSD's
    with its own last coin."""
    g = len(h)
    keep = rng.bernoulli(torch.tensor(h, dtype=torch.float64))
    tau = max((i + 1 for i in range(g) if bool(keep[i])), default=0)
    path = tuple(range(1, tau + 1))
    tested = (1,) * min(tau + 1, g)
    if tau == g:
        return Verdict(path, int(rng.categorical(P[g])), tested)
    res = (w[tau] * P[tau] - laws[tau]).clamp_min(0)
    total = float(res.sum())
    y = int(rng.categorical(res / total)) if total > 0 else int(rng.categorical(P[tau]))
    return Verdict(path, y, tested)
