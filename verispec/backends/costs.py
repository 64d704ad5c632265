"""What a target forward costs on this machine, by the number of tree tokens it runs.

``forward_costs(target)`` times the target's forward over 1..``COSTED_ROWS`` tree tokens once per machine and
``target.forward_id`` (model file, engine, threads, kernels), and keeps the result in the on-disk cache
(``verispec.cache``, kind ``costs``): measured once, then the same numbers every run, so decisions made from them --
and the text a seed gives -- do not depend on a run's timing noise. The ``auto`` draft-length policy weighs depths
by them (``verispec.methods.step_costs``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from .. import cache
from ..tree import Tree

COSTED_ROWS = 9  # forward sizes measured: 1..9 tokens (chains up to 8 drafted tokens)


def target_forward_cost(target, context: list[int], sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n tree tokens after ``context``, for each n in ``sizes``; the sizes
    take turns within each round, so that a slow spell of the machine falls on all of them alike."""
    state = target.new_state()
    target.prefill(state, context[:-1])
    shapes = {n: Tree.complete(max(1, n - 1), 1) if n > 1 else Tree.root_only() for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n, tree in shapes.items():
            tokens = torch.tensor(context[-1:] * tree.size)
            pos = state.committed + torch.tensor(tree.depths)
            t = time.perf_counter()
            target.forward(state, tokens, pos, tree.ancestors_mask())
            times[n].append(time.perf_counter() - t)
            target.commit(state, [])
    return {n: statistics.median(ts) for n, ts in times.items()}


def forward_costs(target, repeats: int = 9, measure: bool = True) -> list[float] | None:
    """Seconds of the target's forward over 1..COSTED_ROWS tree tokens (median of ``repeats``), cached on disk;
    None when not cached and ``measure`` is False."""
    entry = cache.key(target.forward_id, platform.machine(), os.cpu_count())
    cached = (cache.read("costs", entry) or {}).get("seconds")
    if isinstance(cached, list) and len(cached) == COSTED_ROWS:
        return cached
    if not measure:
        return None
    seconds = target_forward_cost(target, [5] * 32 + [7], list(range(1, COSTED_ROWS + 1)), repeats)
    out = [seconds[n] for n in range(1, COSTED_ROWS + 1)]
    cache.write("costs", entry, {"seconds": out, "target": target.name})
    return out
