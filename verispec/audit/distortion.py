"""Distortion of the lossy rules: the exact law each emits at a position, against the target's.

For a chain rule given per position (``VerifierSpec.position_rule``), the token emitted at a position
after drafting ``x ~ q`` has the exact law ``q(y) a(y) + (1 - sum_x q(x) a(x)) fallback(y)``
(``position_law``). On real ``(p, q)`` pairs this gives, with no sampling noise:

* total variation and KL(p || law) from the target's law ``p``;
* the overshoot ``sum_y (q(y) a(y) - p(y))_+``: mass emitted by *accepting* draft tokens beyond what
  the target gives them (0 for exact speculative sampling, whose accepted mass is ``min(p, q)``);
* the acceptance ``sum_x q(x) a(x)`` against the exact rule's ``sum min(p, q)``.

``monte_carlo_position`` checks the analytic law against the verifier itself, run on one-token drafts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ..datasets import spec_bench_prompts
from ..decode import generate
from ..drafters import NoDrafter
from ..drafters.base import Draft
from ..probs import Sampling, logits_to_probs
from ..rng import TorchRandomness
from ..tree import Tree
from ..verifiers import get_verifier
from ..verifiers.base import VerifierSpec
from ..verifiers.chain import exact_rule, position_law
from ..verifiers.lossy import COLLABORATIVE, EDGE, TRUNCATION, js_distance
from .real import real_pairs


@dataclass(frozen=True)
class DistortionRow:
    verifier: str
    temperature: float
    pairs: int
    mean_tv: float
    max_tv: float
    mean_kl: float
    mean_overshoot: float
    acceptance: float  # mean sum_x q(x) a(x)
    exact_acceptance: float  # mean sum_x min(p, q)

    def as_dict(self) -> dict:
        return asdict(self)


def kl(p: torch.Tensor, law: torch.Tensor) -> torch.Tensor:
    """KL(p || law) along the last axis (inf where ``law`` misses mass of ``p``)."""
    p, law = p.double(), law.double()
    terms = torch.where(p > 0, p * (p.clamp_min(1e-300) / law.clamp_min(1e-300)).log(), torch.zeros_like(p))
    missing = ((p > 0) & (law <= 0)).any(-1)
    return torch.where(missing, torch.full_like(terms[..., 0], math.inf), terms.sum(-1))


def position_stats(spec: VerifierSpec, p: torch.Tensor, q: torch.Tensor, state=None) -> dict[str, torch.Tensor]:
    """Per-pair TV, KL, overshoot and acceptance of ``spec`` on pairs ``p, q [n, V]``."""
    p, q = p.double(), q.double()
    accept, _ = spec.position_rule(p, q, state)
    law = position_law(spec.position_rule, p, q, state)
    kept = q * accept
    return {
        "tv": 0.5 * (law - p).abs().sum(-1),
        "kl": kl(p, law),
        "overshoot": (kept - p).clamp_min(0).sum(-1),
        "acceptance": kept.sum(-1),
        "exact_acceptance": torch.minimum(p, q).sum(-1),
    }


def warm_state(spec: VerifierSpec, pairs: list[tuple[torch.Tensor, torch.Tensor]], seed: int = 0):
    """A learning verifier's state after seeing ``pairs`` in order, as in decoding: at each pair a token
    ``x ~ q`` is drafted and the lossless coin labels its JS distance. ``None`` for other verifiers."""
    if spec.new_state is None:
        return None
    state = spec.new_state()
    rng = TorchRandomness(seed)

    for p, q in pairs:
        x = int(rng.categorical(q))
        a0, _ = exact_rule(p, q)
        d = float(js_distance(p, q))
        if EDGE < d < 1 - EDGE:
            state.update([(d, bool(rng.bernoulli(a0[x])))])
    return state


def distortion(specs: list[VerifierSpec], pairs, temperature: float, seed: int = 0) -> list[DistortionRow]:
    """One row per verifier over ``pairs`` (learning verifiers are first warmed on the same pairs)."""
    p = torch.stack([a for a, _ in pairs]).double()
    q = torch.stack([b for _, b in pairs]).double()
    rows = []
    for spec in specs:
        s = position_stats(spec, p, q, warm_state(spec, pairs, seed))
        finite = s["kl"][torch.isfinite(s["kl"])]
        mean_kl = math.inf if finite.numel() < s["kl"].numel() else float(finite.mean())
        rows.append(DistortionRow(
            verifier=spec.name, temperature=temperature, pairs=len(pairs), mean_tv=float(s["tv"].mean()),
            max_tv=float(s["tv"].max()), mean_kl=mean_kl, mean_overshoot=float(s["overshoot"].mean()),
            acceptance=float(s["acceptance"].mean()), exact_acceptance=float(s["exact_acceptance"].mean()),
        ))
    return rows


def family(verifier: str) -> str:
    """``exact``, ``truncation`` (judges from one law or a divergence, falls back to the target) or
    ``collaborative`` (verifies against a law made from both models)."""
    base = verifier.partition(":")[0]
    return "collaborative" if base in COLLABORATIVE else "truncation" if base in TRUNCATION else "exact"


def format_distortion(rows: list[DistortionRow]) -> str:
    """Rows grouped by family (exact first, then truncation, then collaborative rules), per temperature."""
    order = {"exact": 0, "truncation": 1, "collaborative": 2}
    rows = sorted(rows, key=lambda r: (r.temperature, order[family(r.verifier)]))
    lines = ["| T | family | rule | pairs | mean TV | max TV | mean KL(p‖law) | mean overshoot | acceptance | "
             "exact acceptance |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.temperature:g} | {family(r.verifier)} | {r.verifier} | {r.pairs} | {r.mean_tv:.4f} | "
                     f"{r.max_tv:.4f} | {r.mean_kl:.4f} | {r.mean_overshoot:.4f} | {r.acceptance:.4f} | "
                     f"{r.exact_acceptance:.4f} |")
    return "\n".join(lines)


def monte_carlo_position(spec: VerifierSpec, p: torch.Tensor, q: torch.Tensor, draws: int, seed: int = 0, state=None):
    """Empirical law of the first token the verifier emits after a one-token draft ``x ~ q``, over
    ``draws`` runs of the real verifier (the state, if any, is held fixed)."""
    rng = TorchRandomness(seed)
    tree = Tree.chain(1)
    counts = torch.zeros(p.numel(), dtype=torch.float64)
    qq = torch.stack([q, torch.zeros_like(q)])
    pp = torch.stack([p, p])  # the bonus law does not matter: only the first emitted token is counted
    for _ in range(draws):
        x = int(rng.categorical(q))
        draft = Draft(tree, torch.tensor([0, x]), qq, torch.tensor([1.0, float(q[x])], dtype=torch.float64), "iid")
        verdict = spec(draft, pp, rng, state)
        counts[x if verdict.path else verdict.token] += 1
    return counts / draws


def target_nll(target, prompt_ids: list[int], out_ids: list[int], temperature: float) -> float:
    """Mean negative log-likelihood per token of ``out_ids`` after ``prompt_ids`` under the target's
    sampling law at ``temperature`` (> 0), from one forward over the whole sequence."""
    if temperature <= 0 or not out_ids:
        return float("nan")
    seq = torch.tensor([prompt_ids + out_ids])
    with torch.no_grad():
        logits = target.hf(input_ids=seq, use_cache=False).logits[0, len(prompt_ids) - 1:-1]
    p = logits_to_probs(logits.double(), Sampling(temperature))
    return float(-p.gather(1, torch.tensor(out_ids)[:, None]).clamp_min(1e-300).log().mean())


def sequence_nll(target, drafter, spec: VerifierSpec | None, prompts: list[str], temperature: float,
                 max_new_tokens: int = 64, depth: int = 5, seed: int = 0) -> float:
    """Mean NLL per generated token under the target, for text generated by ``spec`` (chain of ``depth``
    with ``drafter``; a learning verifier keeps learning across the prompts) or, with ``spec=None``, by
    the target itself. Exact rules give the target's own value up to sampling noise."""
    state = spec.new_state() if spec is not None and spec.new_state is not None else None
    total, count = 0.0, 0
    for i, prompt in enumerate(prompts):
        if spec is None:
            out = generate(target, NoDrafter(), get_verifier("chain"), prompt, tree=Tree.root_only(),
                           max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        else:
            out = generate(target, drafter, spec, prompt, tree=Tree.chain(depth), policy="fixed",
                           max_new_tokens=max_new_tokens,
                           temperature=temperature, seed=seed + i, verifier_state=state)
        n = len(out.token_ids)
        total += target_nll(target, out.prompt_ids, out.token_ids, temperature) * n
        count += n
    return total / max(count, 1)


def distortion_report(target, drafter, specs: list[VerifierSpec], temperatures: list[float], prompts: int,
                      positions: int, sequence_prompts: int, sequence_tokens: int, seed: int = 0,
                      progress=None) -> tuple[list[DistortionRow], list[dict]]:
    """Per-position distortion rows of ``specs`` on real (p, q) pairs at each temperature, then the sequence-level
    NLL rows (the target's own samples first). ``progress(label)`` is called after each unit of work."""
    rows = []
    for t in temperatures:
        rows += distortion(specs, real_pairs(target, drafter, prompts, positions, t, seed), t, seed)
        if progress is not None:
            progress(f"pairs at T={t:g}")
    nll_rows = []
    if sequence_prompts > 0:
        texts = [p for _, p in spec_bench_prompts(sequence_prompts)]
        for t in (t for t in temperatures if t > 0):
            own = sequence_nll(target, drafter, None, texts, t, sequence_tokens, seed=seed)
            nll_rows.append({"temperature": t, "rule": "target samples", "nll": own, "delta": 0.0})
            for spec in specs:
                v = sequence_nll(target, drafter, spec, texts, t, sequence_tokens, seed=seed)
                nll_rows.append({"temperature": t, "rule": spec.name, "nll": v, "delta": v - own})
                if progress is not None:
                    progress(f"NLL of {spec.name} at T={t:g}")
    return rows, nll_rows


def format_nll(rows: list[dict]) -> str:
    lines = ["| T | text from | NLL/token | minus target's own |", "|---|---|---|---|"]
    lines += [f"| {r['temperature']:g} | {r['rule']} | {r['nll']:.3f} | {r['delta']:+.3f} |" for r in rows]
    return "\n".join(lines)
