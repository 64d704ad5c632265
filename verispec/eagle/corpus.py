"""Training text the target writes itself, in the shapes of the tasks a draft head meets (never their questions),
with what training reads of it.

Each *round* runs one task shape on a batch of items, every stage one batch of prompts (a ``Job``) on the target's
batched forward (``_Writer.run``, which can also run several rounds' stages on one batch):

* ``chat``: the target writes a user turn from an empty one, answers it, writes a follow-up turn and answers it
  (two assistant turns in one sequence, like a multi-turn conversation);
* ``document``: the target completes a request such as "Write a news article about ...", writes the document,
  then (each its own sequence) summarises it (``Summarize: DOC``), writes a question about it and answers it with
  the document in the prompt (retrieval-augmented QA), translates one of its sentences into German and the German
  back into English (``Translate German to English: ...``);
* ``edit``: a short text the target writes, then reworked as asked (simpler words, more formal, its key points
  as a list, a title, the names and places in it, a reply to it);
* ``instruct``: a request begun by an opening such as "Explain how", "Give me tips for", "Pretend you are",
  finished by the target about a topic and answered (explanations, advice, role play, comparisons, letters);
* ``qa``: asked for "a trivia question about TOPIC", the target writes one; the question alone is then the user
  turn, and the target answers it;
* ``math``: likewise with "a short math word problem about TOPIC", then solved;
* ``code``: a programming request begun by an opening such as "Write a Python function that", answered, then
  the answer explained (``Explain what this code does: ...``).

Openings and topics are generic words written for this module; the target writes every request, document and
answer itself. Requests and documents are sampled at temperature ``REQUEST_T``; answers at temperatures that
cycle over ``answer_temperatures`` round by round (greedy included: the text a temperature-0 run sees). A record is
``{"tokens", "spans", "shape", "round"}``; ``spans`` are the ``[start, end)`` token ranges the target wrote as the
assistant, the only positions a draft head is trained and evaluated on. A record whose tokens repeat an earlier
record's is dropped (greedy answers to a request written twice).

A corpus is a folder. Its text is what it keeps: ``text/NNNNN.jsonl.gz``, one file per round, small enough to commit
(30-300 kB a round), so that the corpus grows across sessions and machines. What training reads of it
(``CorpusConfig.layers``: each record's features, the target's hidden states of those layers at every position in
float16, and the target's top-k next-token laws) is a cache beside it, ``features/NNNNN.pt``, 0.1-1 GB a round:
written with the text by the forwards that wrote it (``_Writer.sample``, no forward of its own), and where it is
missing (a fresh checkout) computed again by teacher forcing, a prefill of the finished text (``fill_features``:
the same bits on the tiny test models, the same to bfloat16 rounding on the default one, docs/design.md).

A round's features file is written before its text file (each by a rename): a corpus resumes at its first round
without text, keeping the rounds it has. Each round's choices and draws are seeded by its number, so a corpus written
in one go is the one written in several sittings (tested on the tiny models; on the default model a round written
again was the same bytes, docs/design.md).

On a GPU the rounds are written by ``_GenerateWriter`` instead: text only, many rounds' jobs sampled together with
Hugging Face ``generate`` on padded batches (the same law, other bytes), their features computed afterwards by
teacher forcing; ``writers.jsonl`` beside the text names those rounds.

Without a chat template (a base model) every round is free text: the target continues an opening.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import VerispecError

SHAPES = ("chat", "document", "edit", "instruct", "qa", "math", "code")
# round -> shape: Spec-Bench's categories (conversation, translation, summarisation, QA, math, retrieval) in the
# shares a draft meets them, plus the writing, role play and extraction of MT-bench's
CYCLE = ("chat", "document", "qa", "math", "instruct", "document", "code", "chat", "edit", "math", "document", "qa",
         "instruct", "code", "chat", "edit")

OPENINGS = {
    "document": ["Write a news article about", "Write a short story about", "Write a blog post about",
                 "Write an encyclopedia entry about", "Write a report about", "Write a product review of",
                 "Write a travel guide to", "Write a biography of", "Write a history of", "Write an essay about",
                 "Write a speech about", "Write a diary entry about", "Write a press release about",
                 "Write a recipe for", "Write a lesson plan about", "Write an interview about"],
    "edit": ["Write a paragraph about", "Write a short email about", "Write a short note about",
             "Write a short announcement about", "Describe in a paragraph"],
    "instruct": ["Explain how", "Explain why", "Give me tips for", "What are the pros and cons of",
                 "Pretend you are", "Compare", "Write a poem about", "Write a letter to", "List five facts about",
                 "Describe", "How do I", "What would happen if", "Suggest a plan for", "Teach me about",
                 "Imagine you are", "Write a dialogue between", "Give me advice on", "Summarize what you know about",
                 "What is the difference between", "Write a haiku about", "Argue for", "Tell me a joke about"],
    "code": ["Write a Python function that", "Write a Python program that", "Write a JavaScript function that",
             "Write a SQL query that", "Write a Python class that", "Write a shell script that",
             "Write a C function that", "Write a regular expression that", "Fix this Python code that",
             "Write a unit test for a function that", "Write a Java method that", "Write an HTML page that"],
}
EDITS = ["Rewrite this text in simple words:\n\n{}", "Rewrite this text in a formal style:\n\n{}",
         "List the key points of this text:\n\n{}", "Give this text a short title.\n\n{}",
         "Extract all names, places and numbers in this text:\n\n{}", "Write a reply to this:\n\n{}",
         "Shorten this text to one sentence:\n\n{}", "Continue this text:\n\n{}"]
TOPICS = ["apples", "a bakery", "a road trip", "the ocean", "a football team", "a library", "money", "a garden",
          "planets", "a birthday party", "trains", "a school", "cooking", "music", "animals", "a city", "history",
          "computers", "a farm", "the weather", "movies", "a hospital", "books", "rivers", "a shop", "painting",
          "mountains", "a bicycle", "chemistry", "a wedding", "elections", "a museum", "insects", "a restaurant",
          "the moon", "a factory", "languages", "a hotel", "basketball", "medicine", "volcanoes", "a job interview",
          "recycling", "the stock market", "dinosaurs", "a camping trip", "smartphones", "a rainforest", "taxes",
          "a marathon", "coffee", "the internet", "a castle", "electricity", "a zoo", "friendship", "a storm",
          "airplanes", "photography", "a village", "bees", "a concert", "exercise", "the desert", "robots",
          "a family dinner", "climate", "gardening tools", "a newspaper", "the brain", "a bridge", "fishing",
          "a startup", "sleep", "a train station", "space travel", "a science fair", "vitamins", "chess", "a harbor",
          "winter", "ancient Rome", "a bank", "social media", "a pharmacy", "birds", "a theater", "solar panels",
          "a podcast", "the human heart", "a supermarket", "rain", "a police station", "glaciers", "a video game",
          "pets", "a university", "tea", "the Olympics", "a carpenter", "satellites", "a picnic", "a dentist",
          "the Renaissance", "bread", "a neighbourhood", "wind turbines", "a lighthouse", "cars", "a kindergarten"]
ASK = {"qa": "Write one trivia question about {}. Write only the question.",
       "math": "Write a short math word problem about {}. Write only the problem, not the solution."}
FREE_OPENINGS = ["The", "In", "Once upon a time", "Today", "def ", "Question:", "Chapter 1", "A new study"]

REQUEST_T = 0.8
LIMITS = {"request": 40, "document": 320, "answer": 192, "short": 40, "sentence": 80, "paragraph": 160}
MAX_PROMPT = 1536  # tokens; a longer prompt keeps its end
PREFILL_ROWS = 4096  # prompt tokens per prefill forward
# sequences decoding at once: a stage of a round (128 items) starts whole, so its tail is the one wave's longest
# answers, not a second wave's (scripts/experiments/corpus_rate.py: 306 and 307 against 199 and 248 tokens/s at 64,
# alternated; rounds 0-7 of data/corpus/smollm2-135m were written with 64)
SLOTS = 128
# corpus rounds sharing the batch (a stage waits for all its answers; with 2, a round's last long answers decode
# beside the next round's prompts instead of alone)
ROUNDS_AT_ONCE = 1  # 2 measured no faster at 128 slots, where the batch is compute-bound (docs/design.md)
# corpus rounds in flight with _GenerateWriter (a target on a GPU): their jobs sampled together, a pool a tick
GENERATE_ROUNDS_AT_ONCE = 16
FORMAT = 2  # 1: text only (features computed afterwards); 2: features and labels written with the text


@dataclass(frozen=True)
class CorpusConfig:
    rounds: int = 64
    batch: int = 64
    seed: int = 0
    answer_temperatures: tuple[float, ...] = (0.0, 0.6, 1.0)
    layers: tuple[int, ...] | None = None  # features to keep (hidden_states indices); None: text only
    top_k: int = 64


@dataclass
class Record:
    tokens: list[int]
    spans: list[list[int]]
    shape: str
    round: int
    data: dict | None = field(default=None, repr=False)  # what training reads (features, labels); not in the JSON

    def to_json(self) -> str:
        return json.dumps({"tokens": self.tokens, "spans": self.spans, "shape": self.shape, "round": self.round})


def _top_labels(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k next-token laws of ``logits`` rows: probabilities in float16, token ids in int32 (what training
    reads, whether the writer or teacher forcing computed them)."""
    p, ix = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return p.half(), ix.int()


