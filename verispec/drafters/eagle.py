"""The EAGLE drafter: a trained draft head (``verispec.eagle.EagleHead``) fed with the target's own features.

The head keeps a KV cache of pairs (f_j, x_{j+1}) at position j: the target's feature at j and the next
token. The decoding loop hands it the target's features (``observe``): the prompt's after the prefill,
then after each step those of the root and the accepted path. Drafting the root's children runs the
pairs the cache lacks, up to (f_{L-2}, x_{L-1}) for a context of L tokens, and reads the next-token law
from the last one; a drafted node at depth d >= 2 is the pair (predicted feature of its parent, its
token) at position L - 2 + d, attending to its drafted ancestors. Drafted entries are never kept: the
next step replaces them by pairs with the target's true features.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..eagle import head as heads
from ..errors import VerispecError
from .base import Draft, Drafter, _Growing
from .model import _shared, prefill_batch, tree_level
from .registry import register_draft


class EagleDrafter(Drafter):
    uses_target_hidden = True

    def __init__(self, head, name: str = "eagle"):
        self.head = head
        self.lm = head.lm
        self.feature_layers = head.feature_layers
        self.name = name
        self.vocab_size = head.target.vocab_size
        self.state = self.lm.new_state()
        self._features: torch.Tensor | None = None  # rows 0 .. count-1 hold the target features received so far
        self._count = 0
        self._pred: dict[int, torch.Tensor] = {}  # drafted node (or the root, 0) -> predicted feature after it
        self._slot: dict[int, int] = {}
        self._anc: list[set[int]] = []

    @property
    def batch_key(self) -> object:
        return id(self.lm)

    @property
    def cost_id(self) -> str:
        shape = self.head.shape()
        blocks = f"|{self.head.blocks}" if self.head.blocks else ""
        return f"eagle|{sorted(shape.items())}|{self.lm.forward_id}{blocks}"

    def reset(self, prompt: list[int]) -> None:
        self.state = self.lm.new_state()
        self._features, self._count = None, 0

    def observe(self, hidden: torch.Tensor) -> None:
        """Appends to a buffer that doubles when full: a step costs the rows it adds, not the context's length."""
        n = int(hidden.shape[0]) if hidden.numel() else 0
        if not n:
            return
        if self._features is None or self._count + n > self._features.shape[0]:
            grown = torch.empty(max(2 * (self._count + n), 256), hidden.shape[1])
            if self._features is not None:
                grown[:self._count] = self._features[:self._count]
            self._features = grown
        self._features[self._count:self._count + n] = hidden
        self._count += n

    def catch_up(self, context: list[int]) -> int:
        last = len(context) - 2
        return 0 if last < 0 else max(last + 1 - self.state.committed, 1)

    def _feature_rows(self, start: int, stop: int) -> torch.Tensor:
        return self._features[start:stop]

    def _root_input(self, context: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pairs the head's cache lacks, up to (f_{L-2}, x_{L-1}): their tokens and target features (the head's
        inputs: ``head.target_inputs``); None for a one-token context (no feature yet: nothing is drafted)."""
        if self.state.pending:
            self.lm.commit(self.state, [])
        self._slot, self._anc, self._pred = {}, [set()], {}
        last = len(context) - 2  # the pair (f_{L-2}, x_{L-1}) predicts the first drafted token
        if last < 0:
            return None
        if self._count <= last:
            raise VerispecError(f"eagle drafter has target features for {self._count} positions, needs {last + 1}")
        if self.state.committed > last:  # drafting again from a context already cached: recompute the last pair
            self.lm.rollback(self.state, self.state.committed - last)
        start = self.state.committed
        feats = self._feature_rows(start, last + 1)
        return torch.tensor(context[start + 1:last + 2]), feats

    def _root_output(self, out) -> torch.Tensor:
        self._pred[0] = out.hidden[-1]
        return self.head.full_logits(out.logits[-1])

    def _node_input(self, g: _Growing, nodes: list[int]):
        # the last cached pair (f_{L-2}, x_{L-1}) sits at position L - 2, so a node at depth d lands at L - 2 + d
        tokens, positions, attend = tree_level(g, nodes, self._anc, self._slot, self.state)
        return tokens, positions, attend, torch.stack([self._pred[g.parents[n]] for n in nodes])

    def _node_output(self, nodes: list[int], out) -> torch.Tensor:
        for row, n in enumerate(nodes):
            self._pred[n] = out.hidden[row]
        return self.head.full_logits(out.logits)

    @torch.inference_mode()
    def _root_logits(self, context: list[int]) -> torch.Tensor | None:
        inp = self._root_input(context)
        if inp is None:
            return None
        tokens, feats = inp
        out = _root_depth([self], [tokens], feats)
        if out is None:
            return self._root_output(self.lm.prefill_output(self.state, tokens, self.head.target_inputs(feats, tokens)))
        return self._root_output(out[0])

    @torch.inference_mode()
    def _node_logits(self, g: _Growing, nodes: list[int]) -> torch.Tensor:
        tokens, positions, attend, hidden = self._node_input(g, nodes)
        out = self.head.depth([self.state], [tokens], [positions], [attend], hidden, False, False)
        if out is None:
            return self._node_output(nodes, self.lm.forward(self.state, tokens, positions, attend,
                                                            self.head.draft_inputs(hidden, tokens)))
        return self._node_output(nodes, out[0])

    @classmethod
    @torch.inference_mode()
    def _answer_batch(cls, drafters: list["EagleDrafter"], requests: list[tuple]) -> list[torch.Tensor | None]:
        """One forward of the head over every sequence's pairs (the root) or drafted nodes (a depth)."""
        out: list[torch.Tensor | None] = [None] * len(drafters)
        for idx in _shared(drafters, requests, lambda d: d.lm):
            if len(idx) == 1:
                out[idx[0]] = drafters[idx[0]]._answer(requests[idx[0]])
                continue
            if requests[idx[0]][0] == "root":
                inputs = {i: drafters[i]._root_input(requests[i][1]) for i in idx}
                live = [i for i in idx if inputs[i] is not None]
                if live:
                    tokens = [inputs[i][0] for i in live]
                    feats = torch.cat([inputs[i][1] for i in live])
                    got = _root_depth([drafters[i] for i in live], tokens, feats)
                    if got is None:
                        embeds = _split(drafters[live[0]].head.target_inputs(feats, torch.cat(tokens)), tokens)
                        got = prefill_batch(drafters[live[0]].lm, [drafters[i].state for i in live], tokens, embeds)
                    for i, o in zip(live, got):
                        out[i] = drafters[i]._root_output(o)
            else:
                inputs = [drafters[i]._node_input(requests[i][1], requests[i][2]) for i in idx]
                tokens, positions, attends, hidden = map(list, zip(*inputs))
                states = [drafters[i].state for i in idx]
                head = drafters[idx[0]].head
                got = head.depth(states, tokens, positions, attends, torch.cat(hidden), False, False)
                if got is None:
                    embeds = _split(head.draft_inputs(torch.cat(hidden), torch.cat(tokens)), tokens)
                    got = drafters[idx[0]].lm.forward_batch(states, tokens, positions, attends, inputs_embeds=embeds)
                for i, o in zip(idx, got):
                    out[i] = drafters[i]._node_output(requests[i][2], o)
        return out

    def commit(self, draft: Draft, path: list[int]) -> None:
        self.lm.commit(self.state, [])  # drafted pairs used predicted features: drop them all
        self._slot, self._pred = {}, {}


