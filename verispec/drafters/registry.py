"""The draft kinds ``--draft`` names, one registry: each kind registers its builder with ``@register_draft`` in the
module that defines its drafter, and ``factory.DraftSpec.parse``, ``build_drafter``, the CLI's help and the
benchmark's ``--drafts`` read it from here (docs/design.md, "Where new things go")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import VerispecError


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft: ``build(target, arg, dtype=..., spec=..., make=...)`` makes it for a target (``arg``: what
    follows the colon, ``spec``: the whole spec, ``make``: ``build_drafter`` itself, for a kind built from others);
    ``help`` is its phrase in ``--draft``'s help; ``check(arg, spec)`` refuses a bad argument before anything loads
    (``VerispecError``); ``takes_arg``: whether it takes one at all; ``runs_model``: it runs a model (a hybrid's
    other source may be one); ``needs_hf``: it needs the Hugging Face backend (the target's weights or features)."""

    name: str
    build: Callable
    help: str
    check: Callable[[str, str], None] | None = None
    takes_arg: bool = True
    runs_model: bool = False
    needs_hf: bool = False


DRAFTS: dict[str, DraftKind] = {}


def register_draft(name: str, *, help: str, check: Callable[[str, str], None] | None = None, takes_arg: bool = True,
                   runs_model: bool = False, needs_hf: bool = False):
    """Register the decorated function as the builder of draft kind ``name`` (see ``DraftKind``)."""
    def wrap(build: Callable) -> Callable:
        if name in DRAFTS:
            raise VerispecError(f"draft kind {name!r} is registered twice")
        DRAFTS[name] = DraftKind(name, build, help, check, takes_arg, runs_model, needs_hf)
        return build
    return wrap


def whole_number(low: int, high: int | None, what: str, usage: str) -> Callable[[str, str], None]:
    """A ``check`` for an optional whole-number argument in [low, high]."""
    def check(arg: str, spec: str) -> None:
        if arg and (not arg.isdigit() or int(arg) < low or (high is not None and int(arg) > high)):
            raise VerispecError(f"bad {what} in draft {spec!r}; use {usage}")
    return check
