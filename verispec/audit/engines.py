"""Auditing any engine's speculative sampling against its target's law (``verispec audit-engine``).

A black-box test: draw the first ``k`` tokens many times, each from its own seed, from the engine's speculative
decoding, and compare their law with the exact law of those ``k`` tokens computed from the same engine's target
logits by teacher forcing (``engine_law``); where an engine exposes no logits, with the same engine's plain sampling (a
two-sample test). Each result carries the chi-square test (cells expected fewer than 5 times merged), an estimate of
the total variation with a bootstrap interval, and the test's power: the smallest total variation it detects at this
many samples, found by running the same test on samples of a known perturbation of the law. Negative controls,
samplers wrong on purpose, go through the same harness; a report whose controls pass is invalid.

An engine is an ``EngineAdapter``: ``sample`` (the first k tokens of one seeded run) and ``next_logits`` (the
target's next-token logits after a batch of prefixes, or None). docs/audit-engine.md says how to write one for an
engine verispec does not ship, such as vLLM or SGLang on a GPU.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from ..errors import VerispecError
from ..probs import Sampling, logits_to_probs
from ..tree import Tree
from .sampled import chi_square

ALPHA = 1e-3  # a law differs where the test's p-value is below this
POWER = 0.8  # the smallest detectable TV: the least perturbation the test rejects this often at ALPHA


class EngineAdapter:
    """One engine's sampling, as the audit sees it. Subclass and implement ``sample``; implement ``next_logits`` where
    the engine exposes its target's logits, else ``plain`` (the same engine sampling without speculation)."""

    name = "engine"
    note = ""
    eos: frozenset = frozenset()  # tokens after which the engine stops (an outcome shorter than k ends on one)

    def sample(self, prompt: list[int], k: int, seed: int, sampling: Sampling) -> tuple[list[int], int]:
        """The first ``k`` tokens one run emits after ``prompt`` (fewer if it ended on an end-of-sequence token), from
        ``seed``'s randomness, and how many tokens it drafted (0 when it never speculated: the check then says nothing
        of its speculative sampling)."""
        raise NotImplementedError

    def sample_many(self, prompt: list[int], k: int, seeds: list[int], sampling: Sampling) -> list[tuple[list[int], int]]:
        """``sample`` for each seed; an engine that serves several requests at once overrides it."""
        return [self.sample(prompt, k, s, sampling) for s in seeds]

    def next_logits(self, prompt: list[int], prefixes: list[tuple[int, ...]]) -> torch.Tensor | None:
        """The target's next-token logits ``[len(prefixes), V]`` after ``prompt`` + each prefix (all of one length),
        by teacher forcing; None where the engine exposes no logits."""
        return None

    def plain(self) -> "EngineAdapter | None":
        """The same engine sampling plainly, the reference of the two-sample test where ``next_logits`` is None."""
        return None

    def close(self) -> None:
        """Let go of what the adapter started (a server process it runs); called once the audit is done with it."""


def engine_law(adapter: EngineAdapter, prompt: list[int], k: int, sampling: Sampling, floor: float = 1e-5,
               max_prefixes: int = 4096) -> dict[tuple[int, ...], float] | None:
    """The exact law of the next ``k`` tokens from the adapter's teacher-forced logits, over the prefixes of
    probability at least ``floor`` (the rest of the mass is left out: ``chi_square`` merges it); None where the
    adapter exposes no logits."""
    prefixes: dict[tuple[int, ...], float] = {(): 1.0}
    law: dict[tuple[int, ...], float] = {}
    for depth in range(k):
        paths = sorted(prefixes)
        rows = adapter.next_logits(prompt, paths)
        if rows is None:
            return None
        laws = logits_to_probs(rows.double(), sampling)
        grown: dict[tuple[int, ...], float] = {}
        for row, path in enumerate(paths):
            for x in torch.nonzero(laws[row] * prefixes[path] >= floor).flatten().tolist():
                w = prefixes[path] * float(laws[row, x])
                if depth + 1 == k or x in adapter.eos:
                    law[path + (x,)] = w
                else:
                    grown[path + (x,)] = w
        if len(grown) > max_prefixes:
            raise VerispecError(f"the law's tree would exceed {max_prefixes} prefixes: raise --floor")
        prefixes = grown
        if not prefixes:
            break
    return law


def tv_estimate(counts: Counter, law: dict[tuple[int, ...], float], n: int, min_expected: float = 5.0) -> float:
    """Half the L1 distance between the sample's and the law's frequencies over the cells the test uses (those
    expected ``min_expected`` times or more, and the rest as one)."""
    big = {c for c, w in law.items() if w * n >= min_expected}
    rest = (n - sum(counts.get(c, 0) for c in big)) / n - (1.0 - sum(law[c] for c in big))
    return 0.5 * (sum(abs(counts.get(c, 0) / n - law[c]) for c in big) + abs(rest))


