"""Prompt lookup where the text repeats itself, a model draft elsewhere: one draft source per step, chosen from the
context alone.

Prompt lookup costs nothing and, where an answer copies its prompt or itself (summaries, answers from a given text,
names and numbers in a translation), it proposes long runs the target accepts; a trained head is right more often
on fresh text but costs a forward per depth. Each step, ``source(context)`` picks prompt lookup when the longest
earlier match of the context's last tokens is at least ``min_match`` tokens long, the model draft otherwise.

The choice is a function of the context, so each step's draft law is well defined and every exact verifier stays
exact. The ``auto`` policy keeps its acceptance statistics and step costs per source (``PerSource``), so each source
drafts as deep as it pays on the text at hand.
"""

from __future__ import annotations

from ..errors import VerispecError
from ..tree import Tree
from .base import Draft, Drafter
from .eagle import shipped_head_path
from .ngram import NgramDrafter
from .registry import DRAFTS, register_draft
from .suffix import SuffixDrafter


class HybridDrafter(Drafter):
    def __init__(self, model: Drafter, lookup: NgramDrafter | SuffixDrafter, min_match: int = 2,
                 name: str | None = None):
        longest = getattr(lookup, "max_n", None)  # an n-gram index matches at most max_n tokens; a suffix index any
        if min_match < 1 or longest is not None and min_match > longest:
            raise ValueError(f"min_match must lie in 1..{longest} (the lookup's longest n-gram), got {min_match}")
        if model.name == lookup.name:
            raise ValueError(f"the two sources need different names, both are {model.name!r}")
        self.model, self.lookup, self.min_match = model, lookup, min_match
        self.name = name or f"{lookup.name}+{model.name}"
        self.vocab_size = model.vocab_size if model.vocab_size is not None else lookup.vocab_size
        self.uses_target_hidden = model.uses_target_hidden
        self.uses_target_logits = model.uses_target_logits or lookup.uses_target_logits
        self.feature_layers = model.feature_layers
        self.sources = {lookup.name: lookup, model.name: model}
        depth = max(Tree.parse(model.default_tree).max_depth if model.default_tree else 1, 5)
        self.default_tree = f"chain:{depth}"  # deep enough for a lookup run; the policy cuts each source's depth
        self._chosen: tuple[int, Drafter] | None = None  # (context length, source) of the step being drafted

    def source(self, context: list[int]) -> str:
        """``lookup.name`` if the context's last ``min_match`` tokens or more occurred earlier, else ``model.name``."""
        n = self.lookup.match_length(context)
        chosen = self.lookup if n >= self.min_match else self.model
        self._chosen = (len(context), chosen)
        return chosen.name

    def _current(self, context: list[int]) -> Drafter:
        if self._chosen is None or self._chosen[0] != len(context):
            self.source(context)
        return self._chosen[1]

    def propose(self, context, tree, sampling, children, rng, control=None) -> Draft:
        return self._current(context).propose(context, tree, sampling, children, rng, control)

    def proposer(self, context: list[int]) -> Drafter:
        return self._current(context)

    def fork(self) -> "HybridDrafter":
        return HybridDrafter(self.model.fork(), self.lookup.fork(), self.min_match, self.name)

    def observe(self, hidden) -> None:
        self.model.observe(hidden)  # every step, whichever source drafted: the model's features stay complete

    def observe_logits(self, tokens, logits) -> None:
        for source in (self.model, self.lookup):  # every step, whichever source drafted
            if source.uses_target_logits:
                source.observe_logits(tokens, logits)

    def reset(self, prompt: list[int]) -> None:
        self.model.reset(prompt)
        self.lookup.reset(prompt)
        self._chosen = None

    def check_compatible(self, target) -> None:
        self.model.check_compatible(target)
        self.lookup.check_compatible(target)

    def commit(self, draft: Draft, path: list[int]) -> None:
        chosen = self._chosen[1] if self._chosen is not None else self.model
        chosen.commit(draft, path)
        self._chosen = None


def _pairs(arg: str, spec: str) -> None:
    kind = arg.partition(":")[0]
    if arg and (kind not in DRAFTS or not (DRAFTS[kind].runs_model or kind == "recycle")):
        models = ", ".join(k for k, d in DRAFTS.items() if d.runs_model)
        raise VerispecError(f"a hybrid draft pairs prompt lookup with a model draft ({models}) or recycle, not {arg!r}")
    if arg:
        DRAFTS[kind].check and DRAFTS[kind].check(arg.partition(":")[2], arg)


@register_draft("hybrid", help="'hybrid' or 'hybrid:DRAFT' (prompt lookup on steps where the text repeats itself, "
                "the model draft DRAFT elsewhere; default DRAFT: the shipped head)", check=_pairs)
def _hybrid(target, arg, dtype="float32", make=None, **_) -> HybridDrafter:
    if not arg and not (target.backend == "hf" and shipped_head_path(target) is not None):
        raise VerispecError("draft 'hybrid' pairs prompt lookup with the head shipped for the target, and none "
                            "ships for this one; name the model draft: hybrid:DRAFT (e.g. hybrid:int8)")
    return HybridDrafter(make(arg or "eagle", target, dtype), NgramDrafter(target.vocab_size))
