"""Drafters: a separate draft model, a layer-skip self-draft, n-gram prompt lookup, or none."""

from .base import CHILD_MODES, Draft, Drafter, NoDrafter
from .model import ModelDrafter, layer_skip_drafter
from .ngram import NgramDrafter

__all__ = ["CHILD_MODES", "Draft", "Drafter", "ModelDrafter", "NgramDrafter", "NoDrafter", "layer_skip_drafter"]
