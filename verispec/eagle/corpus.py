"""Training text the target writes itself, in the shapes of the tasks a draft head meets (never their questions),
with what training reads of it.

Each *round* runs one task shape on a batch of items, every stage one batch on the target's batched forward:

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
without text, keeping the rounds it has. Each round is seeded by its number, though the writer is not deterministic
from run to run on the default model (docs/design.md), so a round written again may differ.

Without a chat template (a base model) every round is free text: the target continues an opening.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
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


class _Writer:
    """Builds prompts from chat turns through the target's template and samples batches on the target's batched
    forward, keeping (when asked) what training reads: every position's features and the target's top-k laws."""

    MARK = "\x00VERISPEC\x00"

    def __init__(self, target, layers: tuple[int, ...] | None = None, top_k: int = 64, max_batch: int = SLOTS):
        self.target = target
        self.tok = target.tokenizer
        if self.tok is None:
            raise VerispecError("self-generated training data needs the target's tokenizer")
        self.chat = bool(getattr(self.tok, "chat_template", None))
        self.layers, self.top_k, self.max_batch = layers, top_k, max_batch
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
        """A pool of ``slots`` states of ``capacity`` entries, kept between calls while it is large enough."""
        if slots > self._pool_size[0] or capacity > self._pool_size[1]:
            size = (max(slots, self._pool_size[0]), max(capacity, self._pool_size[1]))
            self._pool, self._pool_size = None, (0, 0)  # free the old buffers before the new ones are made
            self._pool, self._pool_size = self.target.state_pool(*size), size
        return self._pool

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], max_new: int, temperature: float,
               labels_from: list[int] | None = None) -> tuple[list[list[int]], list[dict | None]]:
        """One continuation per prompt, cut after its first end-of-sequence token, and with ``labels_from`` (one
        index per prompt) what training reads of each whole sequence: its features (the ``layers``' hidden states,
        every position, float16) and the target's top-k next-token law at positions ``labels_from[i]`` onwards.

        Continuous batching on ``Target.forward_batch``: up to ``max_batch`` sequences decode together, a finished
        one frees its slot and the next prompt is prefilled into it. The features come with the tokens at no
        extra forward (a finished sequence runs its last token once more for that token's features): a sequence's
        rows do not depend on the batch beside them (the lean forward's invariance), so they are the teacher-forced
        features of the finished text. Draws are inverse-CDF lookups over the batch (one ``torch.rand`` per step)."""
        t, n = self.target, len(prompts)
        keep = labels_from is not None and self.layers is not None
        layers = self.layers if keep else (-1,)
        eos = t.eos_token_ids
        pool = self._states(min(n, self.max_batch), max(len(p) for p in prompts) + max_new + 1)
        acquire = pool.acquire if pool is not None else t.new_state
        release = pool.release if pool is not None else (lambda s: None)
        out: list[list[int]] = [[] for _ in prompts]
        feats: list[list[torch.Tensor]] = [[] for _ in prompts]
        probs: list[list[torch.Tensor]] = [[] for _ in prompts]
        index: list[list[torch.Tensor]] = [[] for _ in prompts]
        waiting = list(range(n))[::-1]
        live: dict[int, object] = {}  # prompt index -> its state
        closing: set[int] = set()  # finished; its last token runs once more for its features

        def labels(ids: list[int], logits: list[torch.Tensor]) -> None:
            """The top-k laws of each of ``ids``' rows ``logits``, in one softmax and one top-k over all of them."""
            if keep:
                p, ix = torch.softmax(torch.cat(logits), dim=-1).topk(self.top_k, dim=-1)
                sizes = [int(x.shape[0]) for x in logits]
                for i, pp, ii in zip(ids, p.half().split(sizes), ix.int().split(sizes)):
                    probs[i].append(pp)
                    index[i].append(ii)

        def draw(rows: list[int], logits: torch.Tensor) -> None:
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                cdf = torch.softmax(logits / temperature, dim=-1).cumsum(-1)
                u = torch.rand(len(rows), 1) * cdf[:, -1:]
                tok = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
            for i, v in zip(rows, tok.tolist()):
                out[i].append(v)
                if v in eos or len(out[i]) == max_new:
                    closing.add(i)

        while waiting or live:
            new = [waiting.pop() for _ in range(min(len(waiting), self.max_batch - len(live)))]
            if new:  # prefill the newcomers in one forward, a few thousand rows at a time
                for part in _by_rows([(i, len(prompts[i])) for i in new], PREFILL_ROWS):
                    states = [acquire() for _ in part]
                    lens = [len(prompts[i]) for i in part]
                    first = [min(labels_from[i], m - 1) if keep else m - 1 for i, m in zip(part, lens)]
                    res = t.forward_batch(states, [torch.tensor(prompts[i]) for i in part],
                                          [torch.arange(m) for m in lens],
                                          [torch.ones(m, m, dtype=torch.bool).tril() for m in lens], features=layers,
                                          last_logits_only=[f == m - 1 for f, m in zip(first, lens)])
                    for i, s, o, m in zip(part, states, res, lens):
                        t.commit(s, list(range(m)))
                        live[i] = s
                        if keep:
                            feats[i].append(o.hidden.half())
                    labels(part, [o.logits[f - m:] for o, m, f in zip(res, lens, first)])  # rows f..m-1
                    draw(part, torch.cat([o.logits[-1:] for o in res]))
                for i in [i for i in new if i in closing and not keep]:
                    release(live.pop(i))
                continue
            rows = list(live)
            states = [live[i] for i in rows]
            res = t.forward_batch(states, [torch.tensor(out[i][-1:]) for i in rows],
                                  [torch.tensor([len(prompts[i]) + len(out[i]) - 1]) for i in rows],
                                  [torch.ones(1, 1, dtype=torch.bool)] * len(rows), features=layers)
            for i, s, o in zip(rows, states, res):
                t.commit(s, [0])
                if keep:
                    feats[i].append(o.hidden.half())
            going = [b for b, i in enumerate(rows) if i not in closing]
            for i in [i for i in rows if i in closing]:  # its last token has run: done
                release(live.pop(i))
            if going:
                labels([rows[b] for b in going], [res[b].logits for b in going])
                draw([rows[b] for b in going], torch.cat([res[b].logits for b in going]))
            for i in [rows[b] for b in going if rows[b] in closing and not keep]:
                release(live.pop(i))
        data: list[dict | None] = [None] * n
        if keep:
            k = self.top_k
            for i, p in enumerate(prompts):
                tokens = p + out[i]
                lab_p, lab_i = torch.zeros(len(tokens), k, dtype=torch.half), torch.zeros(len(tokens), k, dtype=torch.int)
                first = min(labels_from[i], len(p) - 1)
                got_p, got_i = torch.cat(probs[i]), torch.cat(index[i])
                lab_p[first:first + len(got_p)], lab_i[first:first + len(got_i)] = got_p, got_i
                data[i] = {"feat": torch.cat(feats[i]), "p": lab_p, "i": lab_i, "tokens": torch.tensor(tokens)}
        return out, data

    def answer(self, prompts: list[list[int]], temperature: float, limit: int = LIMITS["answer"],
               labels_from: list[int] | None = None, keep: bool = True) -> list[Record]:
        """Sample answers; each record is prompt + answer with the answer as its one span (and, with ``keep``, what
        training reads of it, labels from ``labels_from`` on: by default the answer's positions)."""
        first = (labels_from or [len(p) - 1 for p in prompts]) if keep else None
        outs, data = self.sample(prompts, limit, temperature, first)
        return [Record(p + a, [[len(p), len(p) + len(a)]], "", -1, d) for p, a, d in zip(prompts, outs, data)]


def _finish_requests(w: _Writer, prefixes: list[list[int]], openings: list[str], limit: int) -> list[str]:
    """The user requests the target writes after each opening (opening + its continuation)."""
    outs, _ = w.sample(prefixes, limit, REQUEST_T)
    return [(o + ("" if o.endswith(" ") else " ") + w.text(c)).strip() if w.text(c) else o + " the weather"
            for o, c in zip(openings, outs)]


def _sentence(doc: str, rnd: random.Random) -> str:
    parts = [s.strip() for s in doc.replace("\n", " ").split(". ") if 20 <= len(s.strip()) <= 240]
    return (rnd.choice(parts).rstrip(".") + ".") if parts else doc[:200]


def _said(w: _Writer, r: Record) -> str:
    """The text of a record's (first) answer."""
    return w.text(r.tokens[r.spans[0][0]:r.spans[0][1]])


def _round(w: _Writer, shape: str, n: int, temperature: float, rnd: random.Random) -> list[Record]:
    """One round of ``shape`` on ``n`` items: the records it produces (see the module docstring)."""
    if not w.chat:
        openings = [rnd.choice(FREE_OPENINGS) for _ in range(n)]
        bos = [w.tok.bos_token_id] if w.tok.bos_token_id is not None else []
        starts = [bos + w.ids(o) for o in openings]
        return w.answer(starts, max(temperature, 0.6), LIMITS["document"])
    if shape == "chat":
        first = _finish_requests(w, [w.user_start([], "") for _ in range(n)], [""] * n, LIMITS["request"])
        a1 = w.answer([w.prompt([u]) for u in first], temperature, keep=False)  # kept only inside the second
        replies = [_said(w, r) for r in a1]
        follow = _finish_requests(w, [w.user_start([u, a], "") for u, a in zip(first, replies)], [""] * n,
                                  LIMITS["request"])
        prompts = [w.prompt([u, a, f]) for u, a, f in zip(first, replies, follow)]
        # one sequence, two assistant turns where the second prompt extends the first exchange (labels from the first)
        joined = [p[:len(r.tokens)] == r.tokens for p, r in zip(prompts, a1)]
        a2 = w.answer(prompts, temperature, labels_from=[r.spans[0][0] - 1 if j else len(p) - 1
                                                         for p, r, j in zip(prompts, a1, joined)])
        return [Record(r2.tokens, [r1.spans[0], r2.spans[0]], "", -1, r2.data) if j else r2
                for r1, r2, j in zip(a1, a2, joined)]
    if shape == "document":
        openings = [rnd.choice(OPENINGS["document"]) for _ in range(n)]
        requests = _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        docs = w.answer([w.prompt([r]) for r in requests], REQUEST_T, LIMITS["document"])
        texts = [_said(w, d) or r for d, r in zip(docs, requests)]
        summaries = w.answer([w.prompt([f"Summarize: {t}"]) for t in texts], temperature, 160)
        questions = w.answer([w.prompt([f"Write one question that this text answers.\n\n{t}"]) for t in texts], REQUEST_T,
                             LIMITS["short"])
        asked = [_said(w, q) or "What is this text about?" for q in questions]
        rag = w.answer([w.prompt([f"{t}\n{q}"]) for t, q in zip(texts, asked)], temperature, 160)
        sentences = [_sentence(t, rnd) for t in texts]
        german = w.answer([w.prompt([f"Translate English to German: {s}"]) for s in sentences], temperature,
                          LIMITS["sentence"])
        back = w.answer([w.prompt([f"Translate German to English: {_said(w, g) or s}"])
                         for g, s in zip(german, sentences)], temperature, LIMITS["sentence"])
        return docs + summaries + questions + rag + german + back
    if shape == "edit":
        asks = [f"{rnd.choice(OPENINGS['edit'])} {rnd.choice(TOPICS)}." for _ in range(n)]
        texts = w.answer([w.prompt([a]) for a in asks], REQUEST_T, LIMITS["paragraph"])
        said = [_said(w, t) for t in texts]
        jobs = [(e, s) for s in said if s for e in rnd.sample(EDITS, 2)]
        return texts + w.answer([w.prompt([e.format(s)]) for e, s in jobs], temperature, LIMITS["paragraph"])
    if shape == "instruct":
        openings = [rnd.choice(OPENINGS["instruct"]) for _ in range(n)]
        requests = _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        return w.answer([w.prompt([r]) for r in requests], temperature)
    if shape in ("qa", "math"):
        asks = w.answer([w.prompt([ASK[shape].format(rnd.choice(TOPICS))]) for _ in range(n)], REQUEST_T,
                        {"qa": LIMITS["short"], "math": 96}[shape])
        written = [_said(w, a) for a in asks]
        return asks + w.answer([w.prompt([q]) for q in written if q], temperature)
    if shape == "code":
        openings = [rnd.choice(OPENINGS[shape]) for _ in range(n)]
        requests = _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        answers = w.answer([w.prompt([r]) for r in requests], temperature)
        code = [_said(w, a) for a in answers]
        explained = w.answer([w.prompt([f"Explain what this code does:\n{c}"]) for c in code if c], temperature)
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
    oneDNN's 33-row line, docs/design.md)."""
    n = [len(r.tokens) for r in records]
    outs = target.forward_batch([target.new_state() for _ in records], [torch.tensor(r.tokens) for r in records],
                                [torch.arange(m) for m in n], [torch.ones(m, m, dtype=torch.bool).tril() for m in n],
                                features=layers)
    data = []
    for r, m, o in zip(records, n, outs):
        lo, hi = (max(r.spans[0][0] - 1, 0), m - 1) if writer_labels else (0, m)
        p, ix = torch.zeros(m, top_k, dtype=torch.half), torch.zeros(m, top_k, dtype=torch.int)
        top = torch.softmax(o.logits[lo:hi].float(), dim=-1).topk(top_k, dim=-1)
        p[lo:hi], ix[lo:hi] = top.values.half(), top.indices.int()
        data.append({"feat": o.hidden.half(), "p": p, "i": ix, "tokens": torch.tensor(r.tokens)})
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
                 on_round: Callable[[int, list[Record]], None] | None = None) -> list[Record]:
    """Generate (or resume) ``config.rounds`` rounds into ``folder``: each round's text ``text/NNNNN.jsonl.gz``,
    written last, after (with ``config.layers``) its features ``features/NNNNN.pt``; returns every record, without
    features."""
    folder = Path(folder)
    records = read_corpus(folder)
    done = max((r.round for r in records), default=-1) + 1
    seen = {hash(tuple(r.tokens)) for r in records}
    w = _Writer(target, config.layers, config.top_k, SLOTS)
    for rnd_i in range(done, config.rounds):
        new = []
        for r in _rounds_from(w, config, rnd_i):
            key = hash(tuple(r.tokens))
            if key not in seen:
                seen.add(key)
                new.append(r)
        if config.layers is not None:
            _save({"data": [{k: v for k, v in r.data.items()} for r in new]}, features_path(folder, rnd_i))
        text = gzip.compress("".join(r.to_json() + "\n" for r in new).encode(), mtime=0)  # no time: a round, its bytes
        _replace(text_path(folder, rnd_i), lambda tmp, text=text: tmp.write_bytes(text))
        for r in new:
            r.data = None
        records += new
        if on_round is not None:
            on_round(rnd_i, new)
    return records


def _rounds_from(w: _Writer, config: CorpusConfig, rnd_i: int):
    torch.manual_seed(config.seed * 1_000_003 + rnd_i)
    rnd = random.Random(config.seed * 1_000_003 + rnd_i)
    shape = CYCLE[rnd_i % len(CYCLE)]
    temperature = config.answer_temperatures[rnd_i % len(config.answer_temperatures)]
    for r in _round(w, shape, config.batch, temperature, rnd):
        if len(r.tokens) > 2 and r.spans and r.spans[0][1] > r.spans[0][0]:
            yield Record(r.tokens, r.spans, shape, rnd_i, r.data)
