"""Drafters from spec strings (``--draft``): parsed and checked first, built on a target second, both through the
registry of draft kinds (``registry.DRAFTS``).

``DraftSpec.parse`` needs no model, so a bad spec fails before anything loads; ``build_drafter`` turns a spec into
a drafter for a target, including the EAGLE head shipped for a built-in target and its sidecar (how it was made
and the tree tuned for it).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import VerispecError
from .base import Drafter
from .eagle import shipped_head_path
from .hybrid import HybridDrafter
from .ngram import NgramDrafter
from .registry import DRAFTS, register_draft
from .suffix import SuffixCache, SuffixDrafter


@register_draft("auto", help="'auto' (the default: 'hybrid' when a head ships for the target, else 'ngram')",
                takes_arg=False)
def _auto(target, arg, dtype="float32", make=None, **_) -> Drafter:
    shipped = target.backend == "hf" and shipped_head_path(target) is not None
    return make("hybrid" if shipped else "ngram", target, dtype)


def draft_help() -> str:
    """``--draft``'s help: every registered kind's phrase, ``auto`` last."""
    kinds = [k for k in DRAFTS.values() if k.name != "auto"] + [DRAFTS["auto"]]
    return ", ".join(k.help for k in kinds[:-1]) + ", or " + kinds[-1].help


@dataclass(frozen=True)
class DraftSpec:
    kind: str
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    @classmethod
    def parse(cls, text: str) -> "DraftSpec":
        """Check a ``--draft`` string without loading anything (see ``draft_help``)."""
        kind, _, arg = str(text).strip().partition(":")
        if kind not in DRAFTS:
            names = ["auto", *(k for k in DRAFTS if k != "auto")]
            raise VerispecError(f"unknown draft {text!r}; use one of: {', '.join(names)} (see --help)")
        entry = DRAFTS[kind]
        if arg and not entry.takes_arg:
            raise VerispecError(f"draft {kind!r} takes no argument (got {text!r})")
        if entry.check is not None:
            entry.check(arg, str(text))
        return cls(kind, arg)


def with_answer_cache(drafter: Drafter, cache: SuffixCache) -> tuple[Drafter, bool]:
    """``drafter`` drafting from ``cache`` (answers already served) too, where it has a prompt lookup to do it with:
    its lookup becomes a ``SuffixDrafter`` on the cache (a hybrid keeps its model draft; prompt lookup alone becomes
    the suffix drafter). Returns (the drafter, whether it reads the cache); a draft with no lookup is returned as is."""
    if isinstance(drafter, HybridDrafter):
        return HybridDrafter(drafter.model, SuffixDrafter(drafter.vocab_size, cache), drafter.min_match), True
    if isinstance(drafter, (NgramDrafter, SuffixDrafter)):
        return SuffixDrafter(drafter.vocab_size, cache), True
    return drafter, False


def build_drafter(spec: str | DraftSpec, target, dtype: str = "float32") -> Drafter:
    """A drafter for ``target`` from a ``--draft`` string (see ``draft_help``)."""
    spec = spec if isinstance(spec, DraftSpec) else DraftSpec.parse(spec)
    entry = DRAFTS[spec.kind]
    if entry.needs_hf and target.backend != "hf":
        raise VerispecError(f"draft {spec.kind!r} needs the Hugging Face backend (its model's weights and features); "
                            "with the llama backend use 'ngram' or 'model:SPEC'")
    return entry.build(target, spec.arg, dtype=dtype, spec=str(spec), make=build_drafter)