def _by_rows(items: list[tuple[int, int]], budget: int) -> list[list[int]]:
    """``items`` (id, rows) in order, grouped so that each group's rows stay within ``budget`` (one item at least)."""
    groups, rows = [[]], 0
    for i, n in items:
        if groups[-1] and rows + n > budget:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += n
    return groups


def _advance(gen: Generator, result) -> tuple[bool, object]:
    """Hand a corpus task (a generator of ``Job``s) the result of its last job, or start it (``result`` None):
    ``(False, its next Job)``, or ``(True, the value it returned)``."""
    try:
        return False, (gen.send(result) if result is not None else next(gen))
    except StopIteration as stop:
        return True, stop.value


class _Writer:
    """Builds prompts from chat turns through the target's template and samples batches on the target's batched
    forward, keeping (when asked) what training reads: every position's features and the target's top-k laws."""

    MARK = "\x00VERISPEC\x00"

    def __init__(self, target, layers: tuple[int, ...] | None = None, top_k: int = 64, max_batch: int = SLOTS,
                 capacity: int = 0, seed: int = 0):
        self.target = target
        self.tok = target.tokenizer
        if self.tok is None:
            raise VerispecError("self-generated training data needs the target's tokenizer")
        self.chat = bool(getattr(self.tok, "chat_template", None))
        self.layers, self.top_k, self.max_batch = layers, top_k, max_batch
        self.capacity = capacity  # cache entries a state holds at least (so that a pool made once fits every job)
        self.generator = torch.Generator().manual_seed(seed)  # the draws' random numbers
        self._pool, self._pool_size = None, (0, 0)

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([t for t in ids if t not in self.target.eos_token_ids], skip_special_tokens=True).strip()

    def prompt(self, turns: list[str]) -> list[int]:
        """Token ids of alternating user/assistant ``turns`` (user first) ready for the assistant's answer."""
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return self.ids(self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))[-MAX_PROMPT:]

    def user_start(self, turns: list[str], opening: str) -> list[int]:
        """Token ids of ``turns`` followed by a new user turn that begins with ``opening`` (the target finishes it)."""
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        text = self.tok.apply_chat_template(msgs + [{"role": "user", "content": self.MARK}], tokenize=False)
        if self.MARK not in text:
            raise VerispecError("the chat template drops the user's message; cannot write training data with it")
        return self.ids(text[: text.index(self.MARK)] + opening)[-MAX_PROMPT:]

    def _states(self, slots: int, capacity: int):
        """A pool of ``slots`` states of ``capacity`` entries, kept between calls while it is large enough (it is
        made again, larger, only while no sequence holds one of its states)."""
        if slots > self._pool_size[0] or capacity > self._pool_size[1]:
            size = (max(slots, self._pool_size[0]), max(capacity, self._pool_size[1]))
            self._pool, self._pool_size = None, (0, 0)  # free the old buffers before the new ones are made
            self._pool, self._pool_size = self.target.state_pool(*size), size
        return self._pool

    def sample(self, prompts: list[list[int]], max_new: int, temperature: float,
               labels_from: list[int] | None = None) -> tuple[list[list[int]], list[dict | None]]:
        """One continuation per prompt, cut after its first end-of-sequence token, and with ``labels_from`` (one
        index per prompt) what training reads of each whole sequence: its features (the ``layers``' hidden states,
        every position, float16) and the target's top-k next-token law at positions ``labels_from[i]`` onwards.
        One ``Job`` through ``run`` (which see)."""
        def one():
            return (yield Job(prompts, max_new, temperature, labels_from))

        ((_, result),) = self.run(iter([one()]))
        return result

    @torch.inference_mode()
    def run(self, tasks: Iterator[Generator], at_once: int = 1) -> Iterator[tuple[int, object]]:
        """Drive ``tasks``, generators that each yield ``Job``s and receive each one's ``(continuations, data)`` (see
        ``sample``), on one continuous batch; yields ``(i, value)`` as the i-th task returns ``value``.

        Up to ``max_batch`` sequences decode together on ``Target.forward_batch``; a finished one frees its slot and
        the next waiting prompt is prefilled into it. Up to ``at_once`` tasks are in flight: another one starts when
        no prompt is waiting and a slot is free, so that one task's last long answers (a stage waits for all its
        answers) decode beside the next task's prompts instead of alone. Every sequence is drawn from the target at
        its own job's temperature, whatever it shares a step with. The features come with the tokens at no extra
        forward (a finished sequence runs its last token once more for that token's features): a sequence's rows do
        not depend on the batch beside them (the lean forward's invariance, docs/design.md), so they are the
        teacher-forced features of the finished text. Draws are inverse-CDF lookups over the batch."""
        t, eos = self.target, self.target.eos_token_ids
        tasks = enumerate(tasks)
        flight: dict[int, tuple[Generator, _Running]] = {}  # task -> (its generator, its running job)
        waiting: list[_Seq] = []
        live: list[_Seq] = []
        more = True

        def give(i: int, gen: Generator, result) -> Iterator[tuple[int, object]]:
            done, job = _advance(gen, result)
            if done:
                flight.pop(i, None)
                yield i, job
                return
            running = _Running(job, self.layers is not None and job.labels_from is not None)
            flight[i] = (gen, running)
            waiting.extend(running.seqs)
            if not job.prompts:  # nothing to sample: done at once
                yield from give(i, gen, running.result(self.top_k))

        def finished(s: _Seq) -> Iterator[tuple[int, object]]:
            if s.state is not None:
                release(s.state)
                s.state = None
            s.running.left -= 1
            if s.running.left == 0:
                i = next(i for i, (_, r) in flight.items() if r is s.running)
                yield from give(i, flight[i][0], s.running.result(self.top_k))

        pool = release = acquire = None
        while True:
            while more and len(flight) < at_once and not waiting and len(live) < self.max_batch:
                nxt = next(tasks, None)
                if nxt is None:
                    more = False
                    break
                yield from give(nxt[0], nxt[1], None)
            if not waiting and not live:  # every task in flight has a job with sequences: none is in flight
                if not more:
                    return
                continue
            free = self.max_batch - len(live)
            need = max((s.need for s in waiting[:free]), default=0)
            if waiting and free and (pool is None or need > self._pool_size[1]) and not live:
                pool = self._states(self.max_batch, max(need, self.capacity))
                acquire = pool.acquire if pool is not None else t.new_state
                release = pool.release if pool is not None else (lambda s: None)
            fits = [s for s in waiting[:free] if pool is None or s.need <= self._pool_size[1]]
            if fits:
                for s in fits:
                    waiting.remove(s)
                done: list[_Seq] = []
                for part in _by_rows([(k, len(s.prompt)) for k, s in enumerate(fits)], PREFILL_ROWS):
                    seqs = [fits[k] for k in part]
                    lens = [len(s.prompt) for s in seqs]
                    for s in seqs:
                        s.state = acquire()
                    firsts = [min(s.labels_from, m - 1) if s.keep else m - 1 for s, m in zip(seqs, lens)]
                    res = t.forward_batch([s.state for s in seqs], [torch.tensor(s.prompt) for s in seqs],
                                          [torch.arange(m) for m in lens],
                                          [torch.ones(m, m, dtype=torch.bool).tril() for m in lens],
                                          features=self._features(seqs),
                                          logits_from=firsts)
                    for s, o, m in zip(seqs, res, lens):
                        t.commit(s.state, list(range(m)))
                        if s.keep:
                            s.feats.append(o.hidden.half())
                    self._labels([(s, o.logits) for s, o in zip(seqs, res) if s.keep])
                    done += self._draw(seqs, torch.cat([o.logits[-1:] for o in res]), eos)
                live += fits
                for s in done:
                    if not s.keep:  # no features wanted: its last token need not run
                        live.remove(s)
                        yield from finished(s)
                continue
            if not live:  # the waiting prompts need a larger pool: wait for nothing (none is live)
                continue
            res = t.forward_batch([s.state for s in live], [torch.tensor(s.out[-1:]) for s in live],
                                  [torch.tensor([len(s.prompt) + len(s.out) - 1]) for s in live],
                                  [torch.ones(1, 1, dtype=torch.bool)] * len(live), features=self._features(live))
            for s, o in zip(live, res):
                t.commit(s.state, [0])
                if s.keep:
                    s.feats.append(o.hidden.half())
            going = [(s, o) for s, o in zip(live, res) if not s.closing]
            ended = [s for s in live if s.closing]  # its last token has run: done
            live = [s for s, _ in going]
            for s in ended:
                yield from finished(s)
            if going:
                self._labels([(s, o.logits) for s, o in going if s.keep])
                for s in self._draw([s for s, _ in going], torch.cat([o.logits for _, o in going]), eos):
                    if not s.keep:
                        live.remove(s)
                        yield from finished(s)

    def _features(self, seqs: list[_Seq]) -> tuple[int, ...]:
        return self.layers if any(s.keep for s in seqs) else (-1,)

    def _labels(self, rows: list[tuple[_Seq, torch.Tensor]]) -> None:
        """The top-k laws of each sequence's ``logits`` rows, in one softmax and one top-k over all of them."""
        if rows:
            p, ix = _top_labels(torch.cat([lg for _, lg in rows]), self.top_k)
            sizes = [int(lg.shape[0]) for _, lg in rows]
            for (s, _), pp, ii in zip(rows, p.split(sizes), ix.split(sizes)):
                s.probs.append(pp)
                s.index.append(ii)

    def _draw(self, seqs: list[_Seq], logits: torch.Tensor, eos) -> list[_Seq]:
        """Each sequence's next token at its own temperature (greedy at 0); returns those that just finished."""
        temps = torch.tensor([s.running.spec.temperature for s in seqs])
        hot = torch.nonzero(temps > 0).flatten()
        tok = torch.zeros(len(seqs), dtype=torch.long)
        cold = torch.nonzero(temps <= 0).flatten()
        if len(cold):  # max's indices are argmax's (the first largest), at a third of its cost here
            tok[cold] = logits[cold].max(-1).indices
        if len(hot):
            cdf = torch.softmax(logits[hot].float() / temps[hot, None], dim=-1).cumsum(-1)
            u = torch.rand(len(hot), 1, generator=self.generator) * cdf[:, -1:]
            tok[hot] = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
        closed = []
        for s, v in zip(seqs, tok.tolist()):
            s.out.append(v)
            if v in eos or len(s.out) == s.running.spec.max_new:
                s.closing = True
                closed.append(s)
        return closed


