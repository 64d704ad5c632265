"""Verifiers, registered by name. Import a module here to register its verifiers."""

from . import block, chain, greedy, hsd, lossy, match, multi, ordered, reserve, resispec, traversal  # noqa: F401  (registers)
from .base import VERIFIERS, Verdict, VerifierSpec, check, get_verifier, register

__all__ = ["VERIFIERS", "Verdict", "VerifierSpec", "check", "get_verifier", "register"]
