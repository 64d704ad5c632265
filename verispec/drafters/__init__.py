"""Drafters: a separate draft model, a layer-skip self-draft, an int8 copy, n-gram prompt lookup, the EAGLE head,
prompt lookup and a model draft switched per step, or none; built from spec strings by ``build_drafter``."""

from .base import CHILD_MODES, Draft, Drafter, NoDrafter
from .factory import DRAFT_HELP, DraftSpec, build_drafter, parse_layers, sidecar, with_answer_cache
from .hybrid import HybridDrafter
from .model import ModelDrafter, layer_skip_drafter
from .ngram import NgramDrafter
from .recycle import RecycleDrafter
from .suffix import SuffixCache, SuffixDrafter

__all__ = ["CHILD_MODES", "DRAFT_HELP", "Draft", "DraftSpec", "Drafter", "ModelDrafter", "NgramDrafter", "NoDrafter", "RecycleDrafter", "SuffixCache", "SuffixDrafter",
           "HybridDrafter", "build_drafter", "layer_skip_drafter", "parse_layers", "sidecar", "with_answer_cache"]
