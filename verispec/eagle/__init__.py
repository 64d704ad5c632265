"""The EAGLE-style draft head: the model (``head``), the text the target writes to train it (``corpus``), its
training (``train``) and how often it agrees with the target (``agreement``)."""

from .agreement import FIXED_PROMPT, FIXED_TOKENS, fixed_prompt_acceptance, in_loop_check, teacher_forced
from .head import FORMAT, HEADS_DIR, EagleHead, shipped_head
from .train import TrainConfig, draft_vocabulary, evaluate, features, head_loss, train

__all__ = [
    "FIXED_PROMPT", "FIXED_TOKENS", "FORMAT", "HEADS_DIR", "EagleHead", "TrainConfig", "draft_vocabulary", "evaluate",
    "features", "fixed_prompt_acceptance", "head_loss", "in_loop_check", "shipped_head", "teacher_forced", "train",
]