class _RowTemperature:
    """A logits processor for ``generate``: each row of the batch at its own temperature, a row at 0 reduced to its
    argmax (sampling it then draws the argmax, the first largest, as greedy decoding does)."""

    def __init__(self, temperatures: torch.Tensor):
        self.t = temperatures

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        hot = (self.t > 0)[:, None]
        warm = scores / torch.where(hot, self.t[:, None], torch.ones_like(self.t[:, None]))
        greedy = torch.full_like(scores, float("-inf")).scatter_(1, scores.argmax(-1, keepdim=True), 0.0)
        return torch.where(hot, warm, greedy)


class _GenerateWriter(_Writer):
    """A writer of text only that samples its jobs with Hugging Face ``generate`` on statically padded batches (left
    padding), every job of every round in flight in one pool: for a target on a GPU, where ``generate`` keeps one
    cache tensor per layer for the whole batch and ``Target.forward_batch`` of the stock forward copies every
    sequence's cache each step. Each row is drawn from the target at its own job's temperature with no top-k or
    top-p (``_RowTemperature``), cut after its first end-of-sequence token or at its job's ``max_new``: the target's
    law, as ``_Writer``'s. Its draws come from torch's generator on the target's device, seeded per pool; a round is
    therefore not the same bytes as the CPU writer's (or as another pool's), only the same law."""

    def __init__(self, target, max_batch: int = 512, budget: int = 1 << 20, seed: int = 0):
        super().__init__(target, None, 64, max_batch, seed=seed)
        self.seed = seed
        self.budget = budget  # padded rows x (prompt + new tokens) a generate call holds at most
        self.pools = 0

    def run(self, tasks: Iterator[Generator], at_once: int = 1) -> Iterator[tuple[int, object]]:
        """As ``_Writer.run``, but in ticks: every task in flight hands its next job, all of them are sampled
        together (``_generate``), and each task receives its own continuations (``data`` None: text only)."""
        tasks = enumerate(tasks)
        flight: dict[int, tuple[Generator, Job]] = {}
        more = True

        def give(i: int, gen: Generator, result) -> Iterator[tuple[int, object]]:
            while True:
                done, job = _advance(gen, result)
                if done:
                    flight.pop(i, None)
                    yield i, job
                    return
                if job.prompts:
                    flight[i] = (gen, job)
                    return
                result = ([], [])  # nothing to sample

        while True:
            while more and len(flight) < at_once:
                nxt = next(tasks, None)
                if nxt is None:
                    more = False
                    break
                yield from give(nxt[0], nxt[1], None)
            if not flight:
                return
            now = list(flight.items())
            outs = self._generate([(p, job.max_new, job.temperature) for _, (_, job) in now for p in job.prompts])
            at = 0
            for i, (gen, job) in now:
                n = len(job.prompts)
                yield from give(i, gen, (outs[at:at + n], [None] * n))
                at += n

    @torch.inference_mode()
    def _generate(self, items: list[tuple[list[int], int, float]]) -> list[list[int]]:
        """One continuation per ``(prompt, max_new, temperature)``: the items sorted by (max_new, prompt length) and
        cut into padded batches of at most ``max_batch`` rows and ``budget`` cache entries."""
        from transformers import GenerationConfig, LogitsProcessorList  # noqa: PLC0415 - a 0.7 s import

        hf, dev, eos = self.target.hf, self.target.device, sorted(self.target.eos_token_ids)
        pad = hf.generation_config.pad_token_id
        pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        order = sorted(range(len(items)), key=lambda k: (items[k][1], len(items[k][0])))
        batches, cur = [], []
        for k in order:
            width = max([len(items[j][0]) for j in cur + [k]]) + max(items[j][1] for j in cur + [k])
            if cur and (len(cur) == self.max_batch or (len(cur) + 1) * width > self.budget):
                batches.append(cur)
                cur = []
            cur.append(k)
        if cur:
            batches.append(cur)
        outs: list[list[int]] = [[] for _ in items]
        for b in batches:
            torch.manual_seed(self.seed * 100_000 + self.pools)
            self.pools += 1
            width = max(len(items[k][0]) for k in b)
            ids = torch.tensor([[pad] * (width - len(items[k][0])) + items[k][0] for k in b], device=dev)
            mask = torch.tensor([[0] * (width - len(items[k][0])) + [1] * len(items[k][0]) for k in b], device=dev)
            temps = torch.tensor([float(items[k][2]) for k in b], device=dev)
            config = GenerationConfig(max_new_tokens=max(items[k][1] for k in b), do_sample=True, temperature=1.0,
                                      top_k=0, top_p=1.0, repetition_penalty=1.0, eos_token_id=eos or None,
                                      pad_token_id=pad)
            got = hf.generate(ids, attention_mask=mask, generation_config=config,
                              logits_processor=LogitsProcessorList([_RowTemperature(temps)]))
            for k, row in zip(b, got[:, width:].tolist()):
                row = row[:items[k][1]]
                cut = next((j for j, v in enumerate(row) if v in self.target.eos_token_ids), None)
                outs[k] = row if cut is None else row[:cut + 1]
        return outs


