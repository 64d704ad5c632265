"""The decoding loop for many sequences at once (one is a batch of one): schedule -> draft -> one target forward over
every sequence's tree -> verify and commit each sequence -> update each policy.

Each sequence has its own target state (cache), its own draft state (``Drafter.fork``), its own policy, learning
verifier state and randomness. A step drafts a tree per sequence (sizes may differ, including none: a plain step),
runs *one* target forward over all of them (``Target.forward_batch``: each sequence's rows see its own cache and
ancestors only), verifies each sequence with the same pure verifier functions as one sequence alone, and commits each
accepted path in its own cache. Sequences join and leave between steps: a finished, cancelled or failed sequence
frees its slot at once, and a waiting one is prefilled and joins (continuous batching), up to ``max_batch``
sequences and a per-step ``row_budget`` of target rows.

**Why a sequence's output does not depend on its batch.** A sequence's drafts, verifications and policy updates read
only its own state, and every random call goes to its own ``Randomness`` in the same order as alone. So with the same
seed its tokens are those of decoding it alone wherever the target's logits are bitwise equal -- the batched forward
multiplies more rows at once, which can round differently in the last bit -- and whenever the drafted lengths are the
same. The load-aware plan (``Engine.depths``) changes lengths with the load: a sequence then gets another sample of
the same law (lengths never change the law: every verifier is exact for any draft, and the loop-law audit
enumerates two sequences sharing steps). At temperature 0 lengths do not matter: the tokens are the argmax chain.

**Load-aware speculation.** With several sequences running and ``auto`` policies, the depths are chosen for the
batch: each sequence's policy says how many tokens each depth is expected to yield on its text
(``Policy.expected_tokens``), the measured cost of a forward of R rows and of each draft depth says what a step costs
(``backends.costs.BatchCosts``), and depths are added one at a time, where the batch's expected tokens per second rise
most, until no addition pays -- down to none at all when rows are dear. A batch of one keeps the policy's own plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .backends.base import Target
from .backends.costs import BATCH_CONTEXT, BatchCosts, batch_costs
from .drafters.base import Draft, DraftControl, Drafter, propose_batch
from .drafters.costs import DraftCosts, draft_costs
from .drafters.suffix import SuffixCache
from .errors import VerispecError
from .policies import Feedback, Fixed, Policy
from .probs import Sampling
from .rng import Randomness, TorchRandomness
from .tree import DynamicTree, Tree
from .verifiers import check
from .verifiers.base import VerifierSpec, step_verdict
from .verifiers.costs import VerifyCosts, cost_key, verify_costs


@dataclass(frozen=True)
class StepRecord:
    drafted: int  # drafted tokens (tree nodes) this step
    draft_depth: int
    accepted_length: int  # accepted drafted tokens + 1 (recovered/bonus), before EOS/budget truncation
    accepted_ranks: tuple[int, ...]  # candidate index accepted at each depth
    tested: tuple[int, ...]  # candidates tested at each depth reached
    emitted: tuple[int, ...]  # tokens appended to the output (after EOS/budget truncation)
    draft_s: float
    target_s: float
    verify_s: float
    source: str | None = None  # which draft source proposed (a drafter with several), else None
    batch: int = 1  # sequences in the step's target forward


@dataclass(eq=False)
class Sequence:
    """One request as the engine runs it: what it decodes with, its own states, and what it has produced."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    drafter: Drafter
    verifier: VerifierSpec
    tree: Tree | DynamicTree
    children: str
    policy: Policy
    rng: Randomness
    verifier_state: object | None = None
    id: object = None
    state: object = None  # the target's cache, once prefilled
    context: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    stop_reason: str | None = None  # "eos", "max_new_tokens", "cancelled", "error"; None while running
    error: str | None = None
    prefill_s: float = 0.0
    prefilled: int = 0  # prompt tokens in the cache (all but the last once it decodes)
    submitted: float = 0.0  # perf_counter times
    admitted: float | None = None
    started: float | None = None  # prefilled and running
    first_token: float | None = None
    finished: float | None = None

    @property
    def done(self) -> bool:
        return self.stop_reason is not None


