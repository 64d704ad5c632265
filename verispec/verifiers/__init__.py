"""Verifiers, registered by name. Import a module here to register its verifiers."""

from . import block, chain, greedy, lossy, multi, ordered, reserve, resispec  # noqa: F401  (registration side effect)
from .base import VERIFIERS, Verdict, VerifierSpec, get_verifier, register

__all__ = ["VERIFIERS", "Verdict", "VerifierSpec", "get_verifier", "register"]
