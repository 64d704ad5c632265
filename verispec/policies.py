"""Draft-length policies: decide before each drafted depth whether to keep drafting, learn from outcomes.

Interface (two methods):
    ``keep_drafting(depth, q, last, drawn) -> bool``  before drafting depth ``depth + 1``: ``q [F, V]`` are
        the draft laws at the frontier nodes (the laws the next tokens will be drawn from), ``drawn [F, V]``
        the laws the frontier nodes' own tokens were drawn from and ``last [F]`` their probabilities under
        those laws (both ``None`` at depth 0);
    ``update(feedback)``  after each step, with what verification said (``Feedback``).
The tree shape bounds the depth; a policy can only stop earlier. Policies are named in ``POLICIES``
and built from a spec string by ``get_policy`` (``fixed``, ``hf``, ``hf:heuristic``, ``adasd-entropy``,
``adaedl``, ``bild``). A policy object keeps what it has learned across prompts until it is rebuilt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import VerispecError


def entropy(q: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats along the last axis (0 log 0 = 0)."""
    q = q.double()
    return -torch.where(q > 0, q * q.clamp_min(1e-300).log(), torch.zeros_like(q)).sum(-1)


class Feedback:
    """What one step's verification tells a policy.

    The *verified tokens* are the accepted path plus, if drafting went deeper, the first candidate at
    the depth where the path stopped (the one whose rejection ended the step; for a chain, the first
    rejected token). ``labels[i]`` is True for the accepted ones. This is the labelling Hugging Face's
    assisted generation uses for its ROC re-fit (``[1] * matches + [0]``).

    ``entropy`` (nats) and ``confidence`` (draft probability) of each verified token are computed from
    the draft only when a policy reads them: the decoding loop builds a ``Feedback`` every step, and
    most policies never look.
    """

    def __init__(self, drafted: int, accepted: int, entropy: torch.Tensor | None = None,
                 confidence: torch.Tensor | None = None, *, source=None):
        self.drafted = drafted  # drafted depth this step
        self.accepted = accepted  # accepted drafted tokens
        self._entropy, self._confidence = entropy, confidence
        self._source = source  # (draft, verified nodes) to compute them from
        self.verified = len(entropy) if entropy is not None else len(source[1])

    @property
    def labels(self) -> torch.Tensor:
        return torch.arange(self.verified) < self.accepted

    def _laws(self) -> torch.Tensor:
        draft, nodes = self._source
        return draft.policy_q()[torch.tensor([draft.tree.parents[n] for n in nodes], dtype=torch.long)]

    @property
    def entropy(self) -> torch.Tensor:
        if self._entropy is None:
            self._entropy = entropy(self._laws())
        return self._entropy

    @property
    def confidence(self) -> torch.Tensor:
        if self._confidence is None:
            draft, nodes = self._source
            tokens = draft.tokens[torch.tensor(nodes, dtype=torch.long)]
            self._confidence = self._laws().gather(1, tokens[:, None]).squeeze(1).double()
        return self._confidence

    @classmethod
    def from_step(cls, draft, path: tuple[int, ...]) -> "Feedback":
        nodes = list(path)
        last = nodes[-1] if nodes else 0
        if draft.tree.children[last]:
            nodes.append(draft.tree.children[last][0])
        return cls(draft.tree.max_depth, len(path), source=(draft, nodes))


def roc_threshold(scores: torch.Tensor, positive: torch.Tensor, fn_weight: float = 1.0) -> float:
    """Threshold ``t`` minimising ``fpr + fn_weight * fnr`` for the classifier "positive iff score >= t".

    Candidates are the observed scores plus ``+inf`` (nothing positive), as in an ROC curve; ties go to
    the highest threshold. Needs at least one positive and one negative.
    """
    order = torch.argsort(scores.double(), descending=True)
    s, pos = scores.double()[order], positive[order].double()
    tp, fp = torch.cumsum(pos, 0), torch.cumsum(1 - pos, 0)
    last_of_value = torch.ones_like(s, dtype=torch.bool)
    last_of_value[:-1] = s[1:] != s[:-1]  # a threshold admits every score equal to it
    tpr = torch.cat([torch.zeros(1, dtype=torch.float64), tp[last_of_value] / pos.sum()])
    fpr = torch.cat([torch.zeros(1, dtype=torch.float64), fp[last_of_value] / (1 - pos).sum()])
    thresholds = torch.cat([torch.tensor([math.inf], dtype=torch.float64), s[last_of_value]])
    cost = fpr + fn_weight * (1 - tpr)
    first_min = int(torch.nonzero(cost <= cost.min() + 1e-12)[0])  # ties (up to rounding): highest threshold
    return float(thresholds[first_min])