def _root_depth(drafters: list[EagleDrafter], tokens: list[torch.Tensor], feats: torch.Tensor):
    """The drafters' prefills of the pairs their caches lack (``tokens``, the target's features ``feats``, every
    sequence's in order) in one native call where it runs (``EagleHead.depth``), committed; None where it does not
    (nothing done: the caller runs the forward)."""
    states = [d.state for d in drafters]
    positions = [torch.arange(st.committed, st.committed + len(t)) for st, t in zip(states, tokens)]
    causal = [torch.ones(len(t), len(t), dtype=torch.bool).tril() for t in tokens]
    out = drafters[0].head.depth(states, tokens, positions, causal, feats, True, True)
    if out is not None:
        for d, t in zip(drafters, tokens):
            d.lm.commit(d.state, list(range(len(t))))
    return out


def _split(rows: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """``rows`` cut into pieces as long as the tensors of ``like``: one head input computed for a batch, back per
    sequence (each row's own; the head's layers compute rows alike however many come together)."""
    return list(rows.split([len(t) for t in like]))


def shipped_head_path(target) -> Path | None:
    """The head shipped for ``target`` (by its alias), or None."""
    path = heads.HEADS_DIR / f"{target.name}.pt"  # read at call time: tests point HEADS_DIR elsewhere
    return path if path.is_file() else None


def sidecar(path: Path) -> dict:
    """What ``scripts/ship_head.py`` wrote beside a head: the command that made it, its measurements, its tree."""
    side = Path(path).with_suffix(".json")
    if not side.is_file():
        return {}
    try:
        return json.loads(side.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _head_file(arg: str, spec: str) -> None:
    if arg:
        path = Path(arg)
        if not path.is_file():
            raise VerispecError(f"draft head not found: {arg}")
        if path.suffix != ".pt":
            raise VerispecError(f"a draft head is a .pt file written by 'verispec train-draft', not {arg!r}")


@register_draft("eagle", help="'eagle' (the EAGLE-style head shipped for the target; 'eagle:PATH' for one from "
                "'verispec train-draft')", check=_head_file, runs_model=True, needs_hf=True)
def _eagle(target, arg, spec="eagle", **_) -> EagleDrafter:
    path = Path(arg) if arg else heads.shipped_head(target.name)
    head = heads.EagleHead.load(path, target)
    if target.dtype == torch.float32:
        head.draft_from_blocks()  # its layers from Q8_0 blocks where the native kernel reads them
    drafter = EagleDrafter(head, name=spec)
    info = sidecar(path)
    drafter.default_tree = info.get("default_tree")
    # tune-tree measured these on the float32 target; in another dtype rows cost otherwise (a bfloat16 forward of
    # six rows costs about what one does here), so the policy goes by that target's own measured forwards
    float32 = target.dtype == torch.float32
    drafter.step_costs = tuple(info["step_costs"]) if info.get("step_costs") and float32 else None
    return drafter
