"""Greedy verification (temperature 0): follow the child equal to ``argmax p`` while one exists,
then emit ``argmax p``. Works on any tree; consumes no randomness. Exact for greedy decoding only:
it ignores the sampling temperature and always reproduces the target's greedy output."""

from __future__ import annotations

from .base import Verdict, register


@register("greedy", exact=True, greedy_only=True, note="argmax walk; equals the target's greedy decoding (temperature 0)")
def greedy(draft, p, rng) -> Verdict:
    tree, tokens = draft.tree, draft.tokens.tolist()
    best = p.argmax(-1).tolist()  # [N]
    node, path, tested = 0, [], []
    while tree.children[node]:
        kids = tree.children[node]
        hit = next((c for c in kids if tokens[c] == best[node]), None)
        tested.append(kids.index(hit) + 1 if hit is not None else len(kids))
        if hit is None:
            break
        path.append(hit)
        node = hit
    return Verdict(tuple(path), best[node], tuple(tested))
