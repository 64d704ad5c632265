"""Chain speculative sampling (Leviathan et al. 2023; Chen et al. 2023) -- exact -- and the walk every
per-position chain rule shares.

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
from .base import PositionRule, Verdict, first_child_law, register


def accept_ratio(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``min(1, p / q)`` elementwise, 0 where ``q = 0`` (a token the draft cannot propose), in float64."""
    p, q = p.double(), q.double()
    return torch.where(q > 0, p / q.clamp_min(1e-300), torch.zeros_like(p)).clamp(max=1.0)


def exact_rule(p: torch.Tensor, q: torch.Tensor, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position: accept ``x`` with ``min(1, p(x) / q(x))``, fall back to ``norm((p - q)_+)``."""
    return accept_ratio(p, q), residual(p.double(), q.double())


def position_law(rule: PositionRule, p: torch.Tensor, q: torch.Tensor, state=None) -> torch.Tensor:
    """Exact law ``[..., V]`` of the token a per-position rule emits at one position (draft ``x ~ q``):
    accepted mass ``q(y) a(y)`` plus the rejected mass ``1 - sum_x q(x) a(x)`` spread as the fallback law."""
    p, q = p.double(), q.double()
    accept, fallback = rule(p, q, state)
    kept = q * accept
    return kept + (1 - kept.sum(-1, keepdim=True)).clamp_min(0) * fallback


def chain_laws(draft) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafted tokens ``x [g]`` and the laws they were drawn from ``[g, V]``."""
    g = draft.num_drafted
    return draft.tokens[1:], torch.stack([first_child_law(draft, i) for i in range(g)])


def walk_chain(draft, p: torch.Tensor, rng, rule: PositionRule, state=None) -> Verdict:
    """Verify a chain with a per-position rule: one coin per position, stop at the first rejection."""
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x, laws = chain_laws(draft)
    accept, fallback = rule(p[:g], laws, state)
    return chain_verdict(rng.bernoulli(accept.gather(1, x[:, None]).squeeze(1)), p, fallback.__getitem__, rng)


def chain_verdict(accepted: torch.Tensor, p: torch.Tensor, fallback, rng, feedback=()) -> Verdict:
    """End a chain step from its per-position decisions ``accepted [g]``: keep the accepted prefix, then
    draw the recovered token from ``fallback(i)`` (the law at position i) at the first rejection, or the bonus
    token from ``p``."""
    g = accepted.numel()
    n = int(accepted.long().cumprod(0).sum())  # number accepted before the first rejection
    path = tuple(range(1, n + 1))
    tested = (1,) * min(n + 1, g)
    token = rng.categorical(p[g]) if n == g else rng.categorical(fallback(n))
    return Verdict(path, int(token), tested, feedback)


@register("chain", exact=True, note="chain speculative sampling (Leviathan/Chen 2023)", chain_only=True,
          position_rule=exact_rule, greedy_prefix=True)
def chain(draft, p, rng) -> Verdict:
    """``walk_chain`` with ``exact_rule``, computed where it is used: the acceptance ratio at the drafted tokens
    only, the residual only at the first rejection (the same coins, the same laws; O(g + V) instead of O(g V), which
    matters at a 262k vocabulary)."""
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x, laws = chain_laws(draft)
    accepted = rng.bernoulli(accept_ratio(p[:g].gather(1, x[:, None]), laws.gather(1, x[:, None])).squeeze(1))
    return chain_verdict(accepted, p, lambda i: residual(p[i].double(), laws[i].double()), rng)
