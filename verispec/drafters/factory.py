"""Drafters from spec strings (``--draft``): parsed and checked first, built on a target second.

``DraftSpec.parse`` needs no model, so a bad spec fails before anything loads; ``build_drafter`` turns a spec into
a drafter for a target, including the EAGLE head shipped for a built-in target and its sidecar (how it was made
and the tree tuned for it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import load, quantized_copy
from ..eagle import head as heads
from ..errors import VerispecError
from .base import Drafter, NoDrafter
from .eagle import EagleDrafter
from .hybrid import HybridDrafter
from .model import ModelDrafter, layer_skip_drafter
from .ngram import NgramDrafter
from .recycle import RecycleDrafter
from .suffix import SuffixCache, SuffixDrafter

DRAFT_HELP = (
    "'none' (plain autoregressive decoding), 'layerskip:L' (the first L layers of the target) or 'layerskip:0,2,4' / "
    "'layerskip:0-9,20-29' (a chosen subset), 'ngram' or 'ngram:N' (prompt lookup, n-grams up to N), 'int8' (an "
    "int8 copy of the target), 'eagle' (the EAGLE-style head shipped for the target; 'eagle:PATH' for one from "
    "'verispec train-draft'), 'model:SPEC' (a separate draft model with the target's tokenizer: alias, .gguf file, "
    "folder or hub id), 'hybrid' or 'hybrid:DRAFT' (prompt lookup on steps where the text repeats itself, the model "
    "draft DRAFT elsewhere; default DRAFT: the shipped head), or 'auto' (the default: 'hybrid' when a head ships for "
    "the target, else 'ngram')"
)
KINDS = ("auto", "none", "layerskip", "ngram", "suffix", "recycle", "int8", "eagle", "model", "hybrid")
MODEL_KINDS = ("layerskip", "int8", "eagle", "model")  # drafts that run a model (a hybrid's other source)


@dataclass(frozen=True)
class DraftSpec:
    kind: str
    arg: str = ""

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    @classmethod
    def parse(cls, text: str) -> "DraftSpec":
        """Check a ``--draft`` string without loading anything (see ``DRAFT_HELP``)."""
        kind, _, arg = str(text).strip().partition(":")
        if kind not in KINDS:
            raise VerispecError(f"unknown draft {text!r}; use one of: {', '.join(KINDS)} (see --help)")
        if kind in ("auto", "none", "int8", "suffix") and arg:
            raise VerispecError(f"draft {kind!r} takes no argument (got {text!r})")
        if kind == "ngram" and arg and (not arg.isdigit() or int(arg) < 1):
            raise VerispecError(f"bad n-gram length in draft {text!r}; use ngram or ngram:N with N >= 1")
        if kind == "recycle" and arg and (not arg.isdigit() or not 1 <= int(arg) <= 64):
            raise VerispecError(f"bad successor count in draft {text!r}; use recycle or recycle:K with 1 <= K <= 64")
        if kind == "layerskip" and arg:
            parse_layers(arg, text)
        if kind == "hybrid" and arg and DraftSpec.parse(arg).kind not in (*MODEL_KINDS, "recycle"):
            raise VerispecError(f"a hybrid draft pairs prompt lookup with a model draft ({', '.join(MODEL_KINDS)}) "
                                f"or recycle, not {arg!r}")
        if kind == "model" and not arg:
            raise VerispecError("draft 'model' needs a model: model:SPEC (alias, .gguf file, folder or hub id)")
        if kind == "eagle" and arg:
            path = Path(arg)
            if not path.is_file():
                raise VerispecError(f"draft head not found: {arg}")
            if path.suffix != ".pt":
                raise VerispecError(f"a draft head is a .pt file written by 'verispec train-draft', not {arg!r}")
        return cls(kind, arg)


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
    """A drafter for ``target`` from a ``--draft`` string (see ``DRAFT_HELP``)."""
    spec = spec if isinstance(spec, DraftSpec) else DraftSpec.parse(spec)
    kind, arg = spec.kind, spec.arg
    hf = target.backend == "hf"  # a head, an int8 copy and layer skipping need the Hugging Face model
    if kind == "auto":
        return build_drafter("hybrid" if hf and shipped_head_path(target) is not None else "ngram", target, dtype)
    if kind == "hybrid":
        if not arg and not (hf and shipped_head_path(target) is not None):
            raise VerispecError("draft 'hybrid' pairs prompt lookup with the head shipped for the target, and none "
                                "ships for this one; name the model draft: hybrid:DRAFT (e.g. hybrid:int8)")
        return HybridDrafter(build_drafter(arg or "eagle", target, dtype), NgramDrafter(target.vocab_size))
    if not hf and kind in ("eagle", "int8", "layerskip"):
        raise VerispecError(f"draft {kind!r} needs the Hugging Face backend (its model's weights and features); with "
                            "the llama backend use 'ngram' or 'model:SPEC'")
    if kind == "none":
        return NoDrafter()
    if kind == "layerskip":
        if not arg:
            return layer_skip_drafter(target, target.num_layers // 4)
        return layer_skip_drafter(target, int(arg) if arg.isdigit() else parse_layers(arg, str(spec)))
    if kind == "ngram":
        return NgramDrafter(target.vocab_size, max_n=int(arg) if arg else 3)
    if kind == "suffix":
        return SuffixDrafter(target.vocab_size)
    if kind == "recycle":
        return RecycleDrafter(target.vocab_size, k=int(arg) if arg else 4)
    if kind == "int8":
        return ModelDrafter(quantized_copy(target), name="int8")
    if kind == "eagle":
        path = Path(arg) if arg else heads.shipped_head(target.name)
        drafter = EagleDrafter(heads.EagleHead.load(path, target), name=str(spec))
        info = sidecar(path)
        drafter.default_tree = info.get("default_tree")
        # tune-tree measured these on the float32 target; in another dtype rows cost otherwise (a bfloat16 forward of
        # six rows costs about what one does here), so the policy goes by that target's own measured forwards
        float32 = target.dtype == torch.float32
        drafter.step_costs = tuple(info["step_costs"]) if info.get("step_costs") and float32 else None
        return drafter
    # a draft model runs on the target's engine, with as many threads
    drafter = ModelDrafter(load(arg, dtype=dtype, backend=target.backend, threads=None if hf else target.threads))
    drafter.check_compatible(target)
    return drafter
