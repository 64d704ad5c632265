"""The EAGLE-style draft head: the model (``head``), the text the target writes to train it (``corpus``) and its
training (``train``). How often it agrees with the target, measured through the decoding loop, is
``verispec.bench.agreement``."""

from .corpus import features
from .head import FORMAT, HEADS_DIR, EagleHead, shipped_head
from .train import TrainConfig, draft_vocabulary, evaluate, head_loss, train

__all__ = ["FORMAT", "HEADS_DIR", "EagleHead", "TrainConfig", "draft_vocabulary", "evaluate", "features", "head_loss",
           "shipped_head", "train"]
