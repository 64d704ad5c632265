"""Drafters: a separate draft model, a layer-skip self-draft, an int8 copy, n-gram prompt lookup, a suffix automaton,
recycled target successors, the EAGLE head, prompt lookup and a model draft switched per step, or none; each kind
registered with ``registry.register_draft`` and built from spec strings by ``build_drafter``."""

from .base import CHILD_MODES, Draft, Drafter, NoDrafter
from .eagle import EagleDrafter, sidecar
from .factory import DraftSpec, build_drafter, draft_help, with_answer_cache
from .hybrid import HybridDrafter
from .model import ModelDrafter, layer_skip_drafter, parse_layers
from .ngram import NgramDrafter
from .recycle import RecycleDrafter
from .registry import DRAFTS, register_draft
from .suffix import SuffixCache, SuffixDrafter

__all__ = ["CHILD_MODES", "DRAFTS", "Draft", "DraftSpec", "Drafter", "EagleDrafter", "HybridDrafter", "ModelDrafter",
           "NgramDrafter", "NoDrafter", "RecycleDrafter", "SuffixCache", "SuffixDrafter", "build_drafter",
           "draft_help", "layer_skip_drafter", "parse_layers", "register_draft", "sidecar", "with_answer_cache"]
