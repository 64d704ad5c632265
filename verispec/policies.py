"""Draft-length policies: decide before each drafted depth whether to keep drafting, learn from outcomes.

Interface (two methods):
    ``keep_drafting(depth, q) -> bool``  before drafting depth ``depth + 1``; ``q [F, V]`` are the draft
                                         laws at the current frontier nodes;
    ``update(drafted, accepted)``        after each step: drafted depth and accepted drafted tokens.
The tree shape bounds the depth; a policy can only stop earlier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import VerispecError


@dataclass
class Fixed:
    """Draft the whole tree shape every step (the papers' "Vanilla" is a chain of 5)."""

    name = "fixed"

    def keep_drafting(self, depth: int, q: torch.Tensor) -> bool:
        return True

    def update(self, drafted: int, accepted: int) -> None:
        pass


POLICIES = {"fixed": Fixed}


def get_policy(name: str):
    try:
        return POLICIES[name]()
    except KeyError:
        raise VerispecError(f"unknown draft-length policy {name!r}; choose from {', '.join(sorted(POLICIES))}") from None