def _cells(law: dict, n: int, min_expected: float = 5.0) -> tuple[list, torch.Tensor]:
    big = sorted((c for c, w in law.items() if w * n >= min_expected), key=lambda c: -law[c])
    probs = [law[c] for c in big]
    return big, torch.tensor(probs + [max(1.0 - sum(probs), 0.0)], dtype=torch.float64)


def _resample(probs: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.bincount(torch.multinomial(probs.float(), n, replacement=True, generator=gen),
                          minlength=len(probs)).double()


def _counts_of(cells: list, counts_vec: torch.Tensor) -> Counter:
    out = Counter({c: int(x) for c, x in zip(cells, counts_vec[:-1].tolist())})
    out[("rest",)] = int(counts_vec[-1])
    return out


def tv_interval(counts: Counter, law: dict, n: int, reps: int = 400, seed: int = 0) -> tuple[float, float, float]:
    """The total variation between the engine's law and ``law`` over the test's cells: ``(estimate, low, high)``.

    The plug-in ``tv_estimate`` is biased upward, since the sample's own noise adds to it (with the very same law it
    is up to about ``0.4 sqrt(cells / n)`` rather than 0). The estimate is corrected by the bootstrap:
    ``2 tv - mean(tv*)``, ``tv*`` the plug-in of the sample's frequencies resampled, clamped at 0. The 95 % interval
    comes from the triangle inequality: with ``e`` the 95 % quantile of a resample's distance from the sample itself
    (the law of the sampling error), the engine's total variation lies within ``tv +- e`` whenever the sample lies
    within ``e`` of the engine's law, which happens 95 % of the time. So an engine with the target's law gets an
    interval from 0 (a percentile interval of the plug-in lies above the plug-in itself and never reaches 0)."""
    cells, _ = _cells(law, n)
    observed = torch.tensor([counts.get(c, 0) for c in cells] + [n - sum(counts.get(c, 0) for c in cells)],
                            dtype=torch.float64)
    freq = observed / n
    gen = torch.Generator().manual_seed(seed)
    probs = torch.tensor([law[c] for c in cells] + [max(1.0 - sum(law[c] for c in cells), 0.0)], dtype=torch.float64)
    tv = tv_estimate(counts, law, n)
    again = torch.stack([_resample(freq, n, gen) / n for _ in range(reps)])
    plugins = 0.5 * (again - probs).abs().sum(1)
    errors = torch.sort(0.5 * (again - freq).abs().sum(1)).values
    e = float(errors[min(int(0.95 * reps), reps - 1)])
    return min(1.0, max(0.0, 2 * tv - float(plugins.mean()))), max(0.0, tv - e), min(1.0, tv + e)


def detectable_tv(law: dict, n: int, sims: int = 40, seed: int = 0) -> float:
    """The smallest total variation the test detects at ``n`` samples, on a known perturbation of the law shaped like
    a temperature fault: the law over the test's cells raised to the power ``1 + d`` and normalised (a sharper law;
    the merged rest counts as one cell). For ``d`` on a grid, the total variation of the least perturbation whose
    samples the chi-square test rejects at ``ALPHA`` in at least ``POWER`` of ``sims`` simulations (nan: none up to
    d = 2)."""
    cells, probs = _cells(law, n)
    gen = torch.Generator().manual_seed(seed)
    law_r = {**{c: law[c] for c in cells}, ("rest",): float(probs[-1])}
    live = probs > 0
    for d in (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0):
        moved = torch.where(live, probs.clamp_min(1e-300) ** (1 + d), torch.zeros_like(probs))
        moved = moved / moved.sum()
        hits = sum(chi_square(_counts_of(cells, _resample(moved, n, gen)), law_r, n)[2] < ALPHA for _ in range(sims))
        if hits >= POWER * sims:
            return 0.5 * float((moved - probs).abs().sum())
    return float("nan")


def two_sample(a: Counter, b: Counter, min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """(statistic, degrees of freedom, p-value, cells) of the chi-square test that two samples share one law, cells
    expected fewer than ``min_expected`` times in either merged into one."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    big = [c for c in keys if (a.get(c, 0) + b.get(c, 0)) * min(na, nb) / (na + nb) >= min_expected]
    rows = [(a.get(c, 0), b.get(c, 0)) for c in big]
    rows.append((na - sum(r[0] for r in rows), nb - sum(r[1] for r in rows)))
    rows = [r for r in rows if r[0] + r[1] > 0]
    stat = 0.0
    for oa, ob in rows:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    dof = max(len(rows) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, dof, p, len(rows)


@dataclass
class EngineCheck:
    engine: str
    prompt: int  # index among the prompts audited
    temperature: float
    top_k: int
    top_p: float
    samples: int
    test: str  # "exact law" (teacher-forced logits) or "two-sample" (against the engine's plain sampling)
    cells: int
    statistic: float
    dof: int
    p_value: float
    tv: float
    tv_low: float
    tv_high: float
    detectable_tv: float
    drafted: float  # tokens drafted per sample
    seconds: float
    control: bool = False  # a negative control: it must be flagged
    note: str = ""
    top: list = field(default_factory=list)  # the likeliest cells: (tokens, law, sampled frequency)
    # ``tv`` bias-corrected with the triangle inequality's interval (``tv_interval``); rows made before this was so
    # carry the plug-in estimate and a percentile interval of it, biased upward
    tv_corrected: bool = False
    counts: list = field(default_factory=list)  # every sampled outcome: (tokens, times), to recompute what is derived

    @property
    def differs(self) -> bool:
        return self.p_value < ALPHA

    @property
    def verdict(self) -> str:
        if self.control:
            return "flagged (control)" if self.differs else "NOT FLAGGED: the harness missed a wrong sampler"
        if self.differs:
            return "DIFFERS from the target's law"
        return "same law" + ("" if self.drafted > 0 else " (it never drafted)")

    def as_dict(self) -> dict:
        return {**asdict(self), "differs": self.differs, "verdict": self.verdict}


def check_engine(adapter: EngineAdapter, prompt: list[int], k: int, samples: int, sampling: Sampling,
                 prompt_index: int = 0, floor: float = 1e-5, control: bool = False,
                 progress: Callable[[int], None] | None = None, chunk: int = 64) -> EngineCheck:
    """``samples`` seeded runs of ``adapter`` (seeds 0, 1, ...) against its target's exact law, or against as many
    runs of its plain sampling where it exposes no logits."""
    t0 = time.perf_counter()
    counts: Counter = Counter()
    drafted = 0
    for start in range(0, samples, chunk):
        seeds = list(range(start, min(start + chunk, samples)))
        for tokens, d in adapter.sample_many(prompt, k, seeds, sampling):
            counts[tuple(tokens[:k])] += 1
            drafted += d
        if progress is not None:
            progress(len(seeds))
    law = engine_law(adapter, prompt, k, sampling, floor)
    if law is not None:
        stat, dof, p, cells = chi_square(counts, law, samples)
        tv, low, high = tv_interval(counts, law, samples)
        power = detectable_tv(law, samples)
        test = "exact law"
        top = [(list(c), round(w, 4), round(counts.get(c, 0) / samples, 4))
               for c, w in sorted(law.items(), key=lambda cw: -cw[1])[:3]]
    else:
        reference = adapter.plain()
        if reference is None:
            raise VerispecError(f"engine {adapter.name!r} exposes neither its logits nor a plain sampler to compare with")
        other: Counter = Counter(tuple(t[:k]) for t, _ in reference.sample_many(
            prompt, k, list(range(10**6, 10**6 + samples)), sampling))
        stat, dof, p, cells = two_sample(counts, other)
        # the plain sample's frequencies stand in for the target's law: the TV and its interval leave the reference's
        # own noise out, and two samples of N detect about what one sample of N / 2 does against a known law
        law_b = {c: v / samples for c, v in other.items()}
        tv, low, high = tv_interval(counts, law_b, samples)
        power = detectable_tv(law_b, samples // 2)
        test = "two-sample"
        top = []
    return EngineCheck(adapter.name, prompt_index, sampling.temperature, sampling.top_k, sampling.top_p, samples,
                       test, cells, stat, dof, p, tv, low, high, power, drafted / samples,
                       time.perf_counter() - t0, control, adapter.note, top, True,
                       sorted(([list(c), v] for c, v in counts.items()), key=lambda cv: -cv[1]))


def format_checks(rows: list[EngineCheck]) -> str:
    from ..bench.report import markdown  # noqa: PLC0415

    body = [[r.engine, str(r.prompt), f"{r.temperature:g}", str(r.top_k or "-"), f"{r.top_p:g}" if r.top_p < 1 else "-",
             f"{r.samples:,}", r.test, f"{r.cells}", f"{r.statistic:.1f} ({r.dof})", _p(r.p_value),
             f"{r.tv:.3f} [{r.tv_low:.3f}, {r.tv_high:.3f}]" + ("" if r.tv_corrected else " *"),
             "-" if math.isnan(r.detectable_tv) else
             f"{r.detectable_tv:.3f}", f"{r.drafted:.2f}", r.verdict, f"{r.seconds:.0f} s"] for r in rows]
    return markdown(["engine", "prompt", "T", "top-k", "top-p", "N", "test", "cells", "chi-square (dof)", "p-value",
                     "TV [95 %]", "smallest detectable TV", "drafted a sample", "verdict", "time"], body)


def _p(p: float) -> str:
    return f"{p:.3f}" if p >= 1e-3 else f"{p:.0e}"
