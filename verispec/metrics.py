"""Figures derived from per-step records only (one raw record, everything derived from it).

Steps may be ``StepRecord`` objects or the step dicts of a results file (``verispec.bench``).
"""

from __future__ import annotations

from collections.abc import Iterable


def _get(step, name):
    return step[name] if isinstance(step, dict) else getattr(step, name)


def mean_accepted_length(steps: Iterable) -> float:
    steps = list(steps)
    return sum(_get(s, "accepted_length") for s in steps) / max(len(steps), 1)


def per_candidate_acceptance(steps: Iterable, max_candidates: int | None = None) -> list[float]:
    """``P(candidate i accepted | candidates 1..i-1 rejected)`` for i = 1, 2, ... (ResiSpec Figure 1).

    At each depth a step reached, ``tested[d]`` candidates were tested and the last of them was accepted
    iff the step went deeper (``d < len(accepted_ranks)``).
    """
    reached: dict[int, int] = {}
    accepted: dict[int, int] = {}
    for s in steps:
        depth_accepted = len(_get(s, "accepted_ranks"))
        for d, t in enumerate(_get(s, "tested")):
            for i in range(1, t + 1):
                reached[i] = reached.get(i, 0) + 1
            if d < depth_accepted:
                accepted[t] = accepted.get(t, 0) + 1
    top = max(reached, default=0) if max_candidates is None else max_candidates
    return [accepted.get(i, 0) / reached[i] if reached.get(i) else float("nan") for i in range(1, top + 1)]