@dataclass
class Fixed:
    """Draft the whole tree shape every step, or at most ``length`` levels (the papers' "Vanilla" is 5)."""

    length: int | None = None
    name = "fixed"

    def keep_drafting(self, depth: int, q: torch.Tensor, last=None, drawn=None) -> bool:
        return self.length is None or depth < self.length

    def update(self, feedback: Feedback) -> None:
        pass


@dataclass
class HFAssisted:
    """Hugging Face assisted generation's draft-length rules (``transformers`` 5.24, AssistedCandidateGenerator).

    * length: draft at most ``num_tokens`` tokens (20 by default). ``schedule="heuristic"``: after a step
      whose drafted tokens were all accepted, ``num_tokens += 2``; otherwise ``num_tokens = max(1, num_tokens - 1)``.
      ``"constant"`` (Hugging Face's default) keeps it.
    * confidence stop: after drafting a token whose draft probability is below ``threshold`` (0.4), stop
      (that token is still verified).
    * ROC re-fit (``refit``): the draft probabilities of the verified tokens and whether they were
      accepted are kept; once there are more than 5 with both outcomes present, ``threshold`` becomes the
      one minimising ``fpr + 3 * fnr`` ("false negatives cost three times more"). Hugging Face does this
      only when scikit-learn is installed; here it needs nothing.
    """

    schedule: str = "constant"
    num_tokens: float = 20
    threshold: float | None = 0.4
    refit: bool = True
    probs: list[float] = field(default_factory=list)
    matches: list[int] = field(default_factory=list)
    name = "hf"

    def __post_init__(self):
        if self.schedule not in ("constant", "heuristic"):
            raise VerispecError(f"hf schedule must be 'constant' or 'heuristic', got {self.schedule!r}")
        self.name = "hf" if self.schedule == "constant" else "hf:heuristic"

    def keep_drafting(self, depth: int, q: torch.Tensor, last=None, drawn=None) -> bool:
        if depth >= int(self.num_tokens):
            return False
        if self.threshold is not None and last is not None and float(last.max()) < self.threshold:
            return False
        return True

    def update(self, feedback: Feedback) -> None:
        if self.schedule == "heuristic":
            if feedback.accepted == feedback.drafted:
                self.num_tokens += 2
            else:
                self.num_tokens = max(1, self.num_tokens - 1)
        if self.refit and self.threshold is not None:
            self.probs.extend(feedback.confidence.tolist())
            self.matches.extend(feedback.labels.int().tolist())
            if len(self.probs) > 5 and 0 in self.matches and 1 in self.matches:
                self.threshold = roc_threshold(torch.tensor(self.probs, dtype=torch.float64),
                                               torch.tensor(self.matches, dtype=torch.bool), 3.0)


@dataclass
class AdaSDEntropy:
    """AdaSD's generation rule: stop drafting when the draft law's entropy exceeds a learned threshold.

    The paper says the threshold is "adaptively updated based on feedback from the target model" and
    has no hand-set constants; it does not give the update. Choices made here (tested):

    * the check is made on each *newly drafted* token ("if the entropy of a newly generated candidate
      token exceeds this threshold ... the generation process is terminated"): the entropy of the law it
      was drawn from; the token that triggers the stop is still verified (as in Hugging Face's confidence
      stop), so at least one token is drafted per step. This matters: checking *before* drawing would
      never verify a token above the threshold, the learned threshold would only see tokens below it and
      ratchet down until nothing is drafted (measured: 0.26 drafted tokens per step at T = 0);
      on a tree, drafting stops only when every frontier token exceeds the threshold;
    * the threshold is the entropy that best separates the verified tokens of all earlier steps into
      accepted and rejected: ``t`` minimising ``fpr + fnr`` of "rejected iff entropy >= t" (equal costs:
      no constant to choose), refitted after every step;
    * until both outcomes have been seen the threshold is infinite (draft the whole shape).
    """

    threshold: float = math.inf
    entropies: list[float] = field(default_factory=list)
    rejected: list[bool] = field(default_factory=list)
    name = "adasd-entropy"

    def keep_drafting(self, depth: int, q: torch.Tensor, last=None, drawn=None) -> bool:
        return drawn is None or bool((entropy(drawn) < self.threshold).any())

    def update(self, feedback: Feedback) -> None:
        self.entropies.extend(feedback.entropy.tolist())
        self.rejected.extend((~feedback.labels).tolist())
        if any(self.rejected) and not all(self.rejected):
            scores = torch.tensor(self.entropies, dtype=torch.float64)
            self.threshold = roc_threshold(scores, torch.tensor(self.rejected), 1.0)


