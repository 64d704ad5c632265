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

    def __init__(self, vocab_size: int, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.vocab_size = vocab_size
        self.max_n, self.min_n = max_n, min_n
        self._context: list[int] = []

    def _lookup(self, seq: list[int]) -> torch.Tensor | None:
        """Log-counts ``[V]`` of the tokens that followed the longest earlier match of a suffix, or None."""
        s = torch.tensor(seq, dtype=torch.long)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            windows = s.unfold(0, n, 1)[:-1]  # every n-gram that has a following token
            hits = (windows == s[-n:]).all(dim=1).nonzero().squeeze(1)
            if hits.numel():
                counts = torch.bincount(s[hits + n], minlength=self.vocab_size).float()
                return counts.log()  # -inf where never seen
        return None

    def _root_logits(self, context):
        self._context = list(context)
        return self._lookup(self._context)

    def _node_logits(self, g: _Growing, nodes: list[int]) -> torch.Tensor:
        rows = []
        for node in nodes:
            row = self._lookup(self._context + g.path(node))
            rows.append(row if row is not None else torch.full((self.vocab_size,), float("-inf")))
        return torch.stack(rows)
