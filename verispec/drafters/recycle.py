"""Token recycling (Luo et al. 2024, arXiv 2408.08696): drafts from what the target already said, no extra forward.

Every target forward computes logits at each of its rows: the root and every drafted node, accepted or not. The
drafter keeps, for each token, the target's top ``k`` next tokens at the latest row that had it as input (a
``[V, k]`` table, read and written in place), and drafts from the root by following the table: a chain of each
token's first successor, or a small tree of its first few (children ``topk``). No model runs to draft.

The table is a sequence's own (cleared when it starts, one per fork), so a request's seeded text does not depend on
what ran before it (``scripts/experiments/free_drafts.py --shared`` replays a table kept across requests: it drafted
barely more on Spec-Bench answers at T = 0). A node's law is a point mass on its successor (``q``
one-hot; the ranks below it only order a tree's children), so every exact verifier keeps the target's law. What is
drafted depends on earlier forwards only, never on this step's randomness.
"""

from __future__ import annotations

import torch

from .base import Drafter, _Growing, sparse_row
from .registry import register_draft, whole_number

_RANKS_BELOW = -1e4  # the logit gap between successive successors: exp(-1e4) is 0 in float32, so q is a point mass


class RecycleDrafter(Drafter):
    name = "recycle"
    free_root = True
    sparse = True  # a row is a token's k successors
    depth_cost = 0.01  # table reads, no model forward
    uses_target_logits = True

    def __init__(self, vocab_size: int, k: int = 4):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.vocab_size, self.k = vocab_size, k
        self.table = torch.full((vocab_size, k), -1, dtype=torch.int32)
        self._ranks = torch.arange(k, dtype=torch.float32) * _RANKS_BELOW

    def reset(self, prompt: list[int]) -> None:
        self.table.fill_(-1)

    def fork(self) -> "RecycleDrafter":
        return RecycleDrafter(self.vocab_size, self.k)

    def observe_logits(self, tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """The target's logits ``[n, V]`` after each of the forward's input ``tokens`` ``[n]``: each token's row of
        the table becomes its top-k (a token met twice keeps its last row)."""
        if not len(tokens):
            return
        top = logits.topk(min(self.k, logits.shape[-1]), -1).indices.to(torch.int32)
        last = {int(t): i for i, t in enumerate(tokens.tolist())}
        rows = torch.tensor(list(last.values()))
        self.table[torch.tensor(list(last)), :top.shape[1]] = top[rows]

    def _row(self, token: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        succ = self.table[token]
        if int(succ[0]) < 0:
            return None
        n = int((succ >= 0).sum())
        return sparse_row(succ[:n].tolist(), self._ranks[:n])  # distinct by construction (a top-k)

    def _root_sparse(self, context):
        return self._row(context[-1])

    def _node_sparse(self, g: _Growing, nodes: list[int]):
        return [self._row(g.tokens[n]) for n in nodes]


@register_draft("recycle", help="'recycle' or 'recycle:K' (the target's own K likeliest successors of each token, "
                "kept from earlier forwards)",
                check=whole_number(1, 64, "successor count", "recycle or recycle:K with 1 <= K <= 64"))
def _recycle(target, arg, **_) -> RecycleDrafter:
    return RecycleDrafter(target.vocab_size, k=int(arg) if arg else 4)
