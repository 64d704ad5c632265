"""Named methods: a verifier, a draft-length policy and a draft tree shape -- what ``verispec generate`` does by
default (``default``), AdaSD's Tables 1-2 rows -- plus the peers (Hugging Face ``generate`` and assisted
generation, llama.cpp). Benchmarks pick methods from here by name instead of wiring them again.

``resolve_method`` also accepts any registered verifier (``specinfer``, ``fsd:0.2``) and a tree after
``@`` (``specinfer@3x5``, ``fixed@chain:8``): a verifier alone means fixed-length drafting of a chain of 5.
The tree ``auto`` is the one tuned for the draft (``Drafter.default_tree``), else ``FALLBACK_TREE``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .errors import VerispecError
from .policies import get_policy
from .tree import Tree
from .verifiers import get_verifier


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str | None  # None: a Hugging Face peer
    policy: str
    shape: str  # draft tree (``Tree.parse`` syntax), "none" for no drafting, "auto" for the draft's tuned tree
    note: str
    peer: str | None = None  # "generate", "assisted", "llama-cpp" or "llama-cpp-lookup" for the peers

    def tree(self, drafter=None) -> Tree:
        """The draft tree; ``auto`` needs the drafter whose tuned tree it is (without one: ``FALLBACK_TREE``)."""
        if self.shape == "none":
            return Tree.root_only()
        if self.shape == "auto":
            return Tree.parse(getattr(drafter, "default_tree", None) or FALLBACK_TREE)
        return Tree.parse(self.shape)

    @property
    def uses_draft(self) -> bool:
        """Whether the method's output depends on the draft (plain decoding and HF generate do not)."""
        return self.peer == "assisted" or (self.peer is None and self.shape != "none")

    def build(self, drafter=None, target=None):
        """Fresh (verifier spec, policy, verifier state) for a run; reuse them across prompts to keep learning.
        With the target and drafter, the ``auto`` policy weighs depths by their measured step costs."""
        spec = get_verifier(self.verifier or "chain")
        if self.policy.partition(":")[0] == "auto" and target is not None and drafter is not None:
            from .backends.costs import auto_policy  # noqa: PLC0415

            policy = auto_policy(target, drafter, self.policy)
        else:
            policy = get_policy(self.policy)
        return spec, policy, spec.new_state() if spec.new_state else None


FALLBACK_TREE = "chain:5"  # the tree "auto" means for a draft with no tuned tree
DEFAULT_VERIFIER = "chain"  # what ``verispec generate`` verifies with by default

_ROWS = [
    Method("default", DEFAULT_VERIFIER, "auto", "auto",
           "what 'verispec generate' does with no options: the default draft and its tuned tree, exact chain "
           "verification, the draft length chosen step by step from measured acceptance (policy auto)"),
    Method("auto-gate", DEFAULT_VERIFIER, "auto:gate", "auto",
           "the default plus the auto policy's confidence gate: each further token drafted only while the draft's "
           "calibrated confidence in it makes it pay"),
    Method("hf-generate", None, "fixed", "none", "Hugging Face generate of the target (no draft)", peer="generate"),
    Method("hf-assisted", None, "fixed", "none",
           "Hugging Face assisted generation with the same draft (a model draft, or prompt lookup for ngram)",
           peer="assisted"),
    Method("llama-cpp", None, "fixed", "none",
           "llama.cpp's plain decoding of the same GGUF file (llama-cpp-python; a quantised model: its own target)",
           peer="llama-cpp"),
    Method("llama-cpp-lookup", None, "fixed", "none",
           "llama-cpp-python's prompt-lookup speculative decoding of the same GGUF file (its own target)",
           peer="llama-cpp-lookup"),
    Method("ar", "chain", "fixed", "none", "plain autoregressive decoding of the target in verispec's loop"),
    Method("fixed", "chain", "fixed", "chain:5", "exact chain speculative sampling, 5 tokens (the papers' Vanilla)"),
    Method("hf", "chain", "hf", "chain:20",
           "exact verification with Hugging Face's draft-length rules (20, confidence 0.4, ROC)"),
    Method("hf-heuristic", "chain", "hf:heuristic", "chain:20", "exact verification, Hugging Face +2/-1 schedule"),
    Method("adaedl", "chain", "adaedl", "chain:10", "exact verification, AdaEDL entropy stop (cap 10)"),
    Method("adasd", "adasd", "adasd-entropy", "chain:10",
           "AdaSD: entropy stop + Bayesian JS acceptance (cap 10; lossy)"),
    Method("adasd-gen-only", "chain", "adasd-entropy", "chain:10", "AdaSD generation rule only (exact verification)"),
    Method("adasd-verify-only", "adasd", "fixed", "chain:5", "AdaSD verification only, 5 tokens (lossy)"),
    Method("adasd-hybrid", "adasd", "hf", "chain:20", "AdaSD verification + Hugging Face length control (lossy)"),
    Method("fsd", "fsd", "fixed", "chain:5", "FSD, JS threshold 0.3, 5 tokens (lossy)"),
    Method("typical", "typical", "fixed", "chain:5", "Medusa typical acceptance, 5 tokens (lossy)"),
    Method("bild", "bild", "bild", "chain:10", "BiLD fallback 0.6 + rollback 5 (cap 10; lossy)"),
]
METHODS = {m.name: m for m in _ROWS}
METHODS_HELP = (
    "a named method (" + ", ".join(METHODS) + "), or a verifier name (fixed-length chain of 5), "
    "optionally with a draft tree after '@': specinfer@3x5, reserve@3,1,1, fixed@chain:8"
)


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise VerispecError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None


def resolve_method(spec: str) -> Method:
    """``NAME[@TREE]``: a named method or a verifier, with an optional draft tree (see ``METHODS_HELP``)."""
    name, at, shape = spec.partition("@")
    if name in METHODS:
        method = METHODS[name]
    else:
        try:
            verifier = get_verifier(name)
        except VerispecError:
            raise VerispecError(f"unknown method {name!r}: use {METHODS_HELP}") from None
        method = Method(spec, name, "fixed", "chain:5",
                        f"{verifier.name}: {verifier.note}")
    if at:
        if method.peer is not None or method.shape == "none":
            raise VerispecError(f"method {name!r} drafts nothing; it takes no tree (got {spec!r})")
        if shape != "auto":
            Tree.parse(shape)  # fail early on a bad tree
        method = replace(method, name=spec, shape=shape)
    return method
