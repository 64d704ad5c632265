"""Drafters: a separate draft model, a layer-skip self-draft, an int8 copy, n-gram prompt lookup, the EAGLE head,
prompt lookup and a model draft switched per step, or none; built from spec strings by ``build_drafter``."""

from .base import CHILD_MODES, Draft, Drafter, NoDrafter
from .factory import DRAFT_HELP, DraftSpec, build_drafter, parse_layers, sidecar
from .hybrid import HybridDrafter
from .model import ModelDrafter, layer_skip_drafter
from .ngram import NgramDrafter

__all__ = ["CHILD_MODES", "DRAFT_HELP", "Draft", "DraftSpec", "Drafter", "ModelDrafter", "NgramDrafter", "NoDrafter",
           "HybridDrafter", "build_drafter", "layer_skip_drafter", "parse_layers", "sidecar"]
