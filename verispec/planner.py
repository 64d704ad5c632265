"""The load-aware plan: how deep each sequence of a batch drafts this step, from plain values -- each sequence's
expected tokens by depth (its policy's ``expected_tokens``), its tree, its draft, its context length -- and the
measured costs (``CostBook``): the target's forward of R rows, each draft model's batched drafting and each
verifier's own cost. Depths are added one at a time where the batch's expected tokens per second rise most, until
no addition pays -- down to none at all when rows are dear (``batch_depths``, ``nothing_pays``). The engine
(``engine.Engine``) asks it once a step when several sequences run; a batch of one keeps its policy's own plan.

Lengths never change a sequence's law: every verifier is exact for any draft (the loop-law audit enumerates two
sequences sharing steps), so the plan is free to weigh rows against tokens.
"""

from __future__ import annotations

from .backends.base import Target
from .backends.costs import BATCH_CONTEXT, BatchCosts, batch_costs
from .drafters.base import Drafter
from .drafters.costs import DraftCosts, draft_costs
from .probs import Sampling
from .tree import Tree
from .verifiers.base import VerifierSpec
from .verifiers.costs import VerifyCosts, cost_key, verify_costs


class CostBook:
    """What the plan charges, each measured once per machine when a batch first needs it and cached (where the
    book measures): ``forward``, the target's forward of R rows (``backends.costs.batch_costs``); ``drafting``,
    each draft model's batched drafting by ``Drafter.cost_id`` (``drafters.costs.draft_costs``); ``verifying``,
    each verifier's cost beyond a plain step by ``verifiers.costs.cost_key`` (``verifiers.costs.verify_costs``).
    Given ``forward`` costs, the book measures nothing else (the costs must share one clock): a draft not given is
    charged its ``depth_cost`` of a plain step, a verifier not given nothing."""

    def __init__(self, target: Target, forward: BatchCosts | None = None,
                 drafts: dict[str, DraftCosts] | None = None, verify: dict[tuple, VerifyCosts] | None = None):
        self.target, self._forward = target, forward
        self.measure = forward is None and drafts is None
        self._drafts: dict[str, DraftCosts | None] = dict(drafts or {})
        self._verify: dict[tuple, VerifyCosts | None] = dict(verify or {})

    @property
    def forward(self) -> BatchCosts:
        if self._forward is None:
            self._forward = batch_costs(self.target)
        return self._forward

    def drafting(self, proposers: list[Drafter]) -> dict:
        """The ``DraftCosts`` of these proposers' draft models, by batch key (a draft without them is left out)."""
        out = {}
        for p in {p.batch_key: p for p in proposers}.values():  # one per draft model: its cost_id is not free
            cid = p.cost_id
            if cid is None:
                continue
            if cid not in self._drafts and self.measure:
                self._drafts[cid] = draft_costs(self.target, p)
            if self._drafts.get(cid) is not None:
                out[p.batch_key] = self._drafts[cid]
        return out

    def verifying(self, checks: list[tuple[VerifierSpec, Sampling]]) -> list[VerifyCosts | None]:
        """Each (verifier, sampling)'s ``VerifyCosts`` (None: not charged)."""
        out = []
        for verifier, sampling in checks:
            entry = cost_key(verifier, sampling)
            if entry not in self._verify:
                self._verify[entry] = verify_costs(verifier, sampling, self.target.vocab_size) \
                    if self.measure else None
            out.append(self._verify[entry])
        return out


def contexts(lengths: list[int]) -> tuple[float, int]:
    """The batch's mean context (``BatchCosts.seconds``' ``context``) and its longest (``span``)."""
    return sum(lengths) / len(lengths), max(lengths)


def plan_depths(expected: list[list[float] | None], trees: list[Tree], proposers: list[Drafter], book: CostBook,
                own: list[int | None], lengths: list[int], lag: list[int], verify: list[VerifyCosts | None],
                prompt_rows: int = 0) -> tuple[list[int], list[bool]]:
    """The batch's depths (``batch_depths``; a sequence whose ``expected`` is None keeps its ``own``) and, for each
    sequence, whether probing one more depth could pay (``pays``: a policy probes a depth it stopped drafting only
    where a good draft of it could pay in this batch)."""
    drafting = book.drafting(proposers)
    context, span = contexts(lengths)
    best = batch_depths(expected, trees, proposers, book.forward, own, drafting=drafting, context=context, span=span,
                        prompt_rows=prompt_rows, lag=lag, verify=verify)
    planned = StepCost(expected, trees, proposers, book.forward, best, drafting, context, span, prompt_rows, lag,
                       verify)
    return best, [e is not None and pays(planned, i) for i, e in enumerate(expected)]


def nothing_pays(trees: list[Tree], cheapest: Drafter, book: CostBook, lengths: list[int],
                 verify: list[VerifyCosts | None], prompt_rows: int = 0) -> bool:
    """Whether no group of these sequences (one alone up to all) drafting one token each of the ``cheapest`` draft,
    accepted as often as a good draft is, would raise the batch's rate by more than the margin (``batch_depths``'
    rule): then a step is a plain one for all, and asks the drafts nothing."""
    n = len(trees)
    plan = StepCost([None] * n, trees, [cheapest] * n, book.forward, [0] * n, book.drafting([cheapest]),
                    *contexts(lengths), prompt_rows, verify=verify)
    enough = plan.rate() * (1 + BATCH_MARGIN)
    for i in range(n):
        plan.add(i, GOOD_DRAFT)
        if plan.rate() > enough:
            return False
    return True


