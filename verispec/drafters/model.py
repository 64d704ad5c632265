"""Drafters backed by a causal LM: a separate draft model, or a layer-skip view of the target."""

from __future__ import annotations

import torch

from ..backends import CausalLM, load, quantized_copy
from ..errors import VerispecError
from .base import Draft, Drafter, _Growing
from .registry import register_draft


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

    @property
    def batch_key(self) -> object:
        return id(self.model)

    @property
    def cost_id(self) -> str:
        return f"model|{self.model.forward_id}"

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

    def catch_up(self, context: list[int]) -> int:
        return max(len(context) - self.state.committed, 1)

    def _root_input(self, context: list[int]) -> list[int]:
        """The context tokens the draft's cache lacks (at least the last one): what drafting the root runs."""
        if self.state.pending:
            self.model.commit(self.state, [])
        self._slot = {}
        self._anc = [set()]
        if self.state.committed >= len(context):  # drafting again from a context already cached: recompute the root
            self.model.rollback(self.state, self.state.committed - len(context) + 1)
        return context[self.state.committed :]

    def _root_logits(self, context: list[int]) -> torch.Tensor:
        return self.model.prefill(self.state, self._root_input(context))

    def _node_logits(self, g: _Growing, nodes: list[int]) -> torch.Tensor:
        tokens, positions, attend = tree_level(g, nodes, self._anc, self._slot, self.state)
        return self.model.forward(self.state, tokens, positions, attend).logits

    @classmethod
    def _answer_batch(cls, drafters: list["ModelDrafter"], requests: list[tuple]) -> list[torch.Tensor]:
        """One forward of each draft model over every sequence's root context or nodes (``prefill_batch``,
        ``forward_batch``)."""
        out: list[torch.Tensor | None] = [None] * len(drafters)
        for idx in _shared(drafters, requests, lambda d: d.model):
            ds = [drafters[i] for i in idx]
            if len(idx) == 1:
                out[idx[0]] = ds[0]._answer(requests[idx[0]])
                continue
            if requests[idx[0]][0] == "root":
                got = prefill_batch(ds[0].model, [d.state for d in ds],
                                    [d._root_input(requests[i][1]) for d, i in zip(ds, idx)])
                logits = [o.logits[-1] for o in got]
            else:
                levels = [tree_level(requests[i][1], requests[i][2], d._anc, d._slot, d.state) for d, i in zip(ds, idx)]
                got = ds[0].model.forward_batch([d.state for d in ds], *map(list, zip(*levels)))
                logits = [o.logits for o in got]
            for i, lg in zip(idx, logits):
                out[i] = lg
        return out

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


def _shared(drafters, requests, model_of) -> list[list[int]]:
    """Indices of the drafters that can share one forward: the same draft model (``model_of``) and the same kind of
    request."""
    groups: dict[tuple, list[int]] = {}
    for i, (d, r) in enumerate(zip(drafters, requests)):
        groups.setdefault((id(model_of(d)), r[0]), []).append(i)
    return list(groups.values())


def prefill_batch(model, states: list, tokens: list[list[int]], embeds: list[torch.Tensor] | None = None) -> list:
    """``model.prefill_output`` for several states in one forward (a state alone: ``prefill_output`` itself)."""
    if len(states) == 1:
        return [model.prefill_output(states[0], tokens[0], None if embeds is None else embeds[0])]
    positions = [torch.arange(s.committed, s.committed + len(t)) for s, t in zip(states, tokens)]
    masks = [torch.ones(len(t), len(t), dtype=torch.bool).tril() for t in tokens]
    outs = model.forward_batch(states, [torch.as_tensor(t) for t in tokens], positions, masks, inputs_embeds=embeds,
                               logits_from=[len(t) - 1 for t in tokens])
    for s, t in zip(states, tokens):
        model.commit(s, list(range(len(t))))
    return outs


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


def parse_layers(text: str, spec: str = "") -> list[int]:
    """``0,2,4`` or ranges ``0-9,20-29`` -> sorted layer indices."""
    out = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise VerispecError(f"bad layer list in draft {spec or text!r}; use layerskip:L, layerskip:0,2,4 or "
                            "layerskip:0-9,20-29") from None
    return out


@register_draft("layerskip", help="'layerskip:L' (the first L layers of the target) or 'layerskip:0,2,4' / "
                "'layerskip:0-9,20-29' (a chosen subset)", check=lambda arg, spec: arg and parse_layers(arg, spec),
                runs_model=True, needs_hf=True)
def _layerskip(target, arg, spec="", **_) -> ModelDrafter:
    if not arg:
        return layer_skip_drafter(target, target.num_layers // 4)
    return layer_skip_drafter(target, int(arg) if arg.isdigit() else parse_layers(arg, spec))


@register_draft("int8", help="'int8' (an int8 copy of the target)", takes_arg=False, runs_model=True, needs_hf=True)
def _int8(target, arg, **_) -> ModelDrafter:
    return ModelDrafter(quantized_copy(target), name="int8")


def _needs_model(arg: str, spec: str) -> None:
    if not arg:
        raise VerispecError("draft 'model' needs a model: model:SPEC (alias, .gguf file, folder or hub id)")


@register_draft("model", help="'model:SPEC' (a separate draft model with the target's tokenizer: alias, .gguf "
                "file, folder or hub id)", check=_needs_model, runs_model=True)
def _model(target, arg, dtype="float32", **_) -> ModelDrafter:
    # a draft model runs on the target's engine, with as many threads
    hf = target.backend == "hf"
    drafter = ModelDrafter(load(arg, dtype=dtype, backend=target.backend, threads=None if hf else target.threads))
    drafter.check_compatible(target)
    return drafter