@dataclass
class Job:
    """One batch of continuations a corpus stage asks for: ``prompts``, at most ``max_new`` new tokens each, at
    ``temperature``, and with ``labels_from`` (one position per prompt) what training reads (``_Writer.sample``)."""
    prompts: list[list[int]]
    max_new: int
    temperature: float
    labels_from: list[int] | None = None


class _Running:
    """A job being sampled: its sequences' outputs, and how many have not finished."""

    def __init__(self, spec: Job, keep: bool):
        self.spec, self.keep, self.left = spec, keep, len(spec.prompts)
        self.seqs = [_Seq(self, k) for k in range(len(spec.prompts))]

    def result(self, top_k: int) -> tuple[list[list[int]], list[dict | None]]:
        outs = [s.out for s in self.seqs]
        data: list[dict | None] = [None] * len(self.seqs)
        if self.keep:
            for k, s in enumerate(self.seqs):
                tokens = s.prompt + s.out
                lab_p = torch.zeros(len(tokens), top_k, dtype=torch.half)
                lab_i = torch.zeros(len(tokens), top_k, dtype=torch.int)
                first = min(s.labels_from, len(s.prompt) - 1)
                got_p, got_i = torch.cat(s.probs), torch.cat(s.index)
                lab_p[first:first + len(got_p)], lab_i[first:first + len(got_i)] = got_p, got_i
                data[k] = {"feat": torch.cat(s.feats), "p": lab_p, "i": lab_i, "tokens": torch.tensor(tokens)}
        return outs, data


