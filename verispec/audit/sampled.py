"""A real model's decoding loop checked by sampling: the first k tokens it emits, drawn many times with different
seeds, against the target's exact law of those k tokens (teacher forcing), by a chi-square test.

The enumeration of ``audit.law`` proves a rule exact on small tables; this checks the whole loop on a real target
and draft, where the draft's law depends on real text (prompt lookup, a cache of answers, recycled successors).

The exact law: one forward of a tree over the prompt whose nodes are every prefix of at most k - 1 tokens with
probability at least ``floor`` (a prefix ending on an end-of-sequence token ends there), which gives each prefix's
next-token law; the cells are the k-token outcomes. Cells whose expected count is under ``min_expected`` are merged
into one, so the test's chi-square approximation holds. The TV estimate is half the L1 distance between the sample's
and the law's cell frequencies; at n samples it is biased upward by about ``sqrt(cells / n)``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from ..probs import Sampling, logits_to_probs
from ..tree import Tree


@dataclass(frozen=True)
class SampledCheck:
    samples: int
    cells: int  # after merging
    statistic: float
    dof: int
    p_value: float
    tv: float  # estimated total variation between the sampled and the exact law over the merged cells
    drafted: float  # drafted tokens per sample (0: the loop never drafted, and the check says nothing of the draft)

    @property
    def passed(self) -> bool:
        return self.p_value >= 1e-3


def tree_logits(target, prompt: list[int], prefixes: list[tuple[int, ...]]) -> torch.Tensor:
    """The target's next-token logits after ``prompt`` + each prefix: one forward of the tree of every prefix and its
    ancestors over the prompt (the decoding loop's own forward)."""
    nodes = sorted({p[:i] for p in prefixes for i in range(len(p) + 1)}, key=lambda p: (len(p), p))  # parents first
    index = {p: i for i, p in enumerate(nodes)}
    tree = Tree(tuple([-1] + [index[p[:-1]] for p in nodes[1:]]))
    state = target.new_state()
    target.prefill(state, prompt[:-1])
    out = target.forward(state, torch.tensor([prompt[-1]] + [p[-1] for p in nodes[1:]]),
                         state.committed + torch.tensor(tree.depths), tree.ancestors_mask())
    return out.logits[[index[p] for p in prefixes]]


def exact_law(target, prompt_ids: list[int], k: int, sampling: Sampling, floor: float = 1e-5,
              max_nodes: int = 4096) -> dict[tuple[int, ...], float]:
    """The target's law of its next ``k`` tokens after ``prompt_ids`` (outcomes shorter than k end on an
    end-of-sequence token), over the prefixes of probability at least ``floor``; the mass of the others is left out
    (``chi_square`` merges it into one cell). One forward of the tree of those prefixes per depth."""
    eos = target.eos_token_ids
    prefixes: dict[tuple[int, ...], float] = {(): 1.0}  # continuing prefixes and their probabilities
    law: dict[tuple[int, ...], float] = {}
    for depth in range(k):
        paths = sorted(p for p in prefixes if len(p) == depth)
        laws = logits_to_probs(tree_logits(target, prompt_ids, paths).double(), sampling)
        grown = 0
        for row, path in enumerate(paths):
            for x in torch.nonzero(laws[row] * prefixes[path] >= floor).flatten().tolist():
                w = prefixes[path] * float(laws[row, x])
                if depth + 1 == k or x in eos:
                    law[path + (x,)] = w
                else:
                    prefixes[path + (x,)] = w
                    grown += 1
        if not grown:
            break
        if len(prefixes) > max_nodes:
            raise ValueError(f"the law's tree would exceed {max_nodes} nodes: raise floor")
    return law


def chi_square(counts: Counter, law: dict[tuple[int, ...], float], n: int,
               min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """(statistic, degrees of freedom, p-value, cells) of the sampled ``counts`` against ``law``: cells expected
    fewer than ``min_expected`` times (and every outcome outside ``law``) merged into one."""
    big = {c: w for c, w in law.items() if w * n >= min_expected}
    rest_e = n * (1.0 - sum(big.values()))
    rest_o = n - sum(counts.get(c, 0) for c in big)
    cells = [(counts.get(c, 0), w * n) for c, w in big.items()]
    if rest_e >= min_expected or rest_o:
        cells.append((rest_o, max(rest_e, 1e-12)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = max(len(cells) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p, len(cells)


def check_loop(target, prompt_ids: list[int], k: int, samples: int, sample: Callable[[int], tuple[list[int], int]],
               law_sampling: Sampling, floor: float = 1e-5) -> SampledCheck:
    """``sample(seed) -> (the first k tokens the loop emitted, tokens it drafted)``, ``samples`` seeds, against the
    target's exact law under ``law_sampling``."""
    law = exact_law(target, prompt_ids, k, law_sampling, floor)
    counts: Counter = Counter()
    drafted = 0
    for seed in range(samples):
        tokens, d = sample(seed)
        counts[tuple(tokens[:k])] += 1
        drafted += d
    stat, dof, p, cells = chi_square(counts, law, samples)
    big = {c for c, w in law.items() if w * samples >= 5.0}
    tv = 0.5 * (sum(abs(counts.get(c, 0) / samples - law[c]) for c in big)
                + abs((samples - sum(counts.get(c, 0) for c in big)) / samples - (1 - sum(law[c] for c in big))))
    return SampledCheck(samples, cells, stat, dof, p, tv, drafted / samples)
