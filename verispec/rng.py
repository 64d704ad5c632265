"""Randomness is passed in, never created inside a verifier or drafter.

Every random decision in verispec goes through one of two calls:

* ``bernoulli(probs)`` -> bool tensor, one independent coin per element;
* ``categorical(probs)`` -> int tensor, one independent draw per row of ``probs [..., V]``.

``TorchRandomness`` serves them from a seeded ``torch.Generator`` (same seed, same output).
``ScriptedRandomness`` answers them from a script of outcome indices and records the probability of
every outcome it returned; ``enumerate_outcomes`` uses it to walk every branch of a randomised
function and return the exact law of its results (the audit's engine).
"""

from __future__ import annotations

from typing import Callable, Protocol, TypeVar

import torch

from .probs import point_mass_index

T = TypeVar("T")


class Randomness(Protocol):
    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor: ...

    def categorical(self, probs: torch.Tensor) -> torch.Tensor: ...


class TorchRandomness:
    """Seeded randomness on the CPU. Draws use inverse-CDF sampling, so a zero-probability token
    can never be drawn and results are reproducible across runs and platforms with the same torch."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(int(seed))

    def uniform(self, shape) -> torch.Tensor:
        return torch.rand(shape, generator=self.generator, dtype=torch.float64)

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        return self.uniform(probs.shape) < probs.double().cpu()

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        u = self.uniform(probs.shape[:-1] + (1,))  # drawn even when unused: later draws stay the same
        probs = probs.cpu()
        index = point_mass_index(probs)
        if index is not None:
            return index
        probs = probs.double()
        cdf = torch.cumsum(probs, dim=-1)
        idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
        return idx.clamp_max(probs.shape[-1] - 1)


class ScriptedRandomness:
    """Answers random calls from ``script`` (one outcome index per scalar decision, taken in order),
    and records ``(chosen index, number of outcomes)`` for each decision and the path's probability.

    Outcomes of zero probability are never offered, so an enumeration visits possible branches only.
    Past the end of the script the first possible outcome is taken.
    """

    def __init__(self, script: list[int]):
        self.script = script
        self.decisions: list[tuple[int, int]] = []
        self.weight = 1.0

    def _choose(self, probs: list[float]) -> int:
        options = [i for i, w in enumerate(probs) if w > 0]
        if not options:
            raise ValueError("a random call was made with no possible outcome")
        k = len(self.decisions)
        pick = self.script[k] if k < len(self.script) else 0
        self.decisions.append((pick, len(options)))
        self.weight *= probs[options[pick]]
        return options[pick]

    def bernoulli(self, probs: torch.Tensor) -> torch.Tensor:
        flat = [float(x) for x in probs.reshape(-1).tolist()]
        out = [self._choose([1.0 - x, x]) == 1 for x in flat]
        return torch.tensor(out, dtype=torch.bool).reshape(probs.shape)

    def categorical(self, probs: torch.Tensor) -> torch.Tensor:
        rows = probs.double().reshape(-1, probs.shape[-1]).tolist()
        out = [self._choose(row) for row in rows]
        return torch.tensor(out, dtype=torch.long).reshape(probs.shape[:-1])


def enumerate_outcomes(fn: Callable[[Randomness], T]) -> list[tuple[float, T]]:
    """Run ``fn`` on every possible sequence of random outcomes; return ``[(probability, result)]``.

    The probabilities of the returned branches sum to one (up to rounding). Depth-first, like an
    odometer over the recorded decisions, so ``fn`` must make its random calls deterministically
    given earlier outcomes (true of any function that takes its randomness as an argument).
    """
    results = []
    script: list[int] = []
    while True:
        rng = ScriptedRandomness(script)
        value = fn(rng)
        results.append((rng.weight, value))
        decisions = rng.decisions
        i = len(decisions) - 1
        while i >= 0 and decisions[i][0] + 1 >= decisions[i][1]:
            i -= 1
        if i < 0:
            return results
        script = [d[0] for d in decisions[:i]] + [decisions[i][0] + 1]
