"""Negative controls: verifiers with known bugs that the audit must flag. Never registered for decoding."""

from __future__ import annotations

import torch

from ..probs import residual
from ..rng import TorchRandomness
from ..verifiers.base import NodeOutcome, Verdict, VerifierSpec, first_child_law, walk_tree
from ..verifiers.traversal import traverse


def _mss_skip_duplicates(draft, node, p, rng):
    """MSS that skips a repeated rejected token instead of applying the residual update again."""
    q, r, seen = draft.q[node], p, set()
    for rank, child in enumerate(draft.tree.children[node]):
        x = int(draft.tokens[child])
        if x in seen:
            continue
        seen.add(x)
        ratio = float(r[x]) / float(q[x]) if float(q[x]) > 0 else 0.0
        if bool(rng.bernoulli(torch.tensor(min(1.0, ratio), dtype=torch.float64))):
            return NodeOutcome(rank, None, rank + 1)
        r = residual(r, q)
    return NodeOutcome(None, r, len(draft.tree.children[node]))


def _chain_reseeded(draft, p, rng):
    """Chain speculative sampling whose accept coins come from a generator reseeded at every position
    (a bug seen in the wild): the coin is a fixed function of the position, not fresh randomness."""
    g = draft.num_drafted
    for i in range(g):
        x = int(draft.tokens[i + 1])
        law = first_child_law(draft, i)
        u = float(TorchRandomness(seed=i).uniform(()))
        if not u < min(1.0, float(p[i, x]) / float(law[x])):
            return Verdict(tuple(range(1, i + 1)), int(rng.categorical(residual(p[i], law))), (1,) * (i + 1))
    return Verdict(tuple(range(1, g + 1)), int(rng.categorical(p[g])), (1,) * g)


NEGATIVE_CONTROLS = {
    "ctl-mss-skip-dup": VerifierSpec(
        "ctl-mss-skip-dup", lambda d, p, rng: walk_tree(d, p, rng, _mss_skip_duplicates), exact=False,
        note="negative control: MSS skipping the residual update on a duplicate child", children="iid",
        node_rule=_mss_skip_duplicates,
    ),
    "ctl-traversal-no-residual": VerifierSpec(
        "ctl-traversal-no-residual", lambda d, p, rng: traverse(d, p, rng, residual_update=False), exact=False,
        note="negative control: traversal verification without the residual update after a rejection",
        children="swor",
    ),
    "ctl-reseeded": VerifierSpec(
        "ctl-reseeded", _chain_reseeded, exact=False, chain_only=True,
        note="negative control: chain sampling with randomness reseeded per position",
    ),
}