@dataclass
class _Work:
    """One step's work (``Engine._schedule``): the decoding sequences that drafted, each with its draft source (None
    unless its drafter has several) and draft, and the prompt chunks riding along."""

    seqs: list[Sequence]
    sources: list[str | None]
    drafts: list[Draft]
    chunks: list[tuple[Sequence, list[int]]]


class Engine:
    """Sequences in, tokens out, one batched step at a time (see the module docstring).

    ``submit`` checks a request (a bad one raises ``VerispecError`` and never runs) and queues it; ``step`` admits
    queued sequences into free slots (prefilling each), runs one step of every running sequence and returns them;
    ``cancel`` ends one at once. ``max_context`` (default: the model's) bounds each sequence's prompt, new tokens
    and draft depth; given, a batch's caches are allocated once for ``max_batch`` sequences of that length where the
    target can (``Target.state_pool``), so memory is bounded from the start. ``prefill_chunk``: a joining sequence's
    prompt goes through the steps' forwards this many tokens at a time beside the others' trees (decoding rows ride
    along a compute-bound prefill nearly free) instead of in a forward of its own first. ``isolate``: a sequence
    whose step raises (its draft, verification or commit) fails alone (``stop_reason`` "error", ``error`` its
    message) while the others go on, and a failed forward fails the sequences in it; without it the error
    propagates (one sequence alone: the caller sees it). ``costs``: the measured forward costs the load-aware plan
    reads (default: measured on first use and cached, ``backends.costs.batch_costs``); ``draft_costs``: the drafts'
    measured batch costs by ``Drafter.cost_id`` (default: measured on first use and cached,
    ``drafters.costs.draft_costs``, where ``costs`` is too; none where ``costs`` is given, since the two must share
    one clock: then each draft's ``depth_cost`` of a plain step stands for its cost); ``verify_costs``: each drafting
    sequence's verification by ``verifiers.costs.cost_key`` (default: measured on first use and cached,
    ``verifiers.costs.verify_costs``, where ``costs`` and ``draft_costs`` are too; elsewhere only those given are
    charged); ``answer_cache``: a ``drafters.SuffixCache`` that every answer which ends well (not failed or
    cancelled) is added to, for the drafts that read it (``drafters.with_answer_cache``)."""

    def __init__(self, target: Target, *, max_batch: int = 8, row_budget: int | None = None,
                 costs: BatchCosts | None = None, draft_costs: dict[str, DraftCosts] | None = None,
                 load_aware: bool = True, isolate: bool = False, max_context: int | None = None,
                 prefill_chunk: int | None = None, verify_costs: dict[tuple, VerifyCosts] | None = None,
                 answer_cache: SuffixCache | None = None):
        if max_batch < 1:
            raise VerispecError(f"max_batch must be >= 1, got {max_batch}")
        if row_budget is not None and row_budget < max_batch:
            raise VerispecError(f"the row budget ({row_budget}) must allow one row per sequence ({max_batch})")
        if max_context is not None and not 1 <= max_context <= target.max_context:
            raise VerispecError(f"max_context must lie in 1..{target.max_context} (the model's), got {max_context}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise VerispecError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target, self.max_batch, self.row_budget = target, max_batch, row_budget
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context or target.max_context
        # the caches of a batch, sized once: max_batch sequences of max_context entries (where the engine has them)
        self._pool = target.state_pool(max_batch, max_context) if max_context is not None and max_batch > 1 else None
        self.load_aware, self.isolate = load_aware, isolate
        self.answer_cache = answer_cache  # every finished answer goes in (drafts that read it: ``with_answer_cache``)
        self._costs = costs
        self._measure_drafts = costs is None and draft_costs is None
        self._draft_costs: dict[str, DraftCosts | None] = dict(draft_costs or {})
        self._verify_costs: dict[tuple, VerifyCosts | None] = dict(verify_costs or {})
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.steps = 0

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: list[int], *, drafter: Drafter, verifier: VerifierSpec, tree: Tree | DynamicTree,
               sampling: Sampling, max_new_tokens: int, children: str = "iid", policy: Policy | None = None,
               verifier_state=None, seed: int = 0, rng: Randomness | None = None, id=None) -> Sequence:
        """Queue one sequence (its own ``drafter`` and ``policy``: a batch needs one of each per sequence)."""
        policy = policy or Fixed()
        prompt_ids = list(prompt_ids)
        self.check_request(prompt_ids, max_new_tokens, drafter=drafter, verifier=verifier, tree=tree,
                           sampling=sampling, children=children, policy=policy)
        others = self.running + self.waiting
        if others and others[0].drafter.feature_layers != drafter.feature_layers:
            raise VerispecError("the sequences of one engine share the target's forward, so their drafts must read the "
                                "same target features")
        if verifier.new_state is not None and verifier_state is None:
            verifier_state = verifier.new_state()
        seq = Sequence(prompt_ids, max_new_tokens, sampling, drafter, verifier, tree, children, policy,
                       rng if rng is not None else TorchRandomness(seed), verifier_state, id,
                       submitted=time.perf_counter())
        self.waiting.append(seq)
        return seq

    def check_request(self, prompt_ids: list[int], max_new_tokens: int, *, drafter: Drafter, verifier: VerifierSpec,
                      tree: Tree | DynamicTree, sampling: Sampling, children: str, policy: Policy,
                      budget_name: str = "max_new_tokens") -> None:
        """Refuse (``VerispecError``, one sentence) a sequence that could not run: what ``submit`` checks first. It
        reads only the engine's fixed configuration, so any thread may ask it (a server does, to answer at once)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise VerispecError(f"{budget_name} must be a positive integer, got {max_new_tokens}")
        if not prompt_ids:
            raise VerispecError("the prompt is empty")
        if any(not 0 <= t < self.target.vocab_size for t in prompt_ids):
            raise VerispecError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        self.check_length(len(prompt_ids), max_new_tokens, tree, budget_name)
        check(verifier, tree, children, policy.name, 0.0 if sampling.greedy else sampling.temperature)
        drafter.check_compatible(self.target)

    def room(self, tree: Tree | DynamicTree) -> int:
        """Context left for a prompt and its new tokens: positions reach them and a draft's depth, and a pooled cache
        also holds a whole tree."""
        return self.max_context - (tree.size if self._pool is not None else tree.max_depth)

    def check_length(self, prompt_tokens: int, max_new_tokens: int, tree: Tree | DynamicTree,
                     budget_name: str = "max_new_tokens") -> None:
        """Refuse (``VerispecError``, naming the limit and the request's field for its budget, ``budget_name``) a
        request that cannot fit this engine's context. It reads only the engine's fixed configuration, so any thread
        may ask it."""
        if prompt_tokens + max_new_tokens > self.room(tree):
            what = f"draft tree ({tree.size} tokens)" if self._pool is not None else f"draft depth ({tree.max_depth})"
            whose = "the model's" if self.max_context == self.target.max_context else "this engine's"
            raise VerispecError(
                f"prompt ({prompt_tokens} tokens) + {budget_name} ({max_new_tokens}) + {what} exceeds {whose} "
                f"context of {self.max_context} tokens")

    def cancel(self, seq: Sequence, reason: str = "cancelled") -> None:
        """End ``seq`` now (queued or running) and free its slot."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- the step

    def step(self) -> list[Sequence]:
        """Admit what fits, then one step of every running sequence; returns the sequences that ran it (each with
        its new ``StepRecord`` last in ``steps``; finished ones have ``done`` set and have left). With
        ``prefill_chunk``, a joining sequence's prompt goes into the steps' forwards a chunk at a time, beside the
        others' trees (it returns from ``step`` once it decodes). Three verbs: schedule (who drafts what, which
        prompt chunks ride along), one target forward over all of it, then each sequence verified and committed."""
        self._admit()
        t0 = time.perf_counter()
        work = self._schedule()
        if work is None:
            return []
        t1 = time.perf_counter()
        outs = self._forward(work)
        if outs is None:  # the forward failed, and every sequence in it with it (isolate)
            return work.seqs
        t2 = time.perf_counter()
        for (s, chunk), out in zip(work.chunks, outs[len(work.seqs):]):
            self._filled(s, chunk, out)
        batch = len(work.seqs) + len(work.chunks)  # sequences in the forward
        for s, d, out, source in zip(work.seqs, work.drafts, outs, work.sources):
            try:
                self._advance(s, d, out, source, draft_s=t1 - t0, target_s=t2 - t1, batch=batch)
            except Exception as exc:  # noqa: BLE001 - one sequence's failure is its own (isolate) or the caller's
                if not self.isolate:
                    raise
                self._fail(s, exc)
        self.steps += 1
        return work.seqs

    def _schedule(self) -> _Work | None:
        """This step's work: each decoding sequence's draft (its depth planned for the batch, or none at all where
        rows are too dear for any draft), and the prompt chunks that fill the rows the drafts leave. None when there
        is nothing to run (no sequence, or every one failed while drafting)."""
        seqs = [s for s in self.running if s.prefilled >= len(s.prompt_ids) - 1]
        filling = [s for s in self.running if s.prefilled < len(s.prompt_ids) - 1]
        if not seqs and not filling:
            return None
        # the prompt rows joining this step's forward (at most: the chunks' share of a row budget is what drafts leave)
        prompt_rows = sum(len(c) for _, c in self._chunks(filling, 0))
        if self._nothing_pays(seqs, prompt_rows):  # rows too dear for any draft: plain steps, no drafting work at all
            sources, planned = [None] * len(seqs), [Tree.root_only()] * len(seqs)
        else:
            sources = [s.drafter.source(s.context) for s in seqs]  # None unless a drafter has several sources
            for s, source in zip(seqs, sources):
                if source is not None:
                    s.policy.select_source(source)
            planned = self._plan(seqs, prompt_rows) if seqs else []
        kept, drafts = self._draft(seqs, planned)
        chunks = self._chunks(filling, sum(d.tree.size for d in drafts))
        if not kept and not chunks:  # every sequence of the step failed while drafting
            return None
        return _Work([seqs[i] for i in kept], [sources[i] for i in kept], drafts, chunks)

    def _forward(self, work: _Work) -> list | None:
        """One target forward over every draft tree and prompt chunk of ``work``, each on its own cache; None where
        it raised with ``isolate`` (every sequence in it has failed)."""
        seqs, drafts, chunks = work.seqs, work.drafts, work.chunks
        states = [s.state for s in seqs] + [s.state for s, _ in chunks]
        tokens = [d.tokens for d in drafts] + [torch.tensor(c) for _, c in chunks]
        positions = [s.state.committed + torch.tensor(d.tree.depths) for s, d in zip(seqs, drafts)] + \
            [s.state.committed + torch.arange(len(c)) for s, c in chunks]
        attends = [d.tree.ancestors_mask() for d in drafts] + [torch.ones(len(c), len(c), dtype=torch.bool).tril()
                                                               for _, c in chunks]
        features = (seqs or [s for s, _ in chunks])[0].drafter.feature_layers
        # a prompt chunk's logits are never read (its features are): its rows skip the output layer, all but one
        first = [0] * len(seqs) + [len(c) - 1 for _, c in chunks] if chunks else None
        try:
            return self.target.forward_batch(states, tokens, positions, attends, features=features,
                                             logits_from=first)
        except Exception as exc:  # noqa: BLE001 - the batch's own forward: every sequence in it fails (isolate)
            if not self.isolate:
                raise
            for s in seqs + [s for s, _ in chunks]:
                self._fail(s, exc)
            return None

    def _draft(self, seqs: list[Sequence], planned: list) -> tuple[list[int], list[Draft]]:
        """Every sequence's draft, grown together (``propose_batch``). With ``isolate``, a draft that raises fails its
        own sequence only: the step drafts each sequence alone to find which (those drafts draw fresh random numbers,
        which leaves each sequence's law as it was, but not its seeded text), and goes on with the others. Returns
        the indices of the sequences that drafted, and their drafts."""
        def propose(group: list[int]) -> list[Draft]:
            return propose_batch([seqs[i].drafter for i in group], [seqs[i].context for i in group],
                                 [planned[i] for i in group], [seqs[i].sampling for i in group],
                                 [seqs[i].children for i in group], [seqs[i].rng for i in group],
                                 [DraftControl.of(seqs[i].policy) for i in group])
        everyone = list(range(len(seqs)))
        if not seqs:
            return [], []
        try:
            return everyone, propose(everyone)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            if not self.isolate:
                raise
            if len(seqs) == 1:
                self._fail(seqs[0], exc)
                return [], []
        kept: list[int] = []
        drafts: list[Draft] = []
        for i in everyone:
            try:
                drafts.extend(propose([i]))
                kept.append(i)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self._fail(seqs[i], exc)
        return kept, drafts

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """``seq`` ends with ``stop_reason`` "error" and the first line of what went wrong; the others go on."""
        seq.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self._finish(seq, "error")

    def _chunks(self, filling: list[Sequence], rows: int) -> list[tuple[Sequence, list[int]]]:
        """The next prompt chunk of each prefilling sequence, within the row budget (at least one chunk a step)."""
        out, budget = [], (self.row_budget or 1 << 30) - rows
        for s in filling:
            n = min(self.prefill_chunk, len(s.prompt_ids) - 1 - s.prefilled, max(budget, 1 if not out else 0))
            if n <= 0:
                break
            out.append((s, s.prompt_ids[s.prefilled:s.prefilled + n]))
            budget -= n
        return out

    def _filled(self, s: Sequence, chunk: list[int], out) -> None:
        """A prompt chunk ran: keep it, and hand its features to the draft."""
        self.target.commit(s.state, list(range(len(chunk))))
        if s.drafter.uses_target_hidden:
            s.drafter.observe(out.hidden)
        s.prefilled += len(chunk)
        if s.prefilled >= len(s.prompt_ids) - 1:
            s.started = time.perf_counter()
            s.prefill_s = s.started - s.admitted

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting.pop(0)
            try:
                self._prefill(seq)
            except Exception as exc:  # noqa: BLE001 - see step
                if not self.isolate:
                    raise
                self._fail(seq, exc)
                continue
            self.running.append(seq)

    def _prefill(self, seq: Sequence) -> None:
        """A sequence joins: its state, its draft's reset, and its prompt (all of it now, or by chunks in the steps
        to come with ``prefill_chunk``)."""
        seq.admitted = t = time.perf_counter()
        seq.state = self._pool.acquire() if self._pool is not None else self.target.new_state()
        seq.drafter.reset(seq.prompt_ids)
        seq.context = list(seq.prompt_ids)
        if self.prefill_chunk is not None:
            seq.prefilled = 0
            if len(seq.prompt_ids) <= 1:
                seq.started, seq.prefill_s = t, 0.0
                if seq.drafter.uses_target_hidden:
                    seq.drafter.observe(torch.zeros(0, 0))
            return
        pre = self.target.prefill_output(seq.state, seq.prompt_ids[:-1], features=seq.drafter.feature_layers)
        if seq.drafter.uses_target_hidden:
            seq.drafter.observe(pre.hidden if pre is not None else torch.zeros(0, 0))
        seq.prefilled = len(seq.prompt_ids) - 1
        seq.started = time.perf_counter()
        seq.prefill_s = seq.started - t

    def _advance(self, s: Sequence, draft: Draft, out, source, draft_s: float, target_s: float, batch: int) -> None:
        """Verify one sequence's draft against its share of the forward, commit, and update its policy."""
        t2 = time.perf_counter()
        verdict = step_verdict(s.verifier, draft, out.logits, s.sampling, s.rng, s.verifier_state)
        t3 = time.perf_counter()
        self.target.commit(s.state, [0, *verdict.path])
        t4 = time.perf_counter()
        if s.drafter.uses_target_hidden:  # the target's features of the root and the accepted path (EAGLE)
            s.drafter.observe(out.hidden[[0, *verdict.path]])
        if s.drafter.uses_target_logits:  # what the target said after every row (token recycling)
            s.drafter.observe_logits(draft.tokens, out.logits)
        s.drafter.commit(draft, list(verdict.path))
        t5 = time.perf_counter()
        new = [int(draft.tokens[n]) for n in verdict.path] + [verdict.token]
        emitted, stop = [], None
        for tok in new:
            emitted.append(tok)
            if tok in self.target.eos_token_ids:
                stop = "eos"
            elif len(s.token_ids) + len(emitted) >= s.max_new_tokens:
                stop = "max_new_tokens"
            if stop:
                break
        s.context.extend(new)
        s.token_ids.extend(emitted)
        if s.first_token is None:
            s.first_token = time.perf_counter()
        s.policy.update(Feedback.from_step(draft, verdict.path))
        ranks = draft.tree.ranks
        s.steps.append(StepRecord(
            drafted=draft.num_drafted, draft_depth=draft.tree.max_depth, accepted_length=len(verdict.path) + 1,
            accepted_ranks=tuple(ranks[n] for n in verdict.path), tested=verdict.tested, emitted=tuple(emitted),
            draft_s=draft_s + (t5 - t4), target_s=target_s + (t4 - t3), verify_s=t3 - t2, source=source,
            batch=batch))
        if stop:
            self._finish(s, stop)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.stop_reason is None:
            seq.stop_reason = reason
            seq.finished = time.perf_counter()
            if self.answer_cache is not None and reason in ("eos", "max_new_tokens", "stop"):
                self.answer_cache.add(seq.token_ids)
        if seq in self.running:
            self.running.remove(seq)
        if self._pool is not None and seq.state is not None:
            self._pool.release(seq.state)  # its slot serves the next sequence
        seq.state = None  # the cache goes with the sequence

    # ---------------------------------------------------------------- how deep each sequence drafts

    def _plan(self, seqs: list[Sequence], prompt_rows: int = 0) -> list[Tree | DynamicTree]:
        """Each sequence's tree this step: its policy's plan, the batch's when several run (``depths``), cut to the
        row budget."""
        depths = self.depths(seqs, prompt_rows)
        planned = [s.tree if d is None else s.tree.truncate(d) for s, d in zip(seqs, depths)]
        if self.row_budget is not None:
            while sum(t.size for t in planned) > self.row_budget:
                i = max(range(len(planned)), key=lambda k: planned[k].size)
                planned[i] = seqs[i].tree.truncate(planned[i].max_depth - 1)
        return planned

    def depths(self, seqs: list[Sequence], prompt_rows: int = 0) -> list[int | None]:
        """The depth each sequence drafts this step (None: a dynamic tree, which sets its own), in a forward that also
        runs ``prompt_rows`` rows of joining prompts."""
        dynamic = any(not isinstance(s.tree, Tree) for s in seqs)
        expected = [s.policy.expected_tokens(s.tree.max_depth) if isinstance(s.tree, Tree) else None for s in seqs]
        if len(seqs) == 1 or not self.load_aware or dynamic or all(e is None for e in expected):
            return [s.policy.planned_depth(s.tree.max_depth) if isinstance(s.tree, Tree) else None for s in seqs]
        proposers = [s.drafter.proposer(s.context) for s in seqs]
        trees = [s.tree for s in seqs]
        drafting = self.drafting(proposers)
        context, span = _contexts(seqs)
        lag = [_lag(s, p) for s, p in zip(seqs, proposers)]
        verify = self.verifying(seqs)
        best = batch_depths(expected, trees, proposers, self.costs,
                            [s.policy.planned_depth(s.tree.max_depth) if e is None else None
                             for s, e in zip(seqs, expected)], drafting=drafting, context=context, span=span,
                            prompt_rows=prompt_rows, lag=lag, verify=verify)
        # a policy probes a depth it stopped drafting only where a good draft of it could pay in this batch
        planned = _StepCost(expected, trees, proposers, self.costs, best, drafting, context, span, prompt_rows, lag,
                            verify)
        probe = [e is not None and _pays(planned, i) for i, e in enumerate(expected)]
        return [s.policy.planned_depth(s.tree.max_depth, best=b, probe=p) if e is not None else b
                for s, b, e, p in zip(seqs, best, expected, probe)]

    def _nothing_pays(self, seqs: list[Sequence], prompt_rows: int = 0) -> bool:
        """Whether, with this many sequences, no group of them (one alone up to all) drafting one token each of the
        cheapest draft, accepted as often as a good draft is, would raise the batch's rate by more than the margin
        (``batch_depths``' rule): then a step is a plain one for all, and asks the drafts nothing."""
        if len(seqs) < 2 or not self.load_aware or any(not isinstance(s.tree, Tree) or s.tree.size < 2 for s in seqs):
            return False
        if any(s.policy.expected_tokens(s.tree.max_depth) is None for s in seqs):
            return False
        cheapest = min((d for s in seqs for d in (s.drafter.sources or {"": s.drafter}).values()),
                       key=lambda d: d.depth_cost)
        plan = _StepCost([None] * len(seqs), [s.tree for s in seqs], [cheapest] * len(seqs), self.costs,
                         [0] * len(seqs), self.drafting([cheapest]), *_contexts(seqs), prompt_rows,
                         verify=self.verifying(seqs))
        enough = plan.rate() * (1 + BATCH_MARGIN)
        for i in range(len(seqs)):
            plan.add(i, GOOD_DRAFT)
            if plan.rate() > enough:
                return False
        return True

    def drafting(self, proposers: list[Drafter]) -> dict:
        """The measured ``DraftCosts`` of these proposers' draft models, by batch key (each measured once per machine
        when a batch first needs it, where the engine measures; a draft without them is left out)."""
        out = {}
        for p in {p.batch_key: p for p in proposers}.values():  # one per draft model: its cost_id is not free
            cid = p.cost_id
            if cid is None:
                continue
            if cid not in self._draft_costs and self._measure_drafts:
                self._draft_costs[cid] = draft_costs(self.target, p)
            if self._draft_costs.get(cid) is not None:
                out[p.batch_key] = self._draft_costs[cid]
        return out

    def verifying(self, seqs: list[Sequence]) -> list[VerifyCosts | None]:
        """Each sequence's ``VerifyCosts`` (its verifier and kind of sampling, measured once per machine when a batch
        first needs them, where the engine measures; None elsewhere: not charged)."""
        out = []
        for s in seqs:
            entry = cost_key(s.verifier, s.sampling)
            if entry not in self._verify_costs:
                self._verify_costs[entry] = verify_costs(s.verifier, s.sampling, self.target.vocab_size) \
                    if self._measure_drafts else None
            out.append(self._verify_costs[entry])
        return out

    @property
    def costs(self) -> BatchCosts:
        if self._costs is None:  # measured (once per machine, then cached) only when a batch first needs it
            self._costs = batch_costs(self.target)
        return self._costs


def _lag(seq: Sequence, proposer: Drafter) -> int:
    """Rows beyond one that ``proposer``'s first depth would run for ``seq`` (``Drafter.catch_up``): the tokens
    committed since its draft last drafted -- those of the prompt left out. A step that drafts after steps that did
    not pays for them; the prompt is paid once a request whenever its draft first drafts, so charging it to the
    step that happens to pay it would keep a joining sequence from ever drafting."""
    return min(max(proposer.catch_up(seq.context) - 1, 0), len(seq.token_ids))


def _contexts(seqs: list[Sequence]) -> tuple[float, int]:
    """The batch's mean context (``BatchCosts.seconds``' ``context``) and its longest (``span``)."""
    lengths = [len(s.context) for s in seqs]
    return sum(lengths) / len(lengths), max(lengths)


class _StepCost:
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
    sequences: of the moves that raise the batch's rate (expected tokens over ``_StepCost`` seconds) by more than
    ``margin`` (the cost model's own error is of that order: rows are timed in one sequence's forward, drafting at
    one context length (``drafting``, ``_StepCost``), and a step may also carry a prompt chunk; a depth that only
    breaks even costs throughput), the one whose added tokens come cheapest (added tokens over added seconds; on a tie the larger
    move), until none is left.

    The moves tried are one sequence alone (each of them) and the m sequences whose next depth adds the most
    tokens, for every m. Groups matter in a large batch: the first drafted row of a step pays for costs the whole
    batch shares -- the draft model's forward, the padding of every sequence's attention to the widest tree, a step
    up in the forward's cost -- so one sequence drafting alone can cost more than it gains where every sequence
    drafting together gains far more than it costs; and one sequence's depth moves a large batch's rate too little
    to clear the margin however well it pays. Choosing the cheapest tokens rather than the largest rise keeps a
    large move from taking the rows that better drafts would have used a step later."""
    plan = _StepCost(expected, trees, proposers, costs, [o if o is not None else 0 for o in own], drafting, context,
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


def _pays(plan: _StepCost, i: int, margin: float = BATCH_MARGIN) -> bool:
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


def run_all(engine: Engine, on_step: Callable[[Sequence], None] | None = None) -> None:
    """Step ``engine`` until nothing is waiting or running; ``on_step`` sees each sequence after each of its steps."""
    while engine.has_work:
        for seq in engine.step():
            if on_step is not None:
                on_step(seq)
