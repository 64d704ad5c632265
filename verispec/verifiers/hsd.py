"""HSD, hierarchical speculative decoding (Zhou et al. 2026, arXiv 2601.05724), on a chain, as its authors' public
script (``algorithm.py``) computes it -- **not exact** (docs/algorithms.md, "HSD as its script computes it").

With the chain's prefix ratios ``r_0 = 1``, ``r_k = prod_{j<k} p_j(x_{j+1}) / q_j(x_{j+1})`` and their running cap
``m_k = max(1, r_1, .., r_k)``, the script compares the capped joint target mass ``(P(x_{1:k}) / m_k) p_k`` with the
joint draft mass ``Q(x_{1:k}) q_k`` at every position ``k < g``: per prefix, ``w_k p_k`` against ``q_k`` with
``w_k = r_k / m_k``. Backwards from the end it keeps the longest prefix whose coin says "do not step back"
(probability ``sum (w_k p_k - q_k)_+ / max(sum (w_k p_k - q_k)_+, sum (q_k - w_k p_k)_+)``) and resamples position
``k`` from ``norm((w_k p_k - q_k)_+)``; the whole chain it keeps with probability ``min(1, r_g)``.

Two readings were chosen where the script does not run (it names variables it never defines): the cap is the running
maximum of the prefix ratios (the script sets it only where a new maximum appears, else leaves 1, which no formula of
the paper gives), and a position where ``w_k p_k = q_k`` everywhere steps back (nothing to resample there).

Up to the last position these are block verification's weights and coins (``w_k = min(1, w_{k-1} p/q)`` unrolled is
``r_k / m_k``, and the denominator is ``S_k + 1 - w_k``); only the whole chain's coin differs, ``min(1, r_g)``
against block's ``w_g = r_g / m_g``. Where a prefix's ratio rose above 1 and fell back, HSD keeps the whole chain more
often than block verification, the optimum over exact chain rules: that is its extra acceptance, and its bias. With
point-mass drafts (``--children topk``, as the authors' EAGLE-3 code drafts) every ratio is at most 1, ``m_k = 1``,
and HSD is block verification, exact.
"""

from __future__ import annotations

import torch

from .base import Verdict, first_child_law, register
from .block import kept_prefix_verdict


@register("hsd", exact=False, chain_only=True,
          note="HSD (Zhou et al. 2026) as its script computes it: block verification's coins, but the whole chain kept "
               "with min(1, P/Q) (biased where a prefix ratio exceeds 1; exact with top-k children)")
def hsd(draft, p, rng) -> Verdict:
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x = draft.tokens[1:]
    laws = torch.stack([first_child_law(draft, i) for i in range(g)]).to(torch.float64)  # row i: law of x_{i+1}
    P = p.to(torch.float64)
    px = P[:g].gather(1, x[:, None]).squeeze(1)
    qx = laws.gather(1, x[:, None]).squeeze(1)
    ratio = torch.cat([px.new_ones(1), torch.cumprod(px / qx, 0)])  # r_0 .. r_g (q(x) > 0: x was drawn from q)
    w = ratio / torch.cummax(ratio.clamp_min(1.0), 0).values  # r_k / m_k
    keep = []
    for k in range(1, g):  # do not step back at k: keep x_1..x_k and resample position k
        diff = w[k] * P[k] - laws[k]
        over, under = float(diff.clamp_min(0).sum()), float((-diff).clamp_min(0).sum())
        keep.append(over / max(over, under) if over > 0 else 0.0)
    keep.append(min(1.0, float(ratio[g])))  # the whole chain
    return kept_prefix_verdict(keep, w, P, laws, rng)