class _Seq:
    """One prompt of a running job and its continuation so far."""

    def __init__(self, running: _Running, k: int):
        self.running, self.prompt, self.keep = running, running.spec.prompts[k], running.keep
        self.labels_from = running.spec.labels_from[k] if running.keep else None
        self.need = len(self.prompt) + running.spec.max_new + 1  # cache entries
        self.out: list[int] = []
        self.feats: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.index: list[torch.Tensor] = []
        self.state = None
        self.closing = False


def _answer(prompts: list[list[int]], temperature: float, limit: int = LIMITS["answer"],
           labels_from: list[int] | None = None, keep: bool = True):
    """Sample answers (a stage: yields its ``Job``); each record is prompt + answer with the answer as its one span
    (and, with ``keep``, what training reads of it, labels from ``labels_from`` on: by default the answer's
    positions)."""
    first = (labels_from or [len(p) - 1 for p in prompts]) if keep else None
    outs, data = yield Job(prompts, limit, temperature, first)
    return [Record(p + a, [[len(p), len(p) + len(a)]], "", -1, d) for p, a, d in zip(prompts, outs, data)]


def _finish_requests(w: _Writer, prefixes: list[list[int]], openings: list[str], limit: int):
    """The user requests the target writes after each opening (opening + its continuation); a stage."""
    outs, _ = yield Job(prefixes, limit, REQUEST_T)
    return [(o + ("" if o.endswith(" ") else " ") + w.text(c)).strip() if w.text(c) else o + " the weather"
            for o, c in zip(openings, outs)]


