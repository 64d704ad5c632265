"""Draft-length policies: decide how deep to draft, learn from outcomes (the ``Policy`` protocol).

A policy only ever shortens the draft the tree shape allows, so no policy can change the output law: the
verifiers are exact for any draft, whatever decided its length. Policies are named in ``POLICIES`` and built from a
spec string by ``get_policy`` (``auto``, ``fixed``, ``hf``, ``hf:heuristic``, ``adasd-entropy``, ``adaedl``,
``bild``). A policy object keeps what it has learned across prompts until it is rebuilt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .errors import VerispecError


class Policy(Protocol):
    """How deep to draft. Every policy has all of these (``PolicyBase`` gives the defaults), and the decoding loop
    calls nothing else:

    * ``select_source(source)``: first, when the drafter has several draft sources (``Drafter.source``), the one
      that drafts this step (``PerSource`` keeps a policy per source); the default ignores it;
    * ``planned_depth(limit) -> int``: before anything is drafted this step, how many depths to draft at most, up to
      ``limit`` (the tree's depth); 0 means no draft, a plain decoding step. Asked first, so a policy that skips
      drafting costs the step nothing. In a batch, ``best`` is the depth the engine chose for this sequence from
      ``expected_tokens`` (a policy may still probe deeper, unless ``probe`` is False: where even a perfect draft
      could not pay); a policy without that model ignores both;
    * ``expected_tokens(limit) -> [E_0, ..., E_limit]``: the tokens a step drafting d depths is expected to yield on
      the text at hand (``E_0 = 1``), for a batch to weigh against its costs; None for a policy that plans its own
      depth (``fixed``, ``hf``, ...);
    * ``keep_drafting(depth, q, last, drawn, confidence) -> bool``: before drafting depth ``depth + 1``. The drafter
      receives it (``drafters.DraftControl``), never the policy itself. ``q [F, V]`` are the draft laws at the
      frontier nodes (the laws the next tokens will be drawn from), ``drawn [F, V]`` the laws the frontier nodes' own
      tokens were drawn from and ``last [F]`` their probabilities under those laws (both ``None`` at depth 0).
      A policy that ``uses_confidence`` is asked before any law is computed, with ``q``, ``last`` and ``drawn``
      ``None`` and ``confidence [F]`` the drafter's own score for each frontier node (``Drafter.confidence``); any
      other is asked with the laws and ``confidence`` ``None``;
    * ``update(feedback)``: after each step, with what verification said (``Feedback``).

    ``reads_laws`` False promises never to look at the laws ``keep_drafting`` receives or at ``Feedback.entropy`` /
    ``confidence``; a greedy draft then skips the temperature-1 softmax over the vocabulary it would otherwise
    compute for it at every depth.
    """

    name: str
    reads_laws: bool
    uses_confidence: bool

    def select_source(self, source: str) -> None: ...

    def planned_depth(self, limit: int, best: int | None = None, probe: bool = True) -> int: ...

    def expected_tokens(self, limit: int) -> list[float] | None: ...

    def keep_drafting(self, depth: int, q: torch.Tensor | None, last=None, drawn=None, confidence=None) -> bool: ...

    def update(self, feedback: "Feedback") -> None: ...


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


class PolicyBase:
    """The protocol's defaults: one source, no plan before drafting, keep drafting, learn nothing."""

    reads_laws = True
    uses_confidence = False

    def select_source(self, source: str) -> None:
        pass

    def planned_depth(self, limit: int, best: int | None = None, probe: bool = True) -> int:
        return limit

    def expected_tokens(self, limit: int) -> list[float] | None:
        return None

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        return True

    def update(self, feedback: Feedback) -> None:
        pass


@dataclass
class Fixed(PolicyBase):
    """Draft the whole tree shape every step, or at most ``length`` levels (the papers' "Vanilla" is 5)."""

    length: int | None = None
    name = "fixed"
    reads_laws = False

    def planned_depth(self, limit: int, best: int | None = None, probe: bool = True) -> int:
        return limit if self.length is None else min(limit, self.length)

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        return self.length is None or depth < self.length

    def update(self, feedback: Feedback) -> None:
        pass


@dataclass
class HFAssisted(PolicyBase):
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

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
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
class AdaSDEntropy(PolicyBase):
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

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        return drawn is None or bool((entropy(drawn) < self.threshold).any())

    def update(self, feedback: Feedback) -> None:
        self.entropies.extend(feedback.entropy.tolist())
        self.rejected.extend((~feedback.labels).tolist())
        if any(self.rejected) and not all(self.rejected):
            scores = torch.tensor(self.entropies, dtype=torch.float64)
            self.threshold = roc_threshold(scores, torch.tensor(self.rejected), 1.0)


@dataclass
class AdaEDL(PolicyBase):
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

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        bound = 1 - torch.sqrt(self.gamma * entropy(q))
        return bool((bound >= self.lam).any())

    def update(self, feedback: Feedback) -> None:
        verified = feedback.verified
        if verified == 0:
            return
        self.acc = self.beta * self.acc + (1 - self.beta) * feedback.accepted / verified
        self.lam = self.beta * self.lam + (1 - self.beta) * (1 - self.acc)


@dataclass
class BiLDFallback(PolicyBase):
    """BiLD's fallback rule (Kim et al. 2023): the draft hands over to the target as soon as its top
    probability falls below ``threshold`` (0.6), before drafting that token (possibly drafting nothing)."""

    threshold: float = 0.6
    name = "bild"

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        return bool((q.max(-1).values >= self.threshold).any())

    def update(self, feedback: Feedback) -> None:
        pass


GENERIC_COSTS = (1.0, 1.12, 1.24, 1.36, 1.48, 1.6, 1.72, 1.84, 1.96)  # a plain step = 1; see AutoDepth


@dataclass
class AutoDepth(PolicyBase):
    """Draft as deep as pays on the text at hand, down to not drafting at all (the default policy).

    It keeps, per depth d, the chain acceptance ``a_d`` (among steps that drafted depth d and accepted every depth
    before it, the share that accepted depth d too; counts decay by ``decay`` per observation so recent text
    weighs most, with ``prior`` as ``prior_weight`` pseudo-observations). Each step drafts the depth with the most
    expected tokens per unit of cost, ``(1 + a_1 + a_1 a_2 + ...) / costs[d]``, where ``costs[d]`` is the cost of a
    step drafting d depths relative to a plain decoding step (``costs[0] = 1``): measured for a shipped draft head
    by ``verispec tune-tree`` and kept in its sidecar, else ``GENERIC_COSTS`` (each depth 12 % of a plain step),
    continued linearly past the last entry. Every ``probe_every`` steps it drafts one depth more than its choice,
    so that a depth it stopped drafting keeps being measured and a draft that turns good is taken back up.

    With ``gate`` (``auto:gate``), a confidence gate decides, within a step, each further depth from the draft's own
    confidence in the token it is about to propose (the drafter's ``confidence``: its top probability, or for prompt
    lookup the length and count of the match): it keeps, per confidence bin, the share of such tokens the target
    accepted (decayed counts, with the bin's own confidence as prior), and drafts one more depth while some horizon
    ``h`` of tokens at that acceptance, ``(E + P (a + a^2 + ... + a^h)) / costs[d + h]``, beats stopping now,
    ``E / costs[d]`` (``E`` expected tokens so far, ``P`` the chance of reaching the node). The per-depth plan above
    then only decides whether to start drafting at all (a depth of 0 skips the draft's first forward); with
    ``free_root`` (a draft whose first depth costs next to nothing, such as prompt lookup) every step starts and the
    gate alone decides. Probe steps bypass the gate. Measured no faster than the plan alone on the Hugging Face target,
    faster on llama.cpp with Gemma 3 but not with SmolLM2 (two runs each, docs/design.md), so it is opt-in.

    It decides lengths only, from the draft and past outcomes, so the output law is the verifier's, exactly. Costs
    are fixed numbers rather than live timings, so the same seed gives the same text. When drafting is a loss it
    costs only its probes (a draft that is always wrong costs one drafted step in ``probe_every``)."""

    costs: tuple[float, ...] = GENERIC_COSTS
    probe_every: int = 16
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.98
    free_root: bool = False
    reads_laws = False  # the plan reads acceptance and costs; the gate, the drafter's confidence
    gate: bool = False  # True: the confidence gate decides each further depth (``auto:gate``)
    bins: int = 8  # confidence bins of equal width on [0, 1]
    bin_decay: float = 0.995
    reached: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    bin_reached: list[float] = field(default_factory=list)
    bin_accepted: list[float] = field(default_factory=list)
    steps: int = 0

    @property
    def name(self) -> str:
        return "auto:gate" if self.gate else "auto"

    @property
    def uses_confidence(self) -> bool:  # the gate judges the drafter's confidence, before any law is computed
        return self.gate

    def __post_init__(self):
        self.costs = tuple(float(c) for c in self.costs)
        if not self.costs or self.costs[0] <= 0 or any(b < a for a, b in zip(self.costs, self.costs[1:])):
            raise VerispecError(f"auto policy costs must start positive and never decrease, got {self.costs}")
        self.bin_reached = self.bin_reached or [0.0] * self.bins
        self.bin_accepted = self.bin_accepted or [0.0] * self.bins
        self._limit, self._forced, self._bins, self._reach, self._expected = 0, 0, [], 1.0, 1.0

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.bins), 0), self.bins - 1)

    def bin_acceptance(self, confidence: float) -> float:
        """Estimated acceptance of a drafted token proposed with this confidence."""
        b = self._bin(confidence)
        prior = (b + 0.5) / self.bins  # before any outcome, the draft's confidence is taken at its word
        return (self.bin_accepted[b] + prior * self.prior_weight) / (self.bin_reached[b] + self.prior_weight)

    def acceptance(self, depth: int) -> float:
        """Estimated ``a_depth`` (1-based)."""
        i = depth - 1
        r = self.reached[i] if i < len(self.reached) else 0.0
        a = self.accepted[i] if i < len(self.accepted) else 0.0
        return (a + self.prior * self.prior_weight) / (r + self.prior_weight)

    def cost(self, depth: int) -> float:
        if depth < len(self.costs):
            return self.costs[depth]
        step = self.costs[-1] - self.costs[-2] if len(self.costs) > 1 else 0.12 * self.costs[0]
        return self.costs[-1] + (depth - len(self.costs) + 1) * step

    def expected_tokens(self, limit: int) -> list[float]:
        """``[1, 1 + a_1, 1 + a_1 + a_1 a_2, ...]``: the tokens a step drafting 0..limit depths is expected to yield."""
        out, chain = [1.0], 1.0
        for d in range(1, max(limit, 0) + 1):
            chain *= self.acceptance(d)
            out.append(out[-1] + chain)
        return out

    def best_depth(self, limit: int) -> int:
        """The depth in 0..limit with the most expected tokens per unit of cost."""
        best, best_rate = 0, 1.0 / self.cost(0)
        for d, expected in enumerate(self.expected_tokens(limit)[1:], start=1):
            if expected / self.cost(d) > best_rate + 1e-12:
                best, best_rate = d, expected / self.cost(d)
        return best

    def planned_depth(self, limit: int, best: int | None = None, probe: bool = True) -> int:
        best = self.best_depth(limit) if best is None else min(max(best, 0), limit)
        probe = probe and bool(self.steps and self.steps % self.probe_every == 0 and best < limit)
        self._forced = best + 1 if probe else 0  # a probe drafts this deep whatever the gate says
        self._limit, self._bins, self._reach, self._expected = limit, [], 1.0, 1.0
        if not self.gate:
            return self._forced or best
        if self.free_root or best > 0:
            return limit
        return self._forced

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        if not self.gate:
            return True
        c = float(confidence.max()) if confidence is not None else float(q.max())  # q: laws at temperature 1
        a = self.bin_acceptance(c)
        go = depth < self._forced
        if not go:
            gain, now = 0.0, self._expected / self.cost(depth)
            for h in range(1, self._limit - depth + 1):
                gain += self._reach * a ** h
                if (self._expected + gain) / self.cost(depth + h) > now + 1e-12:
                    go = True
                    break
        if go:
            self._bins.append(self._bin(c))
            self._reach *= a
            self._expected += self._reach
        return go

    def update(self, feedback: Feedback) -> None:
        self.steps += 1
        d, a = feedback.drafted, feedback.accepted
        for i, b in enumerate(self._bins[:d], start=1):  # the gate's tokens that were reached
            if i > a + 1:
                break
            self.bin_reached[b] = self.bin_decay * self.bin_reached[b] + 1
            self.bin_accepted[b] = self.bin_decay * self.bin_accepted[b] + (a >= i)
        self._bins = []
        while len(self.reached) < d:
            self.reached.append(0.0)
            self.accepted.append(0.0)
        for i in range(1, min(d, a + 1) + 1):  # depth i was reached if depths 1..i-1 were accepted
            self.reached[i - 1] = self.decay * self.reached[i - 1] + 1
            self.accepted[i - 1] = self.decay * self.accepted[i - 1] + (a >= i)


