"""Verifiers, registered by name. Import a module here to register its verifiers."""

from . import (  # noqa: F401  (registers)
    block, chain, greedy, hsd, lossy, match, multi, ordered, reserve, resispec, spechub, traversal,
)
from .base import VERIFIERS, Verdict, VerifierSpec, check, get_verifier, register

__all__ = ["VERIFIERS", "Verdict", "VerifierSpec", "check", "get_verifier", "register"]