class StepCost:
    """A step's expected tokens and seconds for the depths planned so far, kept up to date as single depths are added
    and taken back (each in constant time whatever the batch's size, but for copying the few draft models' counts):
    the target's forward over all rows with this many sequences, the widest tree setting every sequence's attention
    padding over the longest sequence's ``span`` of keys, its drafted rows reading their sequences' caches
    (``costs.seconds`` at the batch's mean ``context``; with ``prompt_rows`` of joining prompts in the same forward,
    each drafted row costs what a row costs that far up the table, where rows are dearer -- but the prompt's own
    cost, owed whatever the plan, is left out, so that a drafted token is still judged against the rate of a plain
    step),
    plus each draft model's drafting: where it was measured (``drafting``, by batch key:
    ``DraftCosts``), by the number of sequences drafting each depth, and for each drafting sequence the rows its
    draft has yet to catch up on (``lag``: ``DraftCosts.per_row`` each); elsewhere its deepest sequence's depths (one
    batched draft forward per depth; ``Drafter.depth_cost`` of a plain step each),
    plus each drafting sequence's verification beyond a plain step's draw (``verify``, by sequence: the
    ``VerifyCosts`` of its verifier and sampling for its rows; None: not charged). A sequence whose ``expected`` is
    None yields one token a step."""

    def __init__(self, expected: list[list[float] | None], trees: list[Tree], proposers: list[Drafter],
                 costs: BatchCosts, depths: list[int], drafting: dict | None = None,
                 context: float = BATCH_CONTEXT, span: float | None = None, prompt_rows: int = 0,
                 lag: list[int] | None = None, verify: list[VerifyCosts | None] | None = None):
        self.expected, self.sizes, self.proposers, self.costs = expected, [t.sizes for t in trees], proposers, costs
        self.context, self.span, self.prompt_rows = context, span, prompt_rows
        self.drafting = drafting or {}
        self.lag = lag or [0] * len(depths)
        self.caught = 0.0  # seconds of the drafting sequences' catching up
        self.verify = verify or [None] * len(depths)
        self.checked = 0.0  # seconds of the drafting sequences' verification
        self.depths = list(depths)
        self._undo: list[tuple[int, int]] = []  # (sequence, its depth before) of each addition, for ``reset``
        self.tokens = sum(e[d] if e is not None else 1.0 for e, d in zip(expected, depths))
        self.rows = sum(sz[d] for sz, d in zip(self.sizes, depths))
        self.widest = max(sz[d] for sz, d in zip(self.sizes, depths))
        self.draft: dict = {}  # batch key -> (its deepest depth, its cost per depth), drafts not measured
        self.counts: dict = {}  # batch key -> sequences drafting each depth or deeper, drafts measured
        for i, d in enumerate(depths):
            for k in range(d):
                self._deepen(i, k)
        self.unit = costs.seconds(1, 1)

    def _deepen(self, i: int, d: int) -> None:
        """Sequence i's draft drafts depth d + 1."""
        if self.verify[i] is not None:
            rows = self.sizes[i]
            self.checked += self.verify[i].seconds(rows[d + 1]) - self.verify[i].seconds(rows[d])
        p = self.proposers[i]
        if p.batch_key in self.drafting:
            counts = self.counts.setdefault(p.batch_key, [])
            counts.extend([0] * (d + 1 - len(counts)))
            counts[d] += 1
            if d == 0:
                self.caught += self.lag[i] * self.drafting[p.batch_key].per_row
        else:
            self.draft[p.batch_key] = max(self.draft.get(p.batch_key, (0, 0.0))[0], d + 1), p.depth_cost

    def seconds(self) -> float:
        return self.costs.seconds(self.rows, len(self.depths), self.widest, self.context, self.span) + \
            self._beside_prompt() + \
            sum(d * c for d, c in self.draft.values()) * self.unit + \
            sum(self.drafting[key].seconds(counts) for key, counts in self.counts.items()) + self.caught + self.checked

    def rate(self) -> float:
        return self.tokens / self.seconds()

    def _beside_prompt(self) -> float:
        """What the drafted rows cost more beside the step's prompt rows than without them."""
        if not self.prompt_rows:
            return 0.0
        row, plain, rows = self.costs.seconds, len(self.depths), self.rows
        return (row(rows + self.prompt_rows) - row(plain + self.prompt_rows)) - (row(rows) - row(plain))

    def gain(self, i: int) -> float:
        """Expected tokens one more depth of sequence i adds."""
        e, d = self.expected[i], self.depths[i]
        return e[d + 1] - e[d]

    def add(self, i: int, gain: float | None = None) -> None:
        """One more depth for sequence i, yielding ``gain`` more tokens (default: what its ``expected`` says)."""
        d, sz = self.depths[i], self.sizes[i]
        self.tokens += self.gain(i) if gain is None else gain
        self.rows += sz[d + 1] - sz[d]
        self.widest = max(self.widest, sz[d + 1])
        self._deepen(i, d)
        self._undo.append((i, d))
        self.depths[i] = d + 1

    def mark(self) -> tuple:
        """The state now, for ``reset`` to return to after trying moves."""
        return (self.tokens, self.rows, self.widest, dict(self.draft), {k: list(v) for k, v in self.counts.items()},
                len(self._undo), self.caught, self.checked)

    def reset(self, mark: tuple) -> None:
        self.tokens, self.rows, self.widest, self.draft = mark[0], mark[1], mark[2], dict(mark[3])
        self.counts, self.caught, self.checked = {k: list(v) for k, v in mark[4].items()}, mark[6], mark[7]
        while len(self._undo) > mark[5]:
            i, d = self._undo.pop()
            self.depths[i] = d


