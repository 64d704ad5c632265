"""Monte Carlo check of a verifier at one node on real distributions (full vocabulary).

Enumeration is exact but only for tiny vocabularies. Here the k children of a node are drawn
``n_draws`` times (vectorised), and for each distinct candidate tuple the *real* node rule is run on
every accept/reject outcome of its own coins (``enumerate_outcomes``), giving the exact law of the
emitted token given that tuple. Averaging those laws over the draws (a Rao-Blackwellised estimate)
leaves only the noise of the tuple sampling, which the per-token standard errors measure. The
estimate's total variation from ``p`` is compared with a noise bound of ``z`` standard errors per token.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..drafters.base import Draft
from ..rng import enumerate_outcomes
from ..tree import Tree
from ..verifiers.base import VerifierSpec
from .optimum import alpha_star_iid
from .real import real_pairs


@dataclass(frozen=True)
class MonteCarloResult:
    verifier: str
    draws: int
    distinct_tuples: int
    tv: float  # total variation between the estimated law of the emitted token and p
    noise_bound: float  # what sampling noise alone can explain (z standard errors per token, halved)
    acceptance: float  # estimated probability that a child is accepted

    @property
    def biased(self) -> bool:
        return self.tv > self.noise_bound


def tuple_law(rule, p: torch.Tensor, q: torch.Tensor, xs: tuple[int, ...], children: str = "iid"):
    """Exact law ``[V]`` of the token a node emits given its children ``xs``, and its acceptance probability."""
    tree = Tree(tuple([-1] + [0] * len(xs)))
    qq = torch.zeros(tree.size, q.numel(), dtype=q.dtype)
    qq[0] = q
    draft = Draft(tree, torch.tensor([0, *xs]), qq, torch.ones(tree.size, dtype=torch.float64), children)
    law = torch.zeros_like(p)
    acc = 0.0
    for w, (rank, rec, _) in enumerate_outcomes(lambda rng: rule(draft, 0, p, rng)):
        if rank is None:
            law += w * rec
        else:
            law[xs[rank]] += w
            acc += w
    return law, acc


def monte_carlo_node(spec: VerifierSpec, p: torch.Tensor, q: torch.Tensor, k: int, n_draws: int = 1_000_000,
                     seed: int = 0, z: float = 4.0) -> MonteCarloResult:
    """Estimate the law of the token a node with k i.i.d. children emits under ``spec``; compare with ``p``."""
    if spec.node_rule is None or spec.default_children != "iid":
        raise ValueError(f"{spec.name}: the Monte Carlo check covers node rules over i.i.d. children")
    p, q = p.double(), q.double()
    gen = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(q.float(), n_draws * k, replacement=True, generator=gen).view(n_draws, k)
    uniq, counts = torch.unique(draws, dim=0, return_counts=True)
    first = torch.zeros_like(p)
    second = torch.zeros_like(p)
    acc = 0.0
    for xs, c in zip(uniq.tolist(), counts.tolist()):
        law, a = tuple_law(spec.node_rule, p, q, tuple(xs))
        first += c * law
        second += c * law * law
        acc += c * a
    mean = first / n_draws
    var = (second / n_draws - mean * mean).clamp_min(0)
    se = (var / n_draws).sqrt()
    tv = 0.5 * float((mean - p).abs().sum())
    return MonteCarloResult(spec.name, n_draws, int(uniq.shape[0]), tv, 0.5 * z * float(se.sum()), acc / n_draws)


def monte_carlo_report(target, drafter, specs: list[VerifierSpec], pairs: int, k: int, draws: int,
                       temperature: float, seed: int = 0, progress=None) -> list[dict]:
    """``monte_carlo_node`` for each verifier on ``pairs`` real (p, q) pairs of ``target`` and ``drafter`` (a model
    draft); one row per (pair, verifier) with the i.i.d. optimum beside it. ``progress()`` is called per row."""

    rows = []
    for i, (p, q) in enumerate(real_pairs(target, drafter, 1, pairs, temperature, seed)[:pairs]):
        star = alpha_star_iid(p, q, k)
        for spec in specs:
            r = monte_carlo_node(spec, p, q, k, n_draws=draws, seed=seed + i)
            rows.append({"pair": i, "alpha_star": star, "claims_exact": spec.exact, **asdict(r), "biased": r.biased})
            if progress is not None:
                progress()
    return rows


def format_monte_carlo(rows: list[dict]) -> str:
    lines = ["| pair | verifier | claims exact | distinct tuples | TV from p | noise bound | verdict | acceptance | "
             "alpha*_iid |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "biased" if r["biased"] else "consistent with p"
        if r["claims_exact"] and r["biased"]:
            verdict += " (FAIL)"
        lines.append(f"| {r['pair']} | {r['verifier']} | {'yes' if r['claims_exact'] else 'no'} | "
                     f"{r['distinct_tuples']} | {r['tv']:.4f} | {r['noise_bound']:.4f} | {verdict} | "
                     f"{r['acceptance']:.4f} | {r['alpha_star']:.4f} |")
    return "\n".join(lines)
