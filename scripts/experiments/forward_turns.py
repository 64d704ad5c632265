"""One timing loop for the experiments that compare ways of running the same target forward (kernel builds, thread
settings): ``forwards_in_turns`` times a batch of sequences' forwards, the ways taking turns, and says whether their
logits are equal bit for bit. A helper, not an experiment."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def forwards_in_turns(target, ways: dict[str, Callable[[], None]], seqs: int, rows: int, context: int = 400,
                      turns: int = 30, skip: int = 4) -> tuple[dict[str, float], bool]:
    """Median ms of ``target.forward_batch`` over ``seqs`` sequences of ``rows`` rows each (a causal chain) after
    ``context`` entries of cache, for each way (``ways[name]()`` switches to it), the ways in alternating order over
    ``turns`` rounds, the first ``skip`` left out; and whether every way's logits were equal bit for bit."""
    pool = target.state_pool(seqs, 1024)
    states = [pool.acquire() for _ in range(seqs)]
    for i, s in enumerate(states):
        target.prefill(s, list(range(100 + i, 100 + context + i)))
    tokens = [torch.arange(7, 7 + rows) for _ in states]
    attend = [torch.ones(rows, rows, dtype=torch.bool).tril() for _ in states]
    times: dict[str, list[float]] = {name: [] for name in ways}
    logits = {}
    for r in range(turns):
        for name in (list(ways) if r % 2 else list(ways)[::-1]):
            ways[name]()
            positions = [s.committed + torch.arange(rows) for s in states]
            t0 = time.perf_counter()
            out = target.forward_batch(states, tokens, positions, attend)
            times[name].append(time.perf_counter() - t0)
            logits[name] = [o.logits for o in out]
            for s in states:
                target.commit(s, [])
    first, *others = logits.values()
    same = all(torch.equal(a, b) for other in others for a, b in zip(first, other))
    return {name: statistics.median(t[skip:]) * 1e3 for name, t in times.items()}, same