# a move is made for a batch only where it raises the rate by more: the cost model's remaining error (0.10 until each
# drafting sequence's verification was charged; at 0.05 the plan drafts more at 2 and 4 in flight: design.md)
BATCH_MARGIN = 0.05


def batch_depths(expected: list[list[float] | None], trees: list[Tree], proposers: list[Drafter],
                 costs: BatchCosts, own: list[int | None], margin: float = BATCH_MARGIN,
                 drafting: dict | None = None, context: float = BATCH_CONTEXT,
                 span: float | None = None, prompt_rows: int = 0, lag: list[int] | None = None,
                 verify: list[VerifyCosts | None] | None = None) -> list[int]:
    """The depths with the most expected tokens per second for the batch. Each sequence starts at 0 (those whose
    policy plans its own depth, ``own``, keep it); then, move after move, one more depth goes to a group of
    sequences: of the moves that raise the batch's rate (expected tokens over ``StepCost`` seconds) by more than
    ``margin`` (the cost model's own error is of that order: rows are timed in one sequence's forward, drafting at
    one context length (``drafting``, ``StepCost``), and a step may also carry a prompt chunk; a depth that only
    breaks even costs throughput), the one whose added tokens come cheapest (added tokens over added seconds; on a tie the larger
    move), until none is left.

    The moves tried are one sequence alone (each of them) and the m sequences whose next depth adds the most
    tokens, for every m. Groups matter in a large batch: the first drafted row of a step pays for costs the whole
    batch shares -- the draft model's forward, the padding of every sequence's attention to the widest tree, a step
    up in the forward's cost -- so one sequence drafting alone can cost more than it gains where every sequence
    drafting together gains far more than it costs; and one sequence's depth moves a large batch's rate too little
    to clear the margin however well it pays. Choosing the cheapest tokens rather than the largest rise keeps a
    large move from taking the rows that better drafts would have used a step later."""
    plan = StepCost(expected, trees, proposers, costs, [o if o is not None else 0 for o in own], drafting, context,
                     span, prompt_rows, lag, verify)
    while True:
        open_ = [i for i, e in enumerate(expected) if e is not None and plan.depths[i] + 1 < len(e)]
        if not open_:
            return plan.depths
        tokens, seconds = plan.tokens, plan.seconds()
        enough = tokens / seconds * (1 + margin)
        mark = plan.mark()
        best, cheapest = None, 0.0

        def judge(move: list[int], larger: bool) -> None:  # the move is applied to ``plan`` when this is called
            nonlocal best, cheapest
            added = plan.seconds() - seconds
            per_second = float("inf") if added <= 0 else (plan.tokens - tokens) / added
            if plan.rate() > enough and (best is None or per_second > cheapest
                                         or larger and per_second >= cheapest * (1 - 1e-9)):
                best, cheapest = move, per_second

        for i in open_:  # one sequence alone
            plan.add(i)
            judge([i], False)
            plan.reset(mark)
        order = sorted(open_, key=lambda i: -plan.gain(i))  # the m best next depths, for each m
        for m, i in enumerate(order, start=1):
            plan.add(i)
            if m > 1:
                judge(order[:m], True)
        plan.reset(mark)
        if best is None:
            return plan.depths
        for i in best:
            plan.add(i)


GOOD_DRAFT = 0.8  # the acceptance of the best drafts measured here (prompt lookup on a long match)


def pays(plan: StepCost, i: int, margin: float = BATCH_MARGIN) -> bool:
    """Whether one more depth for sequence i, accepted as often as a good draft is (``GOOD_DRAFT``), would yield
    its tokens at a rate above the batch's (its added tokens over its added seconds, by more than ``margin``): where
    it would not, probing that depth is a loss too. Judged at the margin of the plan, not by the batch's whole rate,
    which one sequence's depth moves little in a large batch."""
    if plan.depths[i] + 1 >= len(plan.sizes[i]):
        return False
    mark = plan.mark()
    tokens, seconds = plan.tokens, plan.seconds()
    plan.add(i, GOOD_DRAFT)
    added = plan.seconds() - seconds
    plan.reset(mark)
    return added <= 0 or GOOD_DRAFT / added > tokens / seconds * (1 + margin)