class PerSource(PolicyBase):
    """One policy per draft source, for a drafter with several (``HybridDrafter``): the loop names each step's source
    (``select_source``) before planning the step, and planning, the decisions while drafting and what the step teaches
    all go to that source's policy. A free prompt lookup that is often right for long runs and a model draft that
    costs a forward per depth then each learn their own acceptance and weigh their own costs."""

    def __init__(self, policies: dict[str, Policy]):
        if not policies:
            raise VerispecError("a per-source policy needs at least one source")
        self.policies = dict(policies)
        self.current = next(iter(self.policies))

    @property
    def name(self) -> str:
        return self.policies[self.current].name

    @property
    def reads_laws(self) -> bool:
        return any(p.reads_laws for p in self.policies.values())

    @property
    def uses_confidence(self) -> bool:
        return self.policies[self.current].uses_confidence

    def select_source(self, source: str) -> None:
        if source not in self.policies:
            raise VerispecError(f"no policy for draft source {source!r}; sources: {', '.join(self.policies)}")
        self.current = source

    def planned_depth(self, limit: int, best: int | None = None, probe: bool = True) -> int:
        return self.policies[self.current].planned_depth(limit, best, probe)

    def expected_tokens(self, limit: int) -> list[float] | None:
        return self.policies[self.current].expected_tokens(limit)

    def keep_drafting(self, depth: int, q, last=None, drawn=None, confidence=None) -> bool:
        return self.policies[self.current].keep_drafting(depth, q, last, drawn, confidence)

    def update(self, feedback: Feedback) -> None:
        self.policies[self.current].update(feedback)


