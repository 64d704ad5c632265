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
batch from measured costs (``planner``); a batch of one keeps the policy's own plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .backends.base import Target
from .drafters.base import Draft, DraftControl, Drafter, propose_batch
from .drafters.suffix import SuffixCache
from .errors import VerispecError
from .methods import Recipe
from .planner import CostBook, nothing_pays, plan_depths
from .policies import Feedback
from .probs import Sampling
from .rng import Randomness, TorchRandomness
from .sequence import Sequence, StepRecord
from .tree import DynamicTree, Tree
from .verifiers import check
from .verifiers.base import step_verdict


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
    propagates (one sequence alone: the caller sees it). ``costs``: what the load-aware plan charges
    (``planner.CostBook``; default: each cost measured on first use and cached). ``answer_cache``: a
    ``drafters.SuffixCache`` that every answer which ends well is added to (``drafters.with_answer_cache``)."""

    def __init__(self, target: Target, *, max_batch: int = 8, row_budget: int | None = None,
                 costs: CostBook | None = None, load_aware: bool = True, isolate: bool = False,
                 max_context: int | None = None, prefill_chunk: int | None = None,
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
        self.book = costs or CostBook(target)  # what the load-aware plan charges
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.steps = 0

    # ---------------------------------------------------------------- requests

    def submit(self, prompt_ids: list[int], recipe: Recipe, *, sampling: Sampling, max_new_tokens: int,
               seed: int = 0, rng: Randomness | None = None, id=None) -> Sequence:
        """Queue one sequence, decoded with ``recipe``'s pieces (its own ``drafter`` and ``policy``: a batch needs
        one of each per sequence, ``Plan.start``) from ``seed``'s randomness or ``rng``."""
        prompt_ids = list(prompt_ids)
        self.check_request(prompt_ids, max_new_tokens, recipe, sampling)
        others = self.running + self.waiting
        if others and others[0].drafter.feature_layers != recipe.drafter.feature_layers:
            raise VerispecError("the sequences of one engine share the target's forward, so their drafts must read the "
                                "same target features")
        state = recipe.verifier_state
        if recipe.verifier.new_state is not None and state is None:
            state = recipe.verifier.new_state()
        seq = Sequence(prompt_ids, max_new_tokens, sampling, recipe.drafter, recipe.verifier, recipe.tree,
                       recipe.children, recipe.policy, rng if rng is not None else TorchRandomness(seed), state, id,
                       submitted=time.perf_counter())
        self.waiting.append(seq)
        return seq

    def check_request(self, prompt_ids: list[int], max_new_tokens: int, recipe: Recipe, sampling: Sampling,
                      budget_name: str = "max_new_tokens") -> None:
        """Refuse (``VerispecError``, one sentence) a sequence that could not run: what ``submit`` checks first. It
        reads only the engine's fixed configuration, so any thread may ask it (a server does, to answer at once)."""
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise VerispecError(f"{budget_name} must be a positive integer, got {max_new_tokens}")
        if not prompt_ids:
            raise VerispecError("the prompt is empty")
        if any(not 0 <= t < self.target.vocab_size for t in prompt_ids):
            raise VerispecError(f"prompt token ids must lie in [0, {self.target.vocab_size})")
        self.check_length(len(prompt_ids), max_new_tokens, recipe.tree, budget_name)
        check(recipe.verifier, recipe.tree, recipe.children, recipe.policy.name,
              0.0 if sampling.greedy else sampling.temperature)
        recipe.drafter.check_compatible(self.target)

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
        work, draft_s = _timed(self._schedule)
        if work is None:
            return []
        outs, target_s = _timed(self._forward, work)
        if outs is None:  # the forward failed, and every sequence in it with it (isolate)
            return work.seqs
        for (s, chunk), out in zip(work.chunks, outs[len(work.seqs):]):
            self._filled(s, chunk, out)
        batch = len(work.seqs) + len(work.chunks)  # sequences in the forward
        for s, d, out, source in zip(work.seqs, work.drafts, outs, work.sources):
            try:
                self._advance(s, d, out, source, draft_s=draft_s, target_s=target_s, batch=batch)
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
        """Verify one sequence's draft against its share of the forward, commit, and update its policy; its step's
        record charges its verification, its cache's commit (the target's) and its draft's update (the draft's)."""
        verdict, verify_s = _timed(step_verdict, s.verifier, draft, out.logits, s.sampling, s.rng, s.verifier_state)
        _, commit_s = _timed(self.target.commit, s.state, [0, *verdict.path])
        _, observe_s = _timed(self._observe, s, draft, out, verdict.path)
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
            draft_s=draft_s + observe_s, target_s=target_s + commit_s, verify_s=verify_s, source=source,
            batch=batch))
        if stop:
            self._finish(s, stop)

    @staticmethod
    def _observe(s: Sequence, draft: Draft, out, path: list[int]) -> None:
        """What the step tells the draft: the target's features of the root and the accepted path (EAGLE), its
        logits at every row (token recycling), and the accepted path itself."""
        if s.drafter.uses_target_hidden:
            s.drafter.observe(out.hidden[[0, *path]])
        if s.drafter.uses_target_logits:
            s.drafter.observe_logits(draft.tokens, out.logits)
        s.drafter.commit(draft, list(path))

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
        runs ``prompt_rows`` rows of joining prompts: the load-aware plan's (``planner.plan_depths``) when several
        sequences run."""
        dynamic = any(not isinstance(s.tree, Tree) for s in seqs)
        expected = [s.policy.expected_tokens(s.tree.max_depth) if isinstance(s.tree, Tree) else None for s in seqs]
        if len(seqs) == 1 or not self.load_aware or dynamic or all(e is None for e in expected):
            return [s.policy.planned_depth(s.tree.max_depth) if isinstance(s.tree, Tree) else None for s in seqs]
        proposers = [s.drafter.proposer(s.context) for s in seqs]
        own = [s.policy.planned_depth(s.tree.max_depth) if e is None else None for s, e in zip(seqs, expected)]
        best, probe = plan_depths(expected, [s.tree for s in seqs], proposers, self.book, own,
                                  [len(s.context) for s in seqs], [_lag(s, p) for s, p in zip(seqs, proposers)],
                                  self._verifying(seqs), prompt_rows)
        return [s.policy.planned_depth(s.tree.max_depth, best=b, probe=p) if e is not None else b
                for s, b, e, p in zip(seqs, best, expected, probe)]

    def _nothing_pays(self, seqs: list[Sequence], prompt_rows: int = 0) -> bool:
        """Whether no sequence's draft could pay this step (``planner.nothing_pays``, with the cheapest draft)."""
        if len(seqs) < 2 or not self.load_aware or any(not isinstance(s.tree, Tree) or s.tree.size < 2 for s in seqs):
            return False
        if any(s.policy.expected_tokens(s.tree.max_depth) is None for s in seqs):
            return False
        cheapest = min((d for s in seqs for d in (s.drafter.sources or {"": s.drafter}).values()),
                       key=lambda d: d.depth_cost)
        return nothing_pays([s.tree for s in seqs], cheapest, self.book, [len(s.context) for s in seqs],
                            self._verifying(seqs), prompt_rows)

    def _verifying(self, seqs: list[Sequence]) -> list:
        return self.book.verifying([(s.verifier, s.sampling) for s in seqs])


def _lag(seq: Sequence, proposer: Drafter) -> int:
    """Rows beyond one that ``proposer``'s first depth would run for ``seq`` (``Drafter.catch_up``): the tokens
    committed since its draft last drafted -- those of the prompt left out. A step that drafts after steps that did
    not pays for them; the prompt is paid once a request whenever its draft first drafts, so charging it to the
    step that happens to pay it would keep a joining sequence from ever drafting."""
    return min(max(proposer.catch_up(seq.context) - 1, 0), len(seq.token_ids))


def _timed(fn: Callable, *args):
    """``fn(*args)`` and the seconds it took."""
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def run_all(engine: Engine, on_step: Callable[[Sequence], None] | None = None) -> None:
    """Step ``engine`` until nothing is waiting or running; ``on_step`` sees each sequence after each of its steps."""
    while engine.has_work:
        for seq in engine.step():
            if on_step is not None:
                on_step(seq)
