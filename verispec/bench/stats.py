"""95 % intervals for the figures the report compares, over prompts (the unit that varies).

* ``mean_interval(values)``: mean and a Student-t interval of per-prompt values;
* ``bootstrap(groups, statistic)``: an interval for any statistic of per-prompt groups by resampling prompts with
  replacement (percentile bootstrap, seeded: the same records give the same interval). Ratios of sums (tokens/s of
  one method over another on the same prompts) use it, paired: each resampled prompt brings both methods' cells;
* ``ratio_of_loops(rounds)``: two closed loops' throughput ratio over rounds run in turn, resampling rounds (the
  machine's spells) and prompts.

With one prompt there is no interval (NaN bounds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import numpy as np

NAN = float("nan")

# two-sided 95 % Student-t quantiles by degrees of freedom (then the normal's 1.96)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
        25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (tabulated; between table entries the
    smaller df, so the interval errs wide)."""
    if df < 1:
        return NAN
    if df > 120:
        return 1.96
    return _T95[max(d for d in _T95 if d <= df)]


def mean_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` with a 95 % t interval (NaN bounds for fewer than 2 values)."""
    xs = [float(x) for x in values if x == x]
    if not xs:
        return NAN, NAN, NAN
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, NAN, NAN
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    half = t95(len(xs) - 1) * sd / math.sqrt(len(xs))
    return m, m - half, m + half


def bootstrap(groups: Sequence, statistic: Callable[[Sequence], float], n: int = 2000,
              seed: int = 0) -> tuple[float, float, float]:
    """(statistic, low, high): a 95 % percentile-bootstrap interval resampling ``groups`` (one per prompt)."""
    groups = list(groups)
    est = statistic(groups)
    if len(groups) < 2:
        return est, NAN, NAN
    rnd = random.Random(seed)
    draws = []
    for _ in range(n):
        v = statistic([groups[rnd.randrange(len(groups))] for _ in groups])
        if v == v and not math.isinf(v):
            draws.append(v)
    if len(draws) < n // 2:
        return est, NAN, NAN
    draws.sort()
    return est, draws[int(0.025 * (len(draws) - 1))], draws[int(math.ceil(0.975 * (len(draws) - 1)))]


def fmt(est: float, low: float, high: float, spec: str = ".2f", suffix: str = "") -> str:
    """``est [low, high]`` (just ``est`` without an interval, ``-`` without an estimate)."""
    if est != est:
        return "-"
    if low != low:
        return format(est, spec) + suffix
    return f"{format(est, spec)}{suffix} [{format(low, spec)}, {format(high, spec)}]"


def _draws(n_groups: int, n: int, seed: int):
    return np.random.default_rng(seed).integers(0, n_groups, size=(n, n_groups))


def ratio_of_sums(num: Sequence[float], den: Sequence[float], n: int = 2000,
                  seed: int = 0) -> tuple[float, float, float]:
    """``sum(num) / sum(den)`` over per-prompt pairs, with a 95 % percentile bootstrap over prompts (vectorised
    ``bootstrap`` for this statistic)."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    est = a.sum() / b.sum() if b.sum() else NAN
    if len(a) < 2 or est != est:
        return float(est), NAN, NAN
    idx = _draws(len(a), n, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        stats = a[idx].sum(1) / b[idx].sum(1)
    stats = stats[np.isfinite(stats)]
    if len(stats) < n // 2:
        return float(est), NAN, NAN
    return float(est), float(np.quantile(stats, 0.025, method="lower")), float(np.quantile(stats, 0.975, method="higher"))


def ratio_of_rates(a_num: Sequence[float], a_den: Sequence[float], b_num: Sequence[float], b_den: Sequence[float],
                   n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``(sum a_num / sum a_den) / (sum b_num / sum b_den)`` over paired prompts (tokens/s of one method over
    another's), with a 95 % paired percentile bootstrap over prompts."""
    an, ad, bn, bd = (np.asarray(x, dtype=float) for x in (a_num, a_den, b_num, b_den))
    est = (an.sum() / ad.sum()) / (bn.sum() / bd.sum()) if ad.sum() and bd.sum() and bn.sum() else NAN
    if len(an) < 2 or est != est:
        return float(est), NAN, NAN
    idx = _draws(len(an), n, seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        stats = (an[idx].sum(1) / ad[idx].sum(1)) / (bn[idx].sum(1) / bd[idx].sum(1))
    stats = stats[np.isfinite(stats)]
    if len(stats) < n // 2:
        return float(est), NAN, NAN
    return float(est), float(np.quantile(stats, 0.025, method="lower")), float(np.quantile(stats, 0.975, method="higher"))


def ratio_of_loops(rounds: Sequence[tuple[float, float, Sequence[float], Sequence[float], Sequence[float],
                                          Sequence[float]]], n: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The throughput ratio of two methods' closed loops run side by side in several rounds. ``rounds`` holds, per
    round, (A's measured throughput, B's, then per prompt, in the same prompt order in every round: A's tokens, A's
    time in system, B's tokens, B's time in system).

    The estimate is the geometric mean of the rounds' measured ratios. The 95 % percentile bootstrap draws rounds
    (what the machine's spells move) and prompts (the same prompts drawn in every round); a drawn round's ratio is its
    measured ratio times how much the drawn prompts move its Little's-law ratio of sums (``ratio_of_rates``). With
    one round this is ``ratio_of_rates``'s interval scaled to the measured ratio."""
    if not rounds:
        return NAN, NAN, NAN
    measured = np.asarray([a / b if b > 0 else NAN for a, b, *_ in rounds], dtype=float)
    if not np.all(measured > 0):
        return NAN, NAN, NAN
    est = float(np.exp(np.log(measured).mean()))
    an, ad, bn, bd = (np.asarray([r[i] for r in rounds], dtype=float) for i in range(2, 6))  # (rounds, prompts)
    n_prompts = an.shape[1]
    if n_prompts < 2:
        return est, NAN, NAN
    idx = _draws(n_prompts, n, seed)  # (n, prompts)
    picks = np.random.default_rng(seed + 1).integers(0, len(rounds), size=(n, len(rounds)))
    with np.errstate(divide="ignore", invalid="ignore"):
        full = (an.sum(1) / ad.sum(1)) / (bn.sum(1) / bd.sum(1))  # (rounds,)
        drawn = (an[:, idx].sum(2) / ad[:, idx].sum(2)) / (bn[:, idx].sum(2) / bd[:, idx].sum(2))  # (rounds, n)
        logs = np.log(measured)[:, None] + np.log(drawn / full[:, None])
    stats = np.exp(logs[picks, np.arange(n)[:, None]].mean(1))
    stats = stats[np.isfinite(stats)]
    if len(stats) < n // 2:
        return est, NAN, NAN
    return est, float(np.quantile(stats, 0.025, method="lower")), float(np.quantile(stats, 0.975, method="higher"))
