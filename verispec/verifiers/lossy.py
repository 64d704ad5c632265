"""The lossy family: chain rules that accept more than chain speculative sampling and give up exactness.

Each rule is given per position (``PositionRule``): the probability of accepting each token if it is
the drafted one, and the law drawn from after a rejection. ``position_law`` turns that into the exact
law the rule emits at a position, which is what the distortion diagnostic (``verispec audit
--distortion``) reports; the verifiers below run the same rule through ``walk_chain``.

* ``adasd`` -- AdaSD's Bayesian acceptance from the Jensen-Shannon distance (online KDEs);
* ``fsd`` -- Fuzzy speculative decoding: accept iff ``JS(p, q) < T`` (default 0.3; ``fsd:T``), else draw from ``p``;
* ``typical`` -- Medusa's typical acceptance: accept ``x`` iff ``p(x) > min(eps, alpha exp(-H(p)))``
  (eps 0.09, alpha 0.3), else draw from ``p``;
* ``bild`` -- BiLD's rollback: reject ``x`` iff ``-log p(x) > 5`` (``bild:R``), else keep it; draw from ``p``
  after a rejection. BiLD's other half (fall back when the draft's top probability < 0.6) is the ``bild``
  draft-length policy.

Those are *truncation* rules: they judge from one model's law or a divergence, and fall back to the target. The
*collaborative* rules verify exactly against a law made from both models, on the segment from ``p`` towards ``q``:

* ``mix`` (``mix:l``, default 0.2) -- exact speculative sampling against ``(1 - l) p + l q``: its output law is that
  mixture, at total variation ``l TV(p, q)`` from ``p``;
* ``budget`` (``budget:e``, default 0.05) -- a mentored target within a divergence budget: the law closest to ``q``
  within total variation ``e`` of ``p``, ``p + (e / TV) (q - p)`` (``p`` itself moved all the way when
  ``TV(p, q) <= e``), verified exactly. Distortion at most ``e``; acceptance ``1 - max(TV(p, q) - e, 0)``.
Both fall back, after a rejection, to ``norm((p - q)_+)``: the residual of a target on that segment points the
same way as the exact one.

At temperature 0 ``p`` and ``q`` are point masses; the truncation rules then accept exactly the tokens greedy
verification accepts. The collaborative rules do not: they keep mass on the draft's choice by design.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import VerispecError
from ..policies import entropy
from ..probs import residual
from .base import Verdict, VerifierSpec, add_verifier, register
from .chain import chain_laws, chain_verdict, exact_rule, walk_chain

LN2 = math.log(2.0)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon divergence in bits (in [0, 1]) along the last axis."""
    p, q = p.double(), q.double()
    m = 0.5 * (p + q)

    def kl(a):
        return torch.where(a > 0, a * (a.clamp_min(1e-300) / m.clamp_min(1e-300)).log(), torch.zeros_like(a)).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).div(LN2).clamp(0.0, 1.0)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon distance ``sqrt(JS divergence in bits)``, a metric with values in [0, 1]."""
    return js_divergence(p, q).sqrt()


# ---------------------------------------------------------------- AdaSD: Bayesian acceptance from JS distance

EDGE = 1e-9  # distances within this of 0 or 1 count as exactly 0 or 1 (rounding of one-hot laws)


def silverman_bandwidth(x: torch.Tensor) -> float:
    """Silverman's rule of thumb ``0.9 min(sd, IQR / 1.34) n^(-1/5)`` (falls back to sd, then 1e-3)."""
    n = x.numel()
    sd = float(x.std()) if n > 1 else 0.0
    iqr = float(torch.quantile(x, 0.75) - torch.quantile(x, 0.25)) if n > 1 else 0.0
    spread = min(sd, iqr / 1.34) if iqr > 0 else sd
    return max(0.9 * spread * n ** (-0.2), 1e-3)


