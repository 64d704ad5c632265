"""Closed loops of concurrent requests (``verispec bench --concurrency N``): every prompt of the run is a request, N
are in flight at any time, and a new one starts as one finishes. What each system does with them is its own:
verispec's batched engine steps them together (``engine.Engine``); the peers serve them their way (``bench.peers``:
static batches for Hugging Face ``generate``, transformers' continuous batching, one at a time for llama-cpp-python,
parallel slots for llama.cpp's ``llama-server``).

Each request's outcome is a ``Request``: its tokens and, in seconds since the loop started, when it was submitted,
when its first token came and when it finished. A request is submitted when a client is free: at the start for the
first N, then when an earlier one finishes. Time to first token counts from submission (queueing included), time
per output token from the first token to the last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..backends.costs import batch_costs
from ..datasets import Problem
from ..drafters.costs import measured_draft_costs
from ..engine import Engine
from ..errors import VerispecError
from ..planner import CostBook
from ..probs import Sampling
from ..sequence import StepRecord
from ..verifiers.costs import cost_key, verify_costs

PREFILL_CHUNK = 128  # prompt tokens a joining request puts in each step's forward (engine.Engine.prefill_chunk)


@dataclass
class Request:
    problem: Problem
    token_ids: list[int]
    submitted: float
    first_token: float | None
    finished: float
    steps: list[StepRecord] = field(default_factory=list)
    prefill_s: float | None = None
    error: str | None = None
    token_source: str | None = None  # for a server peer: "server" (ids it returned) or "re-encoded" (its text)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first (None with fewer than two tokens)."""
        if self.first_token is None or len(self.token_ids) < 2:
            return None
        return (self.finished - self.first_token) / (len(self.token_ids) - 1)

    @property
    def latency_s(self) -> float:
        return self.finished - self.submitted


def verispec_loop(target, plan, drafter, problems: list[Problem], prompt_ids: list[list[int]], concurrency: int,
                  temperature: float, seed: int, max_new_tokens: int) -> list[Request]:
    """The closed loop through verispec's batched engine: up to ``concurrency`` sequences share each target forward
    (the load-aware plan choosing their depths), each request with its own draft state, policy and seed."""
    tree = plan.tree_for(drafter)
    longest = max(len(ids) for ids in prompt_ids) + max_new_tokens + tree.size
    # the target's and the drafts' costs: measured once per machine, before the clock starts
    costs = batch_costs(target) if concurrency > 1 else None
    drafts = measured_draft_costs(target, drafter) if concurrency > 1 else None
    sampling = Sampling(temperature)
    checks = {cost_key(plan.verifier, sampling): verify_costs(plan.verifier, sampling, target.vocab_size)} \
        if concurrency > 1 else None
    book = CostBook(target, costs, drafts, checks) if concurrency > 1 else None
    engine = Engine(target, max_batch=concurrency, isolate=True, max_context=min(longest, target.max_context),
                    costs=book, prefill_chunk=PREFILL_CHUNK if concurrency > 1 else None)
    t0 = time.perf_counter()
    queue = list(range(len(problems)))
    out: dict[int, Request] = {}

    def submit(i: int) -> None:
        engine.submit(prompt_ids[i], plan.start(target, drafter), sampling=sampling, max_new_tokens=max_new_tokens,
                      seed=seed, id=i)

    for _ in range(min(concurrency, len(queue))):
        submit(queue.pop(0))
    while engine.has_work:
        for seq in engine.step():
            if not seq.done:
                continue
            out[seq.id] = Request(problems[seq.id], list(seq.token_ids), seq.submitted - t0,
                                  None if seq.first_token is None else seq.first_token - t0, seq.finished - t0,
                                  list(seq.steps), seq.prefill_s, seq.error)
            if queue:
                submit(queue.pop(0))
    if len(out) != len(problems):
        raise VerispecError(f"{len(problems) - len(out)} requests of the closed loop never finished")
    return [out[i] for i in range(len(problems))]


def one_at_a_time(serve, problems: list[Problem], concurrency: int) -> list[Request]:
    """A server that serves one request at a time (llama-cpp-python's, Hugging Face assisted generation's): the
    requests run back to back, and request k, submitted when request k - N finished, waits for the ones before it.
    ``serve(i) -> (token_ids, seconds to first token or None)`` runs request i."""
    t0 = time.perf_counter()
    out, finished = [], []
    for i, problem in enumerate(problems):
        start = time.perf_counter() - t0
        tokens, first = serve(i)
        end = time.perf_counter() - t0
        submitted = 0.0 if i < concurrency else finished[i - concurrency]
        out.append(Request(problem, tokens, submitted, None if first is None else start + first, end))
        finished.append(end)
    return out


def static_batches(serve_batch, problems: list[Problem], concurrency: int) -> list[Request]:
    """Static batching (Hugging Face ``generate`` on a padded batch): N requests at a time, the next N once the
    whole batch has finished. ``serve_batch(indices) -> [(token_ids, seconds to first token, seconds to last)]``."""
    t0 = time.perf_counter()
    out = []
    for start in range(0, len(problems), concurrency):
        idx = list(range(start, min(start + concurrency, len(problems))))
        begun = time.perf_counter() - t0
        for i, (tokens, first, last) in zip(idx, serve_batch(idx)):
            out.append(Request(problems[i], tokens, begun, begun + first, begun + last))
    return out
