"""Exact output law of one speculative step, computed by enumeration (float64).

Setting: small synthetic target and draft tables ``p(. | prefix)``, ``q(. | prefix)`` (prefix-dependent),
a tree shape and a child-sampling mode. One step drafts a tree with the real drafter code
(``TableDrafter`` feeds the shared tree-growing routine), asks the target for ``p`` at every node and
runs the verifier. ``enumerate_outcomes`` walks every draw and every accept/reject outcome, so the
result is the exact law of the emitted tokens, not an estimate.

Emitted sequences have variable length (accepted tokens + one recovered/bonus token). To compare with
the target, each is completed to a fixed length with the target's own conditionals; a verifier is
exact iff that law equals the target's autoregressive law over sequences of that length.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..drafters.base import Drafter, _Growing
from ..probs import Sampling
from ..rng import enumerate_outcomes
from ..tree import Tree
from ..verifiers.base import VerifierSpec

Table = Callable[[tuple[int, ...]], torch.Tensor]  # prefix -> distribution [V] (float64)


class TableDrafter(Drafter):
    """A drafter whose law after any prefix is read from a table (logits = log q)."""

    name = "table"

    def __init__(self, q: Table):
        self.q = q

    def _root_logits(self, context):
        self._context = tuple(context)
        return self.q(self._context).log()

    def _node_logits(self, g: _Growing, nodes):
        rows = []
        for node in nodes:
            path, n = [], node
            while n > 0:
                path.append(g.tokens[n])
                n = g.parents[n]
            rows.append(self.q(self._context + tuple(reversed(path))).log())
        return torch.stack(rows)


def random_tables(vocab: int, seed: int, concentration: float = 1.0, sparsity: float = 0.0):
    """Prefix-dependent random target and draft tables (memoised), drawn from a Dirichlet.

    ``sparsity`` zeroes each entry with that probability (keeping at least one), so supports differ.
    """
    gen = torch.Generator().manual_seed(seed)
    cache: dict[tuple, torch.Tensor] = {}

    def make(tag: str) -> Table:
        def table(prefix: tuple[int, ...]) -> torch.Tensor:
            key = (tag, prefix)
            if key not in cache:
                d = torch.distributions.Gamma(torch.full((vocab,), concentration, dtype=torch.float64), 1.0)
                torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
                v = d.sample()
                if sparsity > 0:
                    keep = torch.rand(vocab, generator=gen, dtype=torch.float64) >= sparsity
                    keep[int(torch.argmax(v))] = True
                    v = v * keep
                cache[key] = v / v.sum()
            return cache[key]

        return table

    return make("p"), make("q")


def step_law(
    verifier: VerifierSpec, p: Table, q: Table, tree: Tree, children: str = "iid",
    context: tuple[int, ...] = (0,),
) -> dict[tuple[int, ...], float]:
    """Exact law of the tokens one step emits after ``context``: ``{emitted tokens: probability}``."""
    drafter = TableDrafter(q)
    sampling = Sampling(1.0)

    def run(rng):
        draft = drafter.propose(list(context), tree, sampling, children, rng)
        paths = []
        for node in range(draft.tree.size):
            path, n = [], node
            while n > 0:
                path.append(int(draft.tokens[n]))
                n = draft.tree.parents[n]
            paths.append(tuple(reversed(path)))
        probs = torch.stack([p(tuple(context) + path) for path in paths])  # [N, V]
        verdict = verifier(draft, probs, rng)
        return tuple(int(draft.tokens[n]) for n in verdict.path) + (verdict.token,)

    law: dict[tuple[int, ...], float] = {}
    for weight, emitted in enumerate_outcomes(run):
        law[emitted] = law.get(emitted, 0.0) + weight
    return law


def _complete(law: dict[tuple, float], p: Table, context: tuple, length: int, vocab: int) -> torch.Tensor:
    """Extend each emitted sequence to ``length`` tokens with the target's conditionals; dense ``[V]*length``."""
    out = torch.zeros((vocab,) * length, dtype=torch.float64)
    for seq, w in law.items():
        if len(seq) > length:
            raise ValueError(f"emitted {len(seq)} tokens, longer than the comparison length {length}")
        stack = [(seq, w)]
        while stack:
            s, weight = stack.pop()
            if len(s) == length:
                out[s] += weight
                continue
            cond = p(context + s)
            for x in range(vocab):
                if cond[x] > 0:
                    stack.append((s + (x,), weight * float(cond[x])))
    return out


def target_law(p: Table, context: tuple, length: int, vocab: int) -> torch.Tensor:
    """The target's autoregressive law over the next ``length`` tokens, dense ``[V]*length``."""
    return _complete({(): 1.0}, p, context, length, vocab)


def verifier_law(verifier, p, q, tree, vocab, children="iid", context=(0,)) -> torch.Tensor:
    """The verifier's law over the next ``tree.max_depth + 1`` tokens (one step, completed by the target)."""
    law = step_law(verifier, p, q, tree, children, context)
    return _complete(law, p, tuple(context), tree.max_depth + 1, vocab)


def tv_and_kl(target: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    """Total variation and KL(target || other) between two dense laws."""
    tv = 0.5 * float((target - other).abs().sum())
    mask = target > 0
    if bool((other[mask] <= 0).any()):
        return tv, math.inf
    kl = float((target[mask] * (target[mask] / other[mask]).log()).sum())
    return tv, kl


__all__ = ["TableDrafter", "random_tables", "step_law", "target_law", "tv_and_kl", "verifier_law"]
