"""Prompt-lookup (n-gram) drafting: no model, the draft law comes from the context itself.

For a node, take the longest suffix of (context + drafted path) of length ``max_n`` down to ``min_n``
that occurred earlier; the draft law ``q`` is the empirical distribution of the tokens that followed
its earlier occurrences. With no match the node gets no children.

The context's n-grams are kept in an index (each n-gram with a token after it: the counts of those tokens),
extended by the tokens committed since the last step, so that a lookup is a few dictionary reads however long the
context; a drafted path's own n-grams (at most a few) are counted on the fly.
"""

from __future__ import annotations

import math

import torch

from .base import Drafter, _Growing, sparse_row
from .registry import register_draft, whole_number


class NgramDrafter(Drafter):
    name = "ngram"
    free_root = True
    sparse = True  # a row is the few tokens that followed the match
    depth_cost = 0.01  # a lookup in the context, no model forward

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self._match: dict[int, tuple[int, float, float]] = {}  # node -> (match length, top count, total count)
        self._indexed: list[int] = []  # the context ``_follow`` indexes
        self._follow: list[dict[tuple[int, ...], dict[int, int]]] = [{} for _ in range(max_n + 1)]

    def _index(self, context: list[int]) -> None:
        """Make ``_follow[n]`` map each n-gram of ``context`` that has a token after it to the counts of those tokens:
        the n-grams ending at the tokens committed since the last call are added (another context: indexed anew)."""
        n_old = len(self._indexed)
        if len(context) < n_old or context[:n_old] != self._indexed:
            self._indexed, self._follow, n_old = [], [{} for _ in range(self.max_n + 1)], 0
        for end in range(max(n_old - 1, 0), len(context) - 1):  # n-grams ending at ``end`` now have a token after
            after = context[end + 1]
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                counts = self._follow[n].setdefault(tuple(context[end - n + 1:end + 1]), {})
                counts[after] = counts.get(after, 0) + 1
        self._indexed.extend(context[n_old:])

    def _find(self, path: list[int]) -> tuple[int, dict[int, int]] | None:
        """The longest suffix of the indexed context followed by ``path`` (``max_n`` down to ``min_n`` tokens) that
        occurred earlier with a token after it: (its length n, the counts of the tokens that followed it), or None."""
        ctx = self._indexed
        start = max(len(ctx) - self.max_n, 0)  # the context's part that a suffix or a path's n-gram can reach
        tail, total = ctx[start:] + path, len(ctx) + len(path)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            key = tuple(tail[len(tail) - n:])
            counts = self._follow[n].get(key)
            extra = [tail[end + 1 - start] for end in range(max(len(ctx) - 1, n - 1), total - 1)
                     if tuple(tail[end - n + 1 - start:end + 1 - start]) == key]  # ending on the context's last token
            if extra:  # or in the path: their next token is the path's
                counts = dict(counts or {})
                for x in extra:
                    counts[x] = counts.get(x, 0) + 1
            if counts:
                return n, counts
        return None

    def match_length(self, context: list[int]) -> int:
        """How long a match drafting after ``context`` would use (0: none, so no draft): ``_find``'s n, from the index
        of the context's n-grams (a switching draft asks this of every sequence at every step)."""
        self._index(context)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            if tuple(context[len(context) - n:]) in self._follow[n]:
                return n
        return 0

    def _lookup(self, path: list[int], node: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The log-counts of the tokens that followed the longest earlier match of a suffix of the context and
        ``path`` (a ``SparseRows`` row: every other token was never seen there), or None; the match's length and the
        count of its most frequent continuation are kept for ``confidence``."""
        found = self._find(path)
        if found is None:
            return None
        n, counts = found
        seen = list(counts.values())
        self._match[node] = (n, float(max(seen)), float(sum(seen)))
        return sparse_row(list(counts), [math.log(c) for c in seen])

    def reset(self, prompt: list[int]) -> None:
        self._match = {}
        self._indexed, self._follow = [], [{} for _ in range(self.max_n + 1)]

    def _root_sparse(self, context):
        self._match = {}
        self._index(context)
        return self._lookup([], 0)

    def _node_sparse(self, g: _Growing, nodes: list[int]):
        return [self._lookup(g.path(node), node) for node in nodes]

    def confidence(self, nodes: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Longer matches seen more often predict better (measured on Spec-Bench answers of both built-in models):
        ``top probability x (n - 1 + min(count, 3) / 3) / max_n`` for a match of n tokens whose most frequent
        continuation followed it ``count`` times; 1 for a repeated match of the longest length. From the match
        alone, with no vocabulary-sized work."""
        out = []
        for node in nodes:
            n, top, total = self._match.get(node, (0, 0.0, 1.0))
            out.append(top / total * (n - 1 + min(top, 3.0) / 3) / self.max_n if n else 0.0)
        return torch.tensor(out)


@register_draft("ngram", help="'ngram' or 'ngram:N' (prompt lookup, n-grams up to N)",
                check=whole_number(1, None, "n-gram length", "ngram or ngram:N with N >= 1"))
def _ngram(target, arg, **_) -> NgramDrafter:
    return NgramDrafter(target.vocab_size, max_n=int(arg) if arg else 3)
