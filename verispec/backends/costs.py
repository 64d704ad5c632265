"""What a decoding step costs on this machine, relative to a plain one: the numbers the ``auto`` draft-length policy
weighs depths by.

``forward_costs(target)`` times the target's forward over 1..``MAX_ROWS`` tree tokens once per machine, model file,
backend and thread count, and keeps the result on disk (``~/.cache/verispec/costs``): measured once, then the same
numbers every run, so the policy's decisions -- and the text a seed gives -- do not depend on a run's timing noise.
``step_costs(target, drafter)`` turns them into the cost of a step drafting a chain of d tokens: the target's
forward over d + 1 tokens plus the draft's own cost per depth (a shipped head's sidecar carries both, measured by
``verispec tune-tree``; a prompt-lookup draft costs next to nothing).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform

import torch

MAX_ROWS = 9  # forward sizes measured: 1..9 tokens (chains up to 8 drafted tokens)
DRAFT_COST = {"ngram": 0.01}  # drafting cost per depth relative to a plain step, for drafts with no sidecar


def _key(target) -> str:
    ident = getattr(target, "path", None) or getattr(target, "name", "model")
    backend = "llama" if hasattr(target, "path") else "hf"
    plan, lean = None, getattr(target, "_lean", None) is not None  # the forward's kernels and implementation
    if hasattr(target, "hf"):
        from torch import nn  # noqa: PLC0415

        plan = next((getattr(m, "_verispec_plan", None) for m in target.hf.modules() if type(m) is nn.Linear), None)
    raw = f"{backend}|{ident}|{getattr(target, 'threads', torch.get_num_threads())}|{platform.machine()}|" \
          f"{os.cpu_count()}|{plan}|{torch.__version__}" + ("|lean" if lean else "")
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def forward_costs(target, repeats: int = 9, measure: bool = True) -> list[float] | None:
    """Seconds of the target's forward over 1..MAX_ROWS tree tokens (median of ``repeats``), cached on disk."""
    from .loading import cache_root  # noqa: PLC0415

    path = cache_root() / "costs" / f"{_key(target)}.json"
    try:
        cached = json.loads(path.read_text())["seconds"]
        if len(cached) == MAX_ROWS:
            return cached
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if not measure:
        return None
    from ..tune import target_forward_cost  # noqa: PLC0415

    seconds = target_forward_cost(target, [5] * 32 + [7], list(range(1, MAX_ROWS + 1)), repeats)
    out = [seconds[n] for n in range(1, MAX_ROWS + 1)]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: a reader never sees half
        tmp.write_text(json.dumps({"seconds": out, "target": getattr(target, "name", "?")}))
        tmp.replace(path)
    except OSError:
        pass
    return out


def step_costs(target, drafter) -> tuple[float, ...] | None:
    """Relative cost of a step drafting a chain of d tokens (d = 0..MAX_ROWS - 1), never decreasing; None when the
    target cannot be timed this way (the policy then uses its generic costs)."""
    own = getattr(drafter, "step_costs", None)
    if own and hasattr(target, "hf"):
        return tuple(own)
    try:
        fwd = forward_costs(target)
    except Exception:  # noqa: BLE001 - a target without the Target interface: generic costs
        return None
    if not fwd:
        return None
    per_depth = DRAFT_COST.get(getattr(drafter, "name", ""), 0.1)
    costs = (fwd[d] / fwd[0] + d * per_depth for d in range(len(fwd)))
    return tuple(itertools.accumulate(costs, max))


def auto_policy(target, drafter, spec: str = "auto"):
    """The ``auto`` draft-length policy (``spec``: ``auto`` or ``auto:gate``) for this target and draft: their step
    costs, and whether the draft's first depth is free (then the confidence gate decides every step); for a drafter
    with several sources, one such policy per source (``PerSource``)."""
    from ..policies import PerSource, get_policy  # noqa: PLC0415

    sources = getattr(drafter, "sources", None)
    if sources:  # a drafter that switches between sources: one policy each, with that source's costs
        return PerSource({name: auto_policy(target, sub, spec) for name, sub in sources.items()})
    return get_policy(spec, step_costs(target, drafter), free_root=bool(getattr(drafter, "free_root", False)))