@dataclass
class AdaEDL:
    """AdaEDL (Agrawal et al. 2024): stop before drafting a token if ``1 - sqrt(gamma * H(q)) < lambda``.

    ``1 - sqrt(gamma H)`` approximates a lower bound on the token's acceptance probability (gamma = 0.2).
    The adaptation of lambda is a reconstruction (the paper's exact update is not in our sources):
    ``acc`` is an exponential moving average (``beta`` = 0.9) of each step's acceptance rate
    (accepted / verified tokens) and ``lambda`` follows ``1 - acc`` with the same smoothing, so a draft
    that is often accepted drafts further. Starts at ``lambda = 0.4``. On a tree, drafting stops only
    when every frontier law is below the bound.
    """

    gamma: float = 0.2
    lam: float = 0.4
    beta: float = 0.9
    acc: float = 0.6
    name = "adaedl"

    def keep_drafting(self, depth: int, q: torch.Tensor, last=None, drawn=None) -> bool:
        bound = 1 - torch.sqrt(self.gamma * entropy(q))
        return bool((bound >= self.lam).any())

    def update(self, feedback: Feedback) -> None:
        verified = feedback.verified
        if verified == 0:
            return
        self.acc = self.beta * self.acc + (1 - self.beta) * feedback.accepted / verified
        self.lam = self.beta * self.lam + (1 - self.beta) * (1 - self.acc)


@dataclass
class BiLDFallback:
    """BiLD's fallback rule (Kim et al. 2023): the draft hands over to the target as soon as its top
    probability falls below ``threshold`` (0.6), before drafting that token (possibly drafting nothing)."""

    threshold: float = 0.6
    name = "bild"

    def keep_drafting(self, depth: int, q: torch.Tensor, last=None, drawn=None) -> bool:
        return bool((q.max(-1).values >= self.threshold).any())

    def update(self, feedback: Feedback) -> None:
        pass


POLICIES = {
    "fixed": "draft the whole tree shape (fixed:G caps the depth at G)",
    "hf": "Hugging Face assisted generation defaults: 20 tokens, confidence stop 0.4 with ROC re-fit",
    "hf:heuristic": "Hugging Face's +2/-1 length schedule (start 20) with the confidence stop and ROC re-fit",
    "adasd-entropy": "AdaSD: stop when the draft entropy exceeds a threshold learned from verification outcomes",
    "adaedl": "AdaEDL: stop when 1 - sqrt(0.2 H(q)) falls below an adaptive lambda",
    "bild": "BiLD fallback: stop when the draft's top probability < 0.6",
}


def get_policy(spec: str):
    """Build a policy from its spec string (see ``POLICIES``)."""
    name, _, arg = spec.partition(":")
    if name == "fixed":
        if not arg:
            return Fixed()
        if not arg.isdigit() or int(arg) < 1:
            raise VerispecError(f"bad policy {spec!r}; use fixed or fixed:G with G >= 1")
        return Fixed(int(arg))
    if name == "hf" and arg in ("", "constant", "heuristic"):
        return HFAssisted(schedule=arg or "constant")
    if not arg and name in ("adasd-entropy", "adaedl", "bild"):
        return {"adasd-entropy": AdaSDEntropy, "adaedl": AdaEDL, "bild": BiLDFallback}[name]()
    raise VerispecError(f"unknown draft-length policy {spec!r}; choose from {', '.join(POLICIES)}")
