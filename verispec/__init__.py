"""verispec: speculative decoding whose verification you can trust.

Pieces (each with a small interface): ``models`` (Hugging Face adapter with tree attention),
``tree`` (token trees), ``drafters``, ``verifiers`` (pure functions on probability tensors, registered
by name), ``policies`` (draft length), ``decode`` (the loop), ``audit`` (exact output laws and the
distortion of lossy rules), ``methods`` (named verifier + policy combinations), ``peers`` (Hugging Face
``generate``, plain and assisted), ``tasks`` (GSM8K, HumanEval scoring).
"""

from .decode import GenerationResult, StepRecord, generate, generate_steps
from .drafters import ModelDrafter, NgramDrafter, NoDrafter, layer_skip_drafter
from .errors import VerispecError
from .models import DEFAULT_TARGET, CausalLM
from .policies import POLICIES, get_policy
from .probs import Sampling
from .tree import Tree
from .verifiers import VERIFIERS, get_verifier

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TARGET", "POLICIES", "VERIFIERS", "CausalLM", "GenerationResult", "ModelDrafter", "NgramDrafter", "NoDrafter",
    "Sampling", "StepRecord", "Tree", "VerispecError", "generate", "generate_steps", "get_policy", "get_verifier",
    "layer_skip_drafter",
]
