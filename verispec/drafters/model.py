"""Drafters backed by a causal LM: a separate draft model, or a layer-skip view of the target."""

from __future__ import annotations

import torch

from ..backends import CausalLM
from ..errors import VerispecError
from .base import Draft, Drafter, _Growing


class ModelDrafter(Drafter):
    """Drafts with a causal LM that keeps its own KV cache.

    Each step feeds the context tokens its cache lacks (the last step's recovered/bonus token and
    accepted leaves), then drafts the tree level by level: one forward per depth over the new nodes,
    attending to their drafted ancestors. ``commit`` keeps the accepted nodes it has cached.
    """

    def __init__(self, model: CausalLM, name: str | None = None):
        self.model = model
        self.name = name or f"model:{model.name}"
        self.vocab_size = model.vocab_size
        self.state = model.new_state()
        self._slot: dict[int, int] = {}  # drafted node -> pending cache entry
        self._anc: list[set[int]] = []

    def check_compatible(self, target) -> None:
        super().check_compatible(target)
        mine, theirs = self.model.tokenizer, target.tokenizer
        if mine is not None and theirs is not None and mine is not theirs and mine.get_vocab() != theirs.get_vocab():
            raise VerispecError(
                f"draft tokenizer of {self.model.name!r} differs from the target's; a draft must share the target's vocabulary"
            )

    def reset(self, prompt: list[int]) -> None:
        self.state = self.model.new_state()
        self._slot = {}

    def _root_logits(self, context: list[int]) -> torch.Tensor:
        if self.state.pending:
            self.model.commit(self.state, [])
        self._slot = {}
        self._anc = [set()]
        if self.state.committed >= len(context):  # drafting again from a context already cached: recompute the root
            self.model.rollback(self.state, self.state.committed - len(context) + 1)
        return self.model.prefill(self.state, context[self.state.committed :])

    def _node_logits(self, g: _Growing, nodes: list[int]) -> torch.Tensor:
        tokens, positions, attend = tree_level(g, nodes, self._anc, self._slot, self.state)
        return self.model.forward(self.state, tokens, positions, attend).logits

    def _renumber(self, kept: list[int]) -> None:
        self._slot = {new: self._slot[old] for new, old in enumerate(kept) if old in self._slot}

    def commit(self, draft: Draft, path: list[int]) -> None:
        keep = []
        for node in path:
            if node not in self._slot:
                break
            keep.append(self._slot[node])
        self.model.commit(self.state, keep)
        self._slot = {}


def tree_level(g: _Growing, nodes: list[int], anc: list[set[int]], slot: dict[int, int], state):
    """Tokens, positions and attention of one level of drafted ``nodes`` fed to a draft model's KV ``state``:
    node n sits at (position of the last committed entry) + its depth and sees its drafted ancestors' pending
    entries. Extends ``anc`` (each node's ancestors, itself included) and assigns ``slot`` (pending entries)."""
    for node in range(len(anc), len(g.parents)):
        anc.append(anc[g.parents[node]] | {node})
    base = state.committed - 1
    attend = torch.zeros(len(nodes), state.pending + len(nodes), dtype=torch.bool)
    for row, n in enumerate(nodes):
        slot[n] = state.pending + row
        for a in anc[n]:
            if a in slot:
                attend[row, slot[a]] = True
    positions = torch.tensor([base + len(anc[n]) for n in nodes])
    return torch.tensor([g.tokens[n] for n in nodes]), positions, attend


def layer_skip_drafter(target: CausalLM, layers: list[int] | int) -> ModelDrafter:
    """Self-draft from a subset of the target's layers (an int L means the first L layers)."""
    if isinstance(layers, int):
        if not 0 < layers < target.num_layers:
            raise VerispecError(f"layer-skip depth must be in [1, {target.num_layers - 1}], got {layers}")
        layers = list(range(layers))
    sub = target.layer_subset(layers)
    return ModelDrafter(sub, name=f"layerskip:{sub.name}")
