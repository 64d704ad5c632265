"""Exactness audit: the exact output law of a verifier, by enumerating every random outcome."""

from .law import TableDrafter, random_tables, step_law, target_law, tv_and_kl, verifier_law

__all__ = ["TableDrafter", "random_tables", "step_law", "target_law", "tv_and_kl", "verifier_law"]
