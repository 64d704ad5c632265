"""What a step's verification costs a sequence that drafted, beyond what a plain step's draw costs.

A sequence with nothing drafted takes its token from the target's logits of one row (``base.draw_root``: an argmax,
or one law and a draw). One that drafted turns every row of its share of the forward into a law over the whole
vocabulary and runs its verifier over them (``base.step_verdict``; the chain rule at a greedy target reads its
verdict off the argmaxes instead): at 49,152 tokens that is 0.5-1 ms a sequence on two cores, which a batch of 8
drafting sequences pays 8 times in a step of 50 ms. ``verify_costs`` times it (``step_verdict`` itself, on chains of
random laws of the target's vocabulary) once per machine, verifier, kind of sampling and number of torch threads,
and keeps it in the on-disk cache beside the forward's and the drafts' costs (``verispec.cache``, kind ``costs``),
so that a batch's plan (``verispec.engine``) can charge each drafting sequence for it without reading a run's timing
noise.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from .. import cache
from ..drafters.base import Draft
from ..probs import Sampling, logits_to_probs
from ..rng import TorchRandomness
from ..tree import Tree
from .base import VerifierSpec, step_verdict

REVISION = 3  # of the verification code the cached costs were measured with (3: the greedy chain off its argmaxes)
DEEPEST = 3  # drafted rows timed: 1 and this; each further row costs a share of the difference
WARM_UP = 3  # untimed rounds first (the first calls of a process run several times slower)


@dataclass(frozen=True)
class VerifyCosts:
    """Seconds a step's verification of ``rows`` target rows (the root and the drafted nodes) costs beyond a plain
    step's draw: ``first`` for the first drafted row, ``further`` for each further one."""

    first: float
    further: float

    def seconds(self, rows: int) -> float:
        return 0.0 if rows <= 1 else self.first + (rows - 2) * self.further


def _step(rows: int, vocab: int, sampling: Sampling, gen: torch.Generator) -> tuple[Draft, torch.Tensor]:
    """A chain of ``rows - 1`` drafted tokens whose laws are ``sampling``'s of random logits (point masses at
    temperature 0, as a greedy draft's are), each token drawn from its parent's law, and the target's logits: the
    draft's, disturbed, so that some drafted tokens are accepted and some rejected, as in a real step."""
    drafted = torch.randn(rows, vocab, generator=gen) * 3
    q = logits_to_probs(drafted, sampling)
    q[-1] = 0.0  # a leaf's children were never drawn
    tokens = torch.cat([torch.zeros(1, dtype=torch.long), torch.multinomial(q[:-1], 1, generator=gen)[:, 0]])
    target = drafted + torch.randn(rows, vocab, generator=gen)
    return Draft(Tree.chain(rows - 1), tokens, q, torch.ones(rows), "iid"), target


def _timed(spec: VerifierSpec, sampling: Sampling, vocab: int, sizes: tuple[int, ...], repeats: int) -> list[float]:
    """Mean seconds of ``step_verdict`` on a fresh step of each of ``sizes`` rows (``_step``), the sizes taking turns
    within each round (so that a slow spell of the machine falls on all of them). The mean, not the median: the same
    call's time spreads over a factor of 3 here (fresh vocabulary-sized tensors each step), and a batch pays the
    mean."""
    gen = torch.Generator().manual_seed(0)
    rng = TorchRandomness(0)
    state = spec.new_state() if spec.new_state is not None else None
    times: list[list[float]] = [[] for _ in sizes]
    for k in range(repeats + WARM_UP):
        for rows, out in zip(sizes, times):
            draft, logits = _step(rows, vocab, sampling, gen)
            t = time.perf_counter()
            step_verdict(spec, draft, logits, sampling, rng, state)
            if k >= WARM_UP:
                out.append(time.perf_counter() - t)
    return [statistics.fmean(ts) for ts in times]


def cost_key(spec: VerifierSpec, sampling: Sampling) -> tuple:
    """What a verification's cost depends on: the verifier (with its parameter) and the kind of sampling (greedy or
    not, top-k, top-p; not the temperature)."""
    kind = ("greedy",) if sampling.greedy else ("sampled", sampling.top_k, sampling.top_p)
    return (spec.name, spec.param, *kind)


def verify_costs(spec: VerifierSpec, sampling: Sampling, vocab: int, repeats: int = 80,
                 measure: bool = True) -> VerifyCosts | None:
    """``spec``'s ``VerifyCosts`` under ``sampling`` (its kind: greedy or not, top-k, top-p; not its temperature) over
    a vocabulary of ``vocab`` tokens (means of ``repeats``), measured once and cached; None when not cached and
    ``measure`` is False, or for a verifier whose children must be drawn otherwise than independently (it is timed
    on independent chains only; its verification then goes uncharged)."""
    key = cost_key(spec, sampling)
    # torch's threads too (its operators on vocabulary-sized rows use them), as the forward's and drafts' costs carry
    # them in their ids: the tests' workers (one thread each, beside each other) never write a benchmark's entry
    entry = cache.key("verify", REVISION, *key, vocab, platform.machine(), os.cpu_count(), torch.get_num_threads())
    got = cache.read("costs", entry)
    if got and "first" in got:
        return VerifyCosts(got["first"], got["further"])
    if not measure or "iid" not in spec.modes:
        return None
    plain, one, deep = _timed(spec, sampling, vocab, (1, 2, DEEPEST + 1), repeats)
    out = VerifyCosts(max(one - plain, 0.0), max(deep - one, 0.0) / (DEEPEST - 1))
    cache.write("costs", entry, {"first": out.first, "further": out.further, "verifier": spec.name,
                                 "sampling": list(key[2:]), "vocab": vocab})
    return out