POLICIES = {
    "auto": "draft as deep as pays on the text at hand (measured acceptance against the draft's step costs), down "
            "to plain decoding",
    "auto:gate": "auto, plus a gate that drafts each further token only while the draft's confidence in it (calibrated "
                 "online) makes it pay",
    "fixed": "draft the whole tree shape (fixed:G caps the depth at G)",
    "hf": "Hugging Face assisted generation defaults: 20 tokens, confidence stop 0.4 with ROC re-fit",
    "hf:heuristic": "Hugging Face's +2/-1 length schedule (start 20) with the confidence stop and ROC re-fit",
    "adasd-entropy": "AdaSD: stop when the draft entropy exceeds a threshold learned from verification outcomes",
    "adaedl": "AdaEDL: stop when 1 - sqrt(0.2 H(q)) falls below an adaptive lambda",
    "bild": "BiLD fallback: stop when the draft's top probability < 0.6",
}


def get_policy(spec: str, costs: tuple[float, ...] | None = None, free_root: bool = False):
    """Build a policy from its spec string (see ``POLICIES``); ``costs`` are the relative step costs the ``auto``
    policy weighs depths by (default: ``GENERIC_COSTS``; drafters with measured ones carry them as ``step_costs``),
    ``free_root`` says its draft's first depth costs next to nothing (see ``AutoDepth``)."""
    name, _, arg = spec.partition(":")
    if name == "auto" and arg in ("", "gate"):
        return AutoDepth(costs or GENERIC_COSTS, free_root=free_root, gate=arg == "gate")
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