def _sentence(doc: str, rnd: random.Random) -> str:
    parts = [s.strip() for s in doc.replace("\n", " ").split(". ") if 20 <= len(s.strip()) <= 240]
    return (rnd.choice(parts).rstrip(".") + ".") if parts else doc[:200]


def _said(w: _Writer, r: Record) -> str:
    """The text of a record's (first) answer."""
    return w.text(r.tokens[r.spans[0][0]:r.spans[0][1]])


def _round(w: _Writer, shape: str, n: int, temperature: float, rnd: random.Random):
    """One round of ``shape`` on ``n`` items, a generator of its stages' ``Job``s (``_Writer.run``) that returns the
    records it produces (see the module docstring)."""
    if not w.chat:
        openings = [rnd.choice(FREE_OPENINGS) for _ in range(n)]
        bos = [w.tok.bos_token_id] if w.tok.bos_token_id is not None else []
        starts = [bos + w.ids(o) for o in openings]
        records = yield from _answer(starts, max(temperature, 0.6), LIMITS["document"])
        return records
    if shape == "chat":
        first = yield from _finish_requests(w, [w.user_start([], "") for _ in range(n)], [""] * n, LIMITS["request"])
        a1 = yield from _answer([w.prompt([u]) for u in first], temperature, keep=False)  # kept only inside the second
        replies = [_said(w, r) for r in a1]
        follow = yield from _finish_requests(w, [w.user_start([u, a], "") for u, a in zip(first, replies)], [""] * n,
                                  LIMITS["request"])
        prompts = [w.prompt([u, a, f]) for u, a, f in zip(first, replies, follow)]
        # one sequence, two assistant turns where the second prompt extends the first exchange (labels from the first)
        joined = [p[:len(r.tokens)] == r.tokens for p, r in zip(prompts, a1)]
        a2 = yield from _answer(prompts, temperature, labels_from=[r.spans[0][0] - 1 if j else len(p) - 1
                                                         for p, r, j in zip(prompts, a1, joined)])
        return [Record(r2.tokens, [r1.spans[0], r2.spans[0]], "", -1, r2.data) if j else r2
                for r1, r2, j in zip(a1, a2, joined)]
    if shape == "document":
        openings = [rnd.choice(OPENINGS["document"]) for _ in range(n)]
        requests = yield from _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        docs = yield from _answer([w.prompt([r]) for r in requests], REQUEST_T, LIMITS["document"])
        texts = [_said(w, d) or r for d, r in zip(docs, requests)]
        summaries = yield from _answer([w.prompt([f"Summarize: {t}"]) for t in texts], temperature, 160)
        questions = yield from _answer([w.prompt([f"Write one question that this text answers.\n\n{t}"]) for t in texts], REQUEST_T,
                             LIMITS["short"])
        asked = [_said(w, q) or "What is this text about?" for q in questions]
        rag = yield from _answer([w.prompt([f"{t}\n{q}"]) for t, q in zip(texts, asked)], temperature, 160)
        sentences = [_sentence(t, rnd) for t in texts]
        german = yield from _answer([w.prompt([f"Translate English to German: {s}"]) for s in sentences], temperature,
                          LIMITS["sentence"])
        back = yield from _answer([w.prompt([f"Translate German to English: {_said(w, g) or s}"])
                         for g, s in zip(german, sentences)], temperature, LIMITS["sentence"])
        return docs + summaries + questions + rag + german + back
    if shape == "edit":
        asks = [f"{rnd.choice(OPENINGS['edit'])} {rnd.choice(TOPICS)}." for _ in range(n)]
        texts = yield from _answer([w.prompt([a]) for a in asks], REQUEST_T, LIMITS["paragraph"])
        said = [_said(w, t) for t in texts]
        jobs = [(e, s) for s in said if s for e in rnd.sample(EDITS, 2)]
        edited = yield from _answer([w.prompt([e.format(s)]) for e, s in jobs], temperature, LIMITS["paragraph"])
        return texts + edited
    if shape == "instruct":
        openings = [rnd.choice(OPENINGS["instruct"]) for _ in range(n)]
        requests = yield from _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        answers = yield from _answer([w.prompt([r]) for r in requests], temperature)
        return answers
    if shape in ("qa", "math"):
        asks = yield from _answer([w.prompt([ASK[shape].format(rnd.choice(TOPICS))]) for _ in range(n)], REQUEST_T,
                        {"qa": LIMITS["short"], "math": 96}[shape])
        written = [_said(w, a) for a in asks]
        answers = yield from _answer([w.prompt([q]) for q in written if q], temperature)
        return asks + answers
    if shape == "code":
        openings = [rnd.choice(OPENINGS[shape]) for _ in range(n)]
        requests = yield from _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        answers = yield from _answer([w.prompt([r]) for r in requests], temperature)
        code = [_said(w, a) for a in answers]
        explained = yield from _answer([w.prompt([f"Explain what this code does:\n{c}"]) for c in code if c], temperature)
        return answers + explained
    raise VerispecError(f"unknown corpus shape {shape!r}; choose from {', '.join(SHAPES)}")