def gaussian_kde(samples: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """Gaussian kernel density estimate of ``samples`` evaluated at ``at`` (Silverman bandwidth)."""
    h = silverman_bandwidth(samples)
    z = (at[:, None] - samples[None, :]) / h
    return torch.exp(-0.5 * z * z).sum(1) / (samples.numel() * h * math.sqrt(2 * math.pi))


@dataclass
class AdaSDState:
    """What AdaSD's verifier has learned: JS distances of tokens accepted and rejected so far.

    ``accept_probability(d) = pi_A f_A(d) / (pi_A f_A(d) + pi_R f_R(d))`` with Gaussian KDEs ``f`` and
    class frequencies ``pi``. Distances of exactly 0 or 1 are decided directly and never stored. Until each
    class holds ``min_samples`` (2, the fewest a bandwidth can be estimated from) distances the
    probability is 0, so the rule is exact chain speculative sampling.
    """

    accepted: list[float] = field(default_factory=list)
    rejected: list[float] = field(default_factory=list)
    min_samples: int = 2

    @property
    def has_data(self) -> bool:
        return len(self.accepted) >= self.min_samples and len(self.rejected) >= self.min_samples

    def accept_probability(self, d: torch.Tensor) -> torch.Tensor:
        d = d.double().reshape(-1)
        out = torch.zeros_like(d)
        out[d <= EDGE] = 1.0
        inner = (d > EDGE) & (d < 1 - EDGE)
        if self.has_data and inner.any():
            acc, rej = torch.tensor(self.accepted, dtype=torch.float64), torch.tensor(self.rejected, dtype=torch.float64)
            n = len(acc) + len(rej)
            fa = len(acc) / n * gaussian_kde(acc, d[inner])
            fr = len(rej) / n * gaussian_kde(rej, d[inner])
            total = fa + fr
            out[inner] = torch.where(total > 0, fa / total.clamp_min(1e-300), torch.zeros_like(total))
        return out

    def update(self, feedback) -> None:
        for d, accepted in feedback:
            (self.accepted if accepted else self.rejected).append(float(d))

    @classmethod
    def example(cls) -> "AdaSDState":
        """A fixed, already-trained state (accepted tokens at small distances, rejected at large ones):
        what the audit and the tests use to see the rule after learning."""
        return cls(accepted=torch.linspace(0.05, 0.6, 12).tolist(), rejected=torch.linspace(0.3, 0.95, 12).tolist())


def adasd_rule(p: torch.Tensor, q: torch.Tensor, state: AdaSDState | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept ``x`` if the lossless coin ``min(1, p(x)/q(x))`` says so, or else with the Bayesian
    probability ``b(d)`` of the position's JS distance: ``a(x) = a0(x) + (1 - a0(x)) b(d)``; fall back to
    the residual ``norm((p - q)_+)``."""
    a0, fallback = exact_rule(p, q)
    b = (state or AdaSDState()).accept_probability(js_distance(p, q)).reshape(a0.shape[:-1] + (1,))
    return a0 + (1 - a0) * b, fallback


@register(
    "adasd", exact=False, chain_only=True, position_rule=adasd_rule, new_state=AdaSDState,
    note="AdaSD Bayesian acceptance from the JS distance, learned online (lossy; exact until it has data)",
)
def adasd(draft, p, rng, state: AdaSDState) -> Verdict:
    """AdaSD's verification (reconstruction; the paper leaves these choices open, each is tested):

    * at each position, two independent coins: the lossless coin ``c0 ~ Bernoulli(min(1, p(x)/q(x)))``
      and the Bayesian coin ``c1 ~ Bernoulli(b(d))`` with ``d = JSdist(p, q)``; ``x`` is accepted if
      either is heads. So AdaSD never accepts less than exact speculative sampling, and with no data
      (``b = 0``) it *is* exact chain speculative sampling;
    * after the first rejection the token is drawn from the residual ``norm((p - q)_+)``, as in exact
      speculative sampling; the bonus token after a fully accepted chain is drawn from ``p``;
    * ``d = 0`` is accepted and ``d = 1`` rejected directly (both agree with the lossless coin);
    * learning: every tested position with ``0 < d < 1`` adds ``d`` to the accepted or rejected group
      according to the *lossless* coin ``c0``, not the final decision, so the rule is not trained on its
      own relaxations. The state is updated once per step, after verification.
    """
    g = draft.num_drafted
    if g == 0:
        return Verdict((), int(rng.categorical(p[0])), ())
    x, laws = chain_laws(draft)
    a0, fallback = exact_rule(p[:g], laws)
    d = js_distance(p[:g], laws)
    b = state.accept_probability(d)
    lossless = rng.bernoulli(a0.gather(1, x[:, None]).squeeze(1))
    accepted = lossless | rng.bernoulli(b)
    tested = min(int(accepted.long().cumprod(0).sum()) + 1, g)
    feedback = tuple((float(d[i]), bool(lossless[i])) for i in range(tested) if EDGE < d[i] < 1 - EDGE)
    return chain_verdict(accepted, p, fallback.__getitem__, rng, feedback)


# ---------------------------------------------------------------- fixed-threshold rules (fall back to p)

def fsd_rule(threshold: float):
    def rule(p, q, state=None):
        """FSD: accept any drafted token iff ``JS(p, q) < T`` (bits); after a rejection draw from ``p``."""
        ok = (js_divergence(p, q) < threshold).double()[..., None]
        return ok.expand_as(p).clone(), p.double()

    return rule


def typical_rule(eps: float = 0.09, alpha: float = 0.3):
    def rule(p, q, state=None):
        """Medusa typical acceptance: accept ``x`` iff ``p(x) > min(eps, alpha exp(-H(p)))``; else draw from ``p``."""
        p = p.double()
        cut = torch.clamp(alpha * torch.exp(-entropy(p)), max=eps)[..., None]
        return (p > cut).double(), p

    return rule


def bild_rule(rollback: float = 5.0):
    def rule(p, q, state=None):
        """BiLD rollback: reject ``x`` iff ``-log p(x) > R`` (p(x) < e^-R); after a rejection draw from ``p``."""
        p = p.double()
        return (p >= math.exp(-rollback)).double(), p

    return rule


def _moved_rule(target):
    """Exact speculative sampling against ``target(p, q)`` (a law between ``p`` and ``q``)."""
    def rule(p, q, state=None):
        p, q = p.double(), q.double()
        m = target(p, q)
        accept = torch.where(q > 0, m / q.clamp_min(1e-300), torch.zeros_like(p)).clamp(max=1.0)
        return accept, residual(m, q)

    return rule


def mix_rule(weight: float):
    if not 0 <= weight <= 1:
        raise VerispecError(f"mix:l needs 0 <= l <= 1, got {weight}")
    return _moved_rule(lambda p, q: (1 - weight) * p + weight * q)


def budget_rule(eps: float):
    if not 0 <= eps <= 1:
        raise VerispecError(f"budget:e needs 0 <= e <= 1, got {eps}")

    def target(p, q):
        tv = 0.5 * (p - q).abs().sum(-1, keepdim=True)
        step = torch.where(tv > eps, eps / tv.clamp_min(1e-300), torch.ones_like(tv))
        return p + step * (q - p)

    return _moved_rule(target)


def _register_fixed(name: str, make, default: float, note: str) -> None:
    def build(value: float) -> VerifierSpec:
        rule = make(value)

        def fn(draft, p, rng):
            return walk_chain(draft, p, rng, rule)

        fn.__doc__ = rule.__doc__
        spec_name = name if value == default else f"{name}:{value:g}"
        return VerifierSpec(spec_name, fn, exact=False, note=note, chain_only=True, position_rule=rule,
                            param=value, with_param=build)

    add_verifier(build(default))


_register_fixed("fsd", fsd_rule, 0.3, "FSD: accept iff JS(p,q) < T (fsd:T, default 0.3), else draw from p (lossy)")
_register_fixed("typical", lambda eps: typical_rule(eps, 0.3), 0.09,
                "Medusa typical acceptance p(x) > min(eps, 0.3 exp(-H(p))) (typical:eps, default 0.09) (lossy)")
_register_fixed("bild", bild_rule, 5.0, "BiLD rollback: reject x iff -log p(x) > R (bild:R, default 5) (lossy)")
_register_fixed("mix", mix_rule, 0.2, "collaborative: exact sampling against (1 - l) p + l q (mix:l, default 0.2) (lossy)")
_register_fixed("budget", budget_rule, 0.05,
                "collaborative: the law nearest q within total variation e of p (budget:e, default 0.05) (lossy)")

LOSSY = ("adasd", "fsd", "typical", "bild", "mix", "budget")
TRUNCATION, COLLABORATIVE = ("adasd", "fsd", "typical", "bild"), ("mix", "budget")

