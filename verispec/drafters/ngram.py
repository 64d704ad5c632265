"""Prompt-lookup (n-gram) drafting: no model, the draft law comes from the context itself.

For a node, take the longest suffix of (context + drafted path) of length ``max_n`` down to ``min_n``
that occurred earlier; the draft law ``q`` is the empirical distribution of the tokens that followed
its earlier occurrences. With no match the node gets no children.
"""

from __future__ import annotations

import torch

from .base import Drafter, _Growing


class NgramDrafter(Drafter):
    name = "ngram"
    free_root = True
    depth_cost = 0.01  # a lookup in the context, no model forward

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self._context: list[int] = []
        self._match: dict[int, tuple[int, float, float]] = {}  # node -> (match length, top count, total count)
        self._indexed: list[int] = []  # the context whose n-grams ``_seen`` holds (``match_length``)
        self._seen: set[tuple[int, ...]] = set()

    def _find(self, seq: list[int]) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """The longest suffix of ``seq`` (``max_n`` down to ``min_n`` tokens) that occurred earlier with a token after
        it: (its length n, ``seq`` as a tensor, where the earlier occurrences start), or None."""
        s = torch.tensor(seq, dtype=torch.long)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            windows = s.unfold(0, n, 1)[:-1]  # every n-gram that has a following token
            hits = (windows == s[-n:]).all(dim=1).nonzero().squeeze(1)
            if hits.numel():
                return n, s, hits
        return None

    def match_length(self, context: list[int]) -> int:
        """How long a match drafting after ``context`` would use (0: none, so no draft): ``_find``'s n, from a set of
        the context's n-grams that have a token after them, extended by the tokens committed since the last call
        (a switching draft asks this of every sequence at every step: a few set lookups instead of a search of the
        whole context)."""
        n_old = len(self._indexed)
        if len(context) < n_old or context[:n_old] != self._indexed:  # another context: index it from the start
            self._seen, n_old = set(), 0
        for end in range(max(n_old - 1, 0), len(context) - 1):  # n-grams ending at ``end`` now have a token after
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._seen.add(tuple(context[end - n + 1:end + 1]))
        self._indexed = list(context)
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            if tuple(context[-n:]) in self._seen:
                return n
        return 0

    def _lookup(self, seq: list[int], node: int) -> torch.Tensor | None:
        """Log-counts ``[V]`` of the tokens that followed the longest earlier match of a suffix, or None; the
        match's length and the count of its most frequent continuation are kept for ``confidence``."""
        found = self._find(seq)
        if found is None:
            return None
        n, s, hits = found
        seen, counts = torch.unique(s[hits + n], return_counts=True)
        self._match[node] = (n, float(counts.max()), float(counts.sum()))
        row = torch.full((self.vocab_size,), float("-inf"))  # never seen
        row[seen] = counts.float().log()
        return row

    def reset(self, prompt: list[int]) -> None:
        self._context, self._match = [], {}
        self._indexed, self._seen = [], set()

    def _root_logits(self, context):
        self._context = list(context)
        self._match = {}
        return self._lookup(self._context, 0)

    def _node_logits(self, g: _Growing, nodes: list[int]) -> torch.Tensor:
        rows = []
        for node in nodes:
            row = self._lookup(self._context + g.path(node), node)
            rows.append(row if row is not None else torch.full((self.vocab_size,), float("-inf")))
        return torch.stack(rows)

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
