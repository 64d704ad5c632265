"""verispec: speculative decoding whose verification you can trust.

The public API, one import away::

    import verispec
    target = verispec.load()                                   # the built-in default model
    drafter = verispec.build_drafter("auto", target)           # prompt lookup + its shipped EAGLE head
    out = verispec.generate(target, drafter, verispec.get_verifier("chain"), "Hello!", temperature=0.6)

Pieces (each with a small interface): ``backends`` (target engines: the Hugging Face adapter with tree attention),
``tree`` (token trees), ``drafters`` (and their factory), ``verifiers`` (pure functions on probability tensors,
registered by name), ``policies`` (draft length), ``decode`` (the loop), ``audit`` (exact output laws),
``methods`` (named verifier + policy + tree combinations), ``bench`` (benchmarks, records, report), ``eagle`` (the
trained draft head), ``integrations.transformers`` (a ``custom_generate`` for Hugging Face ``generate``), ``serve``
(the batched engine behind an OpenAI-compatible HTTP server, ``verispec serve``).
"""

from .backends import DEFAULT_TARGET, CausalLM, Target, load
from .decode import GenerationResult, StepRecord, TextStream, generate, generate_batch, generate_steps
from .drafters import DraftSpec, ModelDrafter, NgramDrafter, NoDrafter, build_drafter, layer_skip_drafter
from .errors import VerispecError
from .methods import METHODS, Plan, Recipe, build_policy, resolve
from .policies import POLICIES, Policy, get_policy
from .probs import Sampling
from .rng import Randomness, TorchRandomness
from .tree import Tree
from .verifiers import VERIFIERS, get_verifier
from .version import __version__

__all__ = [
    "CausalLM", "DEFAULT_TARGET", "DraftSpec", "GenerationResult", "METHODS", "ModelDrafter", "NgramDrafter",
    "NoDrafter", "POLICIES", "Plan", "Policy", "Randomness", "Recipe", "Sampling", "StepRecord", "Target",
    "TextStream", "TorchRandomness", "Tree", "VERIFIERS", "VerispecError", "build_drafter", "build_policy", "generate",
    "generate_batch", "generate_steps", "get_policy", "get_verifier", "layer_skip_drafter", "load", "resolve", "__version__",
]