def text_path(folder: str | Path, rnd: int) -> Path:
    return Path(folder) / "text" / f"{rnd:05d}.jsonl.gz"


def features_path(folder: str | Path, rnd: int) -> Path:
    return Path(folder) / "features" / f"{rnd:05d}.pt"


def is_corpus(folder: str | Path) -> bool:
    return (Path(folder) / "text").is_dir()


def read_corpus(folder: str | Path) -> list[Record]:
    """The records of a corpus folder's complete rounds (``text/00000.jsonl.gz``, ``text/00001.jsonl.gz``, ... up to
    the first one missing), without their features (``round_features`` loads a round's)."""
    folder = Path(folder)
    if (folder / "corpus.jsonl").exists():
        raise VerispecError(f"{folder} holds a corpus of the older layout (one corpus.jsonl); use another folder")
    records, rnd = [], 0
    while text_path(folder, rnd).is_file():
        with gzip.open(text_path(folder, rnd), "rt", encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                records.append(Record(d["tokens"], d["spans"], d["shape"], d["round"]))
        rnd += 1
    return records


@torch.inference_mode()
def _teacher_forced(target, records: list[Record], top_k: int, layers: tuple[int, ...],
                    writer_labels: bool) -> list[dict]:
    """What training reads of ``records`` by teacher forcing: one prefill of them all on fresh caches (the target's
    own ``forward_batch``), each record's features ``[T, k H]`` (fp16, hidden-state indices ``layers``), top-k
    next-token laws ``p``, ``i`` and ``tokens``. Labels at every row, or with ``writer_labels`` where the writer keeps
    them (from the first response token's position to the last but one; zeros elsewhere). What the forwards that
    wrote the text kept, to rounding (the bits themselves where every product of both rounds alike: not across
    oneDNN's 33-row line, docs/design.md). Rows before the labels skip the target's output layer."""
    n = [len(r.tokens) for r in records]
    spans = [(max(r.spans[0][0] - 1, 0), m - 1) if writer_labels else (0, m) for r, m in zip(records, n)]
    with torch.device(target.device):  # a target on a GPU (train-draft --device): its inputs made there too
        outs = target.forward_batch([target.new_state() for _ in records], [torch.tensor(r.tokens) for r in records],
                                    [torch.arange(m) for m in n], [torch.ones(m, m, dtype=torch.bool).tril() for m in n],
                                    features=layers, logits_from=[lo for lo, _ in spans])
    data = []
    for r, m, o, (lo, hi) in zip(records, n, outs, spans):
        p, ix = torch.zeros(m, top_k, dtype=torch.half), torch.zeros(m, top_k, dtype=torch.int)
        top_p, top_i = _top_labels(o.logits[:hi - lo], top_k)
        p[lo:hi], ix[lo:hi] = top_p.cpu(), top_i.cpu()
        data.append({"feat": o.hidden.half().cpu(), "p": p, "i": ix, "tokens": torch.tensor(r.tokens)})
    return data


def features(target, record: Record | list[int], top_k: int, layers: tuple[int, ...] = (-1,)) -> dict:
    """The target's features, top-k next-token laws at every position and the response mask of one sequence, by
    teacher forcing (``_teacher_forced``)."""
    if isinstance(record, list):
        record = Record(record, [[1, len(record)]], "", -1)
    (data,) = _teacher_forced(target, [record], top_k, layers, writer_labels=False)
    return {**data, "mask": response_mask(record)}


def _replace(out: Path, write: Callable[[Path], None]) -> None:
    """``write`` a file at ``out`` whole or not at all: into a temporary file beside it, then a rename."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    write(tmp)
    os.replace(tmp, out)


def _save(obj, out: Path) -> None:
    _replace(out, lambda tmp: torch.save(obj, tmp))


def fill_features(target, folder: str | Path, records: list[Record], layers: tuple[int, ...], top_k: int,
                  progress: bool = True) -> None:
    """Compute the features file of every round of ``records`` that lacks one (a corpus whose text came without
    them, as a fresh checkout has it) by teacher forcing (``_teacher_forced``, up to ``PREFILL_ROWS`` rows a
    forward, labels where the writer keeps them), a round at a time, each kept as it is done."""
    by_round: dict[int, list[Record]] = {}
    for r in records:
        by_round.setdefault(r.round, []).append(r)
    missing = [rnd for rnd in sorted(by_round) if not features_path(folder, rnd).is_file()]
    if not missing:
        return
    from tqdm import tqdm  # noqa: PLC0415 - the progress bar of this stage only

    bar = tqdm(total=sum(len(r.tokens) for rnd in missing for r in by_round[rnd]), unit="token", unit_scale=True,
               desc=f"features of {len(missing)} rounds (teacher forcing)", disable=not progress)
    for rnd in missing:
        recs, blob = by_round[rnd], []
        for group in _by_rows([(i, len(r.tokens)) for i, r in enumerate(recs)], PREFILL_ROWS):
            blob += _teacher_forced(target, [recs[i] for i in group], top_k, layers, writer_labels=True)
            bar.update(sum(len(recs[i].tokens) for i in group))
        _save({"data": blob}, features_path(folder, rnd))
    bar.close()


def round_features(folder: str | Path, rnd: int, records: list[Record]) -> list[dict]:
    """What training reads of round ``rnd``'s ``records`` (in order): features ``feat [T, k H]``, labels ``p``,
    ``i [T, top k]``, ``tokens`` and the response ``mask``, from the round's features file (``fill_features``
    computes a missing one)."""
    path = features_path(folder, rnd)
    if not path.is_file():
        raise VerispecError(f"{path} is missing: the corpus holds round {rnd}'s text but not its features (run "
                            "'verispec train-draft' on it, which computes them)")
    blob = torch.load(path, map_location="cpu", weights_only=True)["data"]
    if len(blob) != len(records) or any(len(d["tokens"]) != len(r.tokens) for d, r in zip(blob, records)):
        raise VerispecError(f"{path} does not match round {rnd} of the corpus beside it")
    for d, r in zip(blob, records):
        d["mask"] = response_mask(r)
    return blob


def response_mask(record: Record) -> torch.Tensor:
    """``[T]`` bool: which tokens the target wrote as the assistant (the positions a head is judged on)."""
    mask = torch.zeros(len(record.tokens), dtype=torch.bool)
    for a, b in record.spans:
        mask[a:b] = True
    return mask


def write_corpus(target, folder: str | Path, config: CorpusConfig,
                 on_round: Callable[[int, list[Record]], None] | None = None, generate: bool | None = None,
                 deadline: float | None = None) -> list[Record]:
    """Generate (or resume) ``config.rounds`` rounds into ``folder``: each round's text ``text/NNNNN.jsonl.gz``,
    written last, after (with ``config.layers``) its features ``features/NNNNN.pt``; returns every record, without
    features. Up to ``ROUNDS_AT_ONCE`` rounds share the writer's batch (``_Writer.run``); they are written in order,
    a round finished early waiting in memory for the ones before it.

    ``generate`` (default: where the target is off the CPU) writes text only with ``_GenerateWriter``,
    ``GENERATE_ROUNDS_AT_ONCE`` rounds in flight; ``fill_features`` computes their features afterwards. No round
    begins after ``deadline`` (a ``time.time()``); the rounds begun are finished and kept."""
    folder = Path(folder)
    records = read_corpus(folder)
    done = max((r.round for r in records), default=-1) + 1
    seen = {hash(tuple(r.tokens)) for r in records}
    if generate is None:
        generate = target.device.type != "cpu"
    if generate:
        w = _GenerateWriter(target, seed=config.seed * 1_000_003 + done)
        config, at_once = replace(config, layers=None), GENERATE_ROUNDS_AT_ONCE
    else:
        w = _Writer(target, config.layers, config.top_k, SLOTS, capacity=MAX_PROMPT + max(LIMITS.values()) + 1)
        at_once = ROUNDS_AT_ONCE
    todo = list(range(done, config.rounds))
    finished: dict[int, list[Record]] = {}
    begun = (_round_task(w, config, rnd_i) for rnd_i in todo if deadline is None or time.time() < deadline)
    for i, made in w.run(begun, at_once=at_once):
        finished[todo[i]] = made
        while done in finished:
            new = []
            for r in finished.pop(done):
                key = hash(tuple(r.tokens))
                if key not in seen:
                    seen.add(key)
                    new.append(r)
            if config.layers is not None:
                _save({"data": [{k: v for k, v in r.data.items()} for r in new]}, features_path(folder, done))
            text = gzip.compress("".join(r.to_json() + "\n" for r in new).encode(), mtime=0)  # no time: its bytes
            _replace(text_path(folder, done), lambda tmp, text=text: tmp.write_bytes(text))
            if generate:  # which rounds another writer made (the others: config.json's written_by, the batch writer)
                with (folder / "writers.jsonl").open("a") as f:
                    f.write(json.dumps({"round": done, "writer": "generate", "forward": target.forward_id}) + "\n")
            for r in new:
                r.data = None
            records += new
            if on_round is not None:
                on_round(done, new)
            done += 1
    return records


def _round_task(w: _Writer, config: CorpusConfig, rnd_i: int):
    """Round ``rnd_i`` as a task of ``_Writer.run``: its shape and answer temperature by its number, its choices
    (openings, topics, edits) and draws seeded by it; returns its records."""
    rnd = random.Random(config.seed * 1_000_003 + rnd_i)
    w.generator.manual_seed(config.seed * 1_000_003 + rnd_i)  # one round at a time: its draws follow from its number
    shape = CYCLE[rnd_i % len(CYCLE)]
    temperature = config.answer_temperatures[rnd_i % len(config.answer_temperatures)]
    made = yield from _round(w, shape, config.batch, temperature, rnd)
    return [Record(r.tokens, r.spans, shape, rnd_i, r.data) for r in made
            if len(r.tokens) > 2 and r.spans and r.spans[0][1] > r.spans[0][0]]
