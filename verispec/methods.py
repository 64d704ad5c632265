"""Named methods: a verifier, a draft-length policy and a depth cap (AdaSD's Tables 1-2 rows), plus the
two Hugging Face peers. Benchmarks pick methods from here by name instead of wiring them again."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import VerispecError
from .policies import get_policy
from .tree import Tree
from .verifiers import get_verifier


@dataclass(frozen=True)
class Method:
    name: str
    verifier: str | None  # None: a Hugging Face peer or plain decoding
    policy: str
    max_depth: int  # chain cap (0: no drafting)
    note: str
    peer: str | None = None  # "generate" or "assisted" for the Hugging Face peers

    def tree(self) -> Tree:
        return Tree.chain(self.max_depth) if self.max_depth else Tree.root_only()

    def build(self):
        """Fresh (verifier spec, policy, verifier state) for a run; reuse them across prompts to keep learning."""
        spec = get_verifier(self.verifier or "chain")
        return spec, get_policy(self.policy), spec.new_state() if spec.new_state else None


_ROWS = [
    Method("hf-generate", None, "fixed", 0, "Hugging Face generate of the target (no draft)", peer="generate"),
    Method("hf-assisted", None, "fixed", 0, "Hugging Face assisted generation with the same draft", peer="assisted"),
    Method("target", "chain", "fixed", 0, "plain autoregressive decoding of the target in verispec's loop"),
    Method("fixed", "chain", "fixed", 5, "exact chain speculative sampling, 5 tokens (the papers' Vanilla)"),
    Method("hf", "chain", "hf", 20, "exact verification with Hugging Face's draft-length rules (20, confidence 0.4, ROC)"),
    Method("hf-heuristic", "chain", "hf:heuristic", 20, "exact verification, Hugging Face +2/-1 schedule"),
    Method("adaedl", "chain", "adaedl", 10, "exact verification, AdaEDL entropy stop (cap 10)"),
    Method("adasd", "adasd", "adasd-entropy", 10, "AdaSD: entropy stop + Bayesian JS acceptance (cap 10; lossy)"),
    Method("adasd-gen-only", "chain", "adasd-entropy", 10, "AdaSD generation rule only (exact verification)"),
    Method("adasd-verify-only", "adasd", "fixed", 5, "AdaSD verification only, 5 tokens (lossy)"),
    Method("adasd-hybrid", "adasd", "hf", 20, "AdaSD verification + Hugging Face length control (lossy)"),
    Method("fsd", "fsd", "fixed", 5, "FSD, JS threshold 0.3, 5 tokens (lossy)"),
    Method("typical", "typical", "fixed", 5, "Medusa typical acceptance, 5 tokens (lossy)"),
    Method("bild", "bild", "bild", 10, "BiLD fallback 0.6 + rollback 5 (cap 10; lossy)"),
]
METHODS = {m.name: m for m in _ROWS}


def get_method(name: str) -> Method:
    try:
        return METHODS[name]
    except KeyError:
        raise VerispecError(f"unknown method {name!r}; choose from {', '.join(METHODS)}") from None
