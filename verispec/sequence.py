"""A request as the engine runs it (``Sequence``: what it decodes with, its own states, what it has produced) and
what each of its steps leaves (``StepRecord``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .drafters.base import Drafter
from .policies import Policy
from .probs import Sampling
from .rng import Randomness
from .tree import DynamicTree, Tree
from .verifiers.base import VerifierSpec


@dataclass(frozen=True)
class StepRecord:
    drafted: int  # drafted tokens (tree nodes) this step
    draft_depth: int
    accepted_length: int  # accepted drafted tokens + 1 (recovered/bonus), before EOS/budget truncation
    accepted_ranks: tuple[int, ...]  # candidate index accepted at each depth
    tested: tuple[int, ...]  # candidates tested at each depth reached
    emitted: tuple[int, ...]  # tokens appended to the output (after EOS/budget truncation)
    draft_s: float
    target_s: float
    verify_s: float
    source: str | None = None  # which draft source proposed (a drafter with several), else None
    batch: int = 1  # sequences in the step's target forward


@dataclass(eq=False)
class Sequence:
    """One request as the engine runs it: what it decodes with, its own states, and what it has produced."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    drafter: Drafter
    verifier: VerifierSpec
    tree: Tree | DynamicTree
    children: str
    policy: Policy
    rng: Randomness
    verifier_state: object | None = None
    id: object = None
    state: object = None  # the target's cache, once prefilled
    context: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    stop_reason: str | None = None  # "eos", "max_new_tokens", "cancelled", "error"; None while running
    error: str | None = None
    prefill_s: float = 0.0
    prefilled: int = 0  # prompt tokens in the cache (all but the last once it decodes)
    submitted: float = 0.0  # perf_counter times
    admitted: float | None = None
    started: float | None = None  # prefilled and running
    first_token: float | None = None
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None
