"""What a draft model costs on this machine when it drafts for several sequences at once.

A batch drafts depth by depth: at the first depth the draft model runs one forward over what every drafting
sequence's cache lacks and draws each one's first token; at each further depth, one forward over the nodes of the
sequences that draft that deep. So a step's drafting costs ``first(n_1) + further(n_2) + further(n_3) + ...``, with
n_k the number of sequences drafting k tokens or more. ``draft_costs(target, drafter)`` times both by the number of
sequences (whole ``propose_batch`` calls: the forwards, the draws and the bookkeeping in Python) once per machine and
draft (``Drafter.cost_id``), and keeps them in the on-disk cache beside the target's (``verispec.cache``, kind
``costs``), so that a batch's plan (``verispec.engine``) does not depend on a run's timing noise. The first depth also
runs what a draft's cache lacks (``Drafter.catch_up``): one row when the draft drafted at the step before, more after
steps it sat out. Each further row costs ``per_row``, timed the same way.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

from .. import cache
from ..backends.costs import BATCH_CONTEXT, interpolate
from ..probs import Sampling
from ..rng import TorchRandomness
from ..tree import Tree
from .base import Drafter, propose_batch

DRAFT_BATCHES = (1, 2, 4, 8, 16)  # sequences drafting together, measured
REVISION = 6  # of the drafting code the cached costs were measured with (2: the head's inputs batched; 3: per_row;
# 4: the head's layers on float16 panels; 5: a head's depth in one native call; 6: a batch's too)
DEEPEST = 3  # depths timed: 1 and this; each further depth costs a share of the difference
CAUGHT_UP = 16  # rows of context each of 8 sequences' drafts lack, timed for ``per_row``


@dataclass(frozen=True)
class DraftCosts:
    """Seconds of a batch's drafting by the number of sequences (measured at ``sizes``, linear in between and
    beyond): ``first`` for the first depth of that many sequences, ``further`` for each further depth; ``per_row``
    for each row a sequence's first depth runs beyond one (``Drafter.catch_up``: the context its draft has not
    seen)."""

    sizes: tuple[int, ...]
    first: tuple[float, ...]
    further: tuple[float, ...]
    per_row: float = 0.0

    def seconds(self, counts: list[int]) -> float:
        """Seconds of a step whose drafting sequences draft ``counts[k]`` of them k + 1 tokens or more."""
        total = 0.0
        for k, n in enumerate(counts):
            if n:
                total += interpolate(self.sizes, self.first if k == 0 else self.further, n)
        return total


def _timed(forks: list[Drafter], context: list[int], depth: int, repeats: int) -> list[float]:
    n = len(forks)
    rngs = [TorchRandomness(i) for i in range(n)]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        drafts = propose_batch(forks, [context] * n, [Tree.chain(depth)] * n, [Sampling(0.0)] * n, ["iid"] * n,
                               rngs, [None] * n)
        times.append(time.perf_counter() - t)
        for f, d in zip(forks, drafts):
            f.commit(d, [])  # nothing accepted: the next call drafts again from the same context
    return times


def _forks(drafter: Drafter, context: list[int], hidden, n: int) -> list[Drafter]:
    """``n`` fresh copies of ``drafter`` started on ``context``, each given the target's features ``hidden``."""
    forks = []
    for _ in range(n):
        f = drafter.fork()
        f.reset(context)
        if f.uses_target_hidden:
            f.observe(hidden)
        forks.append(f)
    return forks


def _per_row(drafter: Drafter, context: list[int], hidden, repeats: int) -> float:
    """``DraftCosts.per_row``: the first depth of 8 sequences whose drafts lack ``CAUGHT_UP`` rows of ``context``,
    against the same with one row lacking, per further row (medians of ``repeats``, the two taking turns)."""
    n, behind = 8, len(context) - CAUGHT_UP
    times: dict[int, list[float]] = {CAUGHT_UP: [], 1: []}
    for _ in range(repeats):
        forks = _forks(drafter, context[:behind], hidden, n)
        _timed(forks, context[:behind], 1, 1)  # caught up to ``behind`` (untimed)
        lacking = forks[0].catch_up(context)
        times[CAUGHT_UP] += _timed(forks, context, 1, 1)
        times[1] += _timed(forks, context, 1, 1)  # nothing accepted: one row lacking again
    extra = statistics.median(times[CAUGHT_UP]) - statistics.median(times[1])
    return max(extra, 0.0) / (n * max(lacking - 1, 1))


def draft_costs(target, drafter: Drafter, repeats: int = 5, measure: bool = True) -> DraftCosts | None:
    """``drafter``'s ``DraftCosts`` after a context of ``BATCH_CONTEXT`` tokens (medians of ``repeats``; the batch
    sizes take turns within each round), measured once and cached under its ``cost_id``; None for a draft with no
    ``cost_id`` (its ``depth_cost`` stands for its cost), or when not cached and ``measure`` is False."""
    if drafter.cost_id is None:
        return None
    entry = cache.key("draft", REVISION, drafter.cost_id, target.forward_id, platform.machine(), os.cpu_count())
    got = cache.read("costs", entry)
    if got and tuple(got.get("sizes", ())) == DRAFT_BATCHES:
        return DraftCosts(DRAFT_BATCHES, tuple(got["first"]), tuple(got["further"]), got["per_row"])
    if not measure:
        return None
    context = [5] * (BATCH_CONTEXT - 1) + [7]
    state = target.new_state()
    pre = target.prefill_output(state, context[:-1], features=drafter.feature_layers)
    forks = _forks(drafter, context, pre.hidden, max(DRAFT_BATCHES))
    _timed(forks, context, DEEPEST, 1)  # each draft's cache takes in the context, once: not what a step costs
    times: dict[tuple[int, int], list[float]] = {(n, d): [] for n in DRAFT_BATCHES for d in (1, DEEPEST)}
    for _ in range(repeats):
        for n in DRAFT_BATCHES:
            for d in (1, DEEPEST):
                times[n, d] += _timed(forks[:n], context, d, 1)
    first = [statistics.median(times[n, 1]) for n in DRAFT_BATCHES]
    further = [max(statistics.median(times[n, DEEPEST]) - f, 0.0) / (DEEPEST - 1) for n, f in zip(DRAFT_BATCHES, first)]
    per_row = _per_row(drafter, context, pre.hidden, repeats)
    out = DraftCosts(DRAFT_BATCHES, tuple(first), tuple(further), per_row)
    cache.write("costs", entry, {"sizes": list(DRAFT_BATCHES), "first": first, "further": further,
                                 "per_row": per_row, "draft": drafter.name, "target": target.name})
    return out


def measured_draft_costs(target, drafter: Drafter) -> dict[str, DraftCosts]:
    """``draft_costs`` of each of ``drafter``'s draft sources that has any, by ``cost_id``: what an ``Engine`` given
    its costs up front (``planner.CostBook(drafts=...)``) plans with."""
    out = {}
    for source in (drafter.sources or {"": drafter}).values():
        costs = draft_costs(target, source)
        if costs is not None:
            out[source.cost_id] = costs
    return out
