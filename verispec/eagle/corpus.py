"""Training text the target writes itself, in the shapes of the tasks a draft head meets (never their questions).

Each *round* runs one task shape on a batch of items, every stage batched through Hugging Face ``generate``:

* ``chat``: the target writes a user turn from an empty one, answers it, writes a follow-up turn and answers it
  (two assistant turns in one sequence, like a multi-turn conversation);
* ``document``: the target completes a request such as "Write a news article about ...", writes the document,
  then (each its own sequence) summarises it (``Summarize: DOC``), writes a question about it and answers it with
  the document in the prompt (retrieval-augmented QA), translates one of its sentences into German and the German
  back into English (``Translate German to English: ...``);
* ``qa``: asked for "a trivia question about TOPIC", the target writes one; the question alone is then the user
  turn, and the target answers it;
* ``math``: likewise with "a short math word problem about TOPIC", then solved;
* ``code``: a programming request begun by an opening such as "Write a Python function that", answered, then
  the answer explained (``Explain what this code does: ...``).

Openings and topics are generic words written for this module; the target writes every request, document and
answer itself. Requests and documents are sampled at temperature ``REQUEST_T``; answers at temperatures that
cycle over ``answer_temperatures`` round by round (greedy included: the text a temperature-0 run sees). A record is ``{"tokens", "spans",
"shape", "round"}``; ``spans`` are the ``[start, end)`` token ranges the target wrote as the assistant, the only
positions a draft head is trained and evaluated on. A round's records are appended together, so a corpus
resumes at its first unfinished round, and a corpus of n rounds is the first n rounds of any longer one with
the same options (each round is seeded by its number).

Without a chat template (a base model) every round is free text: the target continues an opening.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import VerispecError

SHAPES = ("chat", "document", "qa", "math", "code")
CYCLE = ("chat", "document", "qa", "math", "document", "code", "chat", "math", "document", "qa")  # round -> shape

OPENINGS = {
    "document": ["Write a news article about", "Write a short story about", "Write a blog post about",
                 "Write an encyclopedia entry about", "Write a report about", "Write a product review of",
                 "Write a travel guide to", "Write a biography of", "Write a history of", "Write an essay about"],
    "code": ["Write a Python function that", "Write a Python program that", "Write a JavaScript function that",
             "Write a SQL query that", "Write a Python class that", "Write a shell script that",
             "Write a C function that", "Write a regular expression that"],
}
TOPICS = ["apples", "a bakery", "a road trip", "the ocean", "a football team", "a library", "money", "a garden",
          "planets", "a birthday party", "trains", "a school", "cooking", "music", "animals", "a city", "history",
          "computers", "a farm", "the weather", "movies", "a hospital", "books", "rivers", "a shop", "painting",
          "mountains", "a bicycle", "chemistry", "a wedding", "elections", "a museum", "insects", "a restaurant",
          "the moon", "a factory", "languages", "a hotel", "basketball", "medicine"]
ASK = {"qa": "Write one trivia question about {}. Write only the question.",
       "math": "Write a short math word problem about {}. Write only the problem, not the solution."}
FREE_OPENINGS = ["The", "In", "Once upon a time", "Today", "def ", "Question:", "Chapter 1", "A new study"]

REQUEST_T = 0.8
LIMITS = {"request": 40, "document": 320, "answer": 192, "short": 40, "sentence": 80}


@dataclass(frozen=True)
class CorpusConfig:
    rounds: int = 64
    batch: int = 64
    seed: int = 0
    answer_temperatures: tuple[float, ...] = (0.0, 0.6, 1.0)


@dataclass
class Record:
    tokens: list[int]
    spans: list[list[int]]
    shape: str
    round: int

    def to_json(self) -> str:
        return json.dumps({"tokens": self.tokens, "spans": self.spans, "shape": self.shape, "round": self.round})


class _Writer:
    """Builds prompts from chat turns through the target's template and samples batches."""

    MARK = "\x00VERISPEC\x00"

    def __init__(self, target):
        self.target = target
        self.tok = target.tokenizer
        if self.tok is None:
            raise VerispecError("self-generated training data needs the target's tokenizer")
        self.chat = bool(getattr(self.tok, "chat_template", None))

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def text(self, ids: list[int]) -> str:
        return self.tok.decode([t for t in ids if t not in self.target.eos_token_ids], skip_special_tokens=True).strip()

    def prompt(self, turns: list[str]) -> list[int]:
        """Token ids of alternating user/assistant ``turns`` (user first) ready for the assistant's answer."""
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        return self.ids(self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))

    def user_start(self, turns: list[str], opening: str) -> list[int]:
        """Token ids of ``turns`` followed by a new user turn that begins with ``opening`` (the target finishes it)."""
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
        text = self.tok.apply_chat_template(msgs + [{"role": "user", "content": self.MARK}], tokenize=False)
        if self.MARK not in text:
            raise VerispecError("the chat template drops the user's message; cannot write training data with it")
        return self.ids(text[: text.index(self.MARK)] + opening)

    @torch.inference_mode()
    def sample(self, prompts: list[list[int]], max_new: int, temperature: float) -> list[list[int]]:
        """One continuation per prompt, cut after the first end-of-sequence token.

        A batched loop of its own rather than ``generate``: rows that finished leave the batch (and the KV cache),
        and a draw is one inverse-CDF lookup (``generate``'s multinomial cost 85 ms per step for 64 rows here)."""
        from transformers import DynamicCache  # noqa: PLC0415 - a 0.7 s import, needed here only

        hf, eos = self.target.hf, sorted(self.target.eos_token_ids)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        rows = torch.arange(len(prompts))  # which prompt each live batch row belongs to
        nxt_pos = pos[:, -1] + 1
        result: list[list[int]] = [[] for _ in prompts]
        done = torch.zeros(len(prompts), dtype=torch.bool)  # per live row: has written an end-of-sequence token
        for step in range(max_new):
            logits = out.logits[:, -1].float()
            if temperature == 0:
                tok = logits.argmax(-1)
            else:
                cdf = torch.softmax(logits / temperature, dim=-1).cumsum(-1)
                u = torch.rand(len(rows), 1) * cdf[:, -1:]
                tok = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(cdf.shape[-1] - 1)
            for r, (row, t) in enumerate(zip(rows.tolist(), tok.tolist())):
                result[row].append(t)
                done[r] |= t in eos
            if step + 1 == max_new or done.all():
                break
            mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=mask.dtype)], dim=1)
            if done.sum() * 4 >= len(rows):  # drop finished rows once a quarter of the batch is done
                live = (~done).nonzero()[:, 0]
                cache.batch_select_indices(live)
                rows, tok, mask, nxt_pos, done = rows[live], tok[live], mask[live], nxt_pos[live], done[live]
            out = hf(input_ids=tok[:, None], attention_mask=mask, position_ids=nxt_pos[:, None], cache=cache,
                     use_cache=True)
            nxt_pos = nxt_pos + 1
            # rows that finished but stayed in the batch keep decoding; their extra tokens are cut below
        return [r[: next((i + 1 for i, t in enumerate(r) if t in eos), len(r))] for r in result]

    def answer(self, prompts: list[list[int]], temperature: float, limit: int = LIMITS["answer"]) -> list[Record]:
        """Sample answers; each record is prompt + answer with the answer as its one span."""
        outs = self.sample(prompts, limit, temperature)
        return [Record(p + a, [[len(p), len(p) + len(a)]], "", -1) for p, a in zip(prompts, outs)]


def _finish_requests(w: _Writer, prefixes: list[list[int]], openings: list[str], limit: int) -> list[str]:
    """The user requests the target writes after each opening (opening + its continuation)."""
    outs = w.sample(prefixes, limit, REQUEST_T)
    return [(o + ("" if o.endswith(" ") else " ") + w.text(c)).strip() if w.text(c) else o + " the weather"
            for o, c in zip(openings, outs)]


def _sentence(doc: str, rnd: random.Random) -> str:
    parts = [s.strip() for s in doc.replace("\n", " ").split(". ") if 20 <= len(s.strip()) <= 240]
    return (rnd.choice(parts).rstrip(".") + ".") if parts else doc[:200]


def _round(w: _Writer, shape: str, n: int, temperature: float, rnd: random.Random) -> list[Record]:
    """One round of ``shape`` on ``n`` items: the records it produces (see the module docstring)."""
    if not w.chat:
        openings = [rnd.choice(FREE_OPENINGS) for _ in range(n)]
        bos = [w.tok.bos_token_id] if w.tok.bos_token_id is not None else []
        starts = [bos + w.ids(o) for o in openings]
        return w.answer(starts, max(temperature, 0.6), LIMITS["document"])
    if shape == "chat":
        first = _finish_requests(w, [w.user_start([], "") for _ in range(n)], [""] * n, LIMITS["request"])
        a1 = w.answer([w.prompt([u]) for u in first], temperature)
        replies = [w.text(r.tokens[r.spans[0][0]:]) for r in a1]
        follow = _finish_requests(w, [w.user_start([u, a], "") for u, a in zip(first, replies)], [""] * n,
                                  LIMITS["request"])
        a2 = w.answer([w.prompt([u, a, f]) for u, a, f in zip(first, replies, follow)], temperature)
        # one sequence, two assistant turns: the second prompt extends the first exchange
        out = []
        for r1, r2 in zip(a1, a2):
            out.append(Record(r2.tokens, [r1.spans[0], r2.spans[0]], "", -1)
                       if r2.tokens[: r1.spans[0][1]] == r1.tokens else r2)
        return out
    if shape == "document":
        openings = [rnd.choice(OPENINGS["document"]) for _ in range(n)]
        requests = _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        docs = w.answer([w.prompt([r]) for r in requests], REQUEST_T, LIMITS["document"])
        texts = [w.text(d.tokens[d.spans[0][0]:]) or r for d, r in zip(docs, requests)]
        summaries = w.answer([w.prompt([f"Summarize: {t}"]) for t in texts], temperature, 160)
        questions = w.answer([w.prompt([f"Write one question that this text answers.\n\n{t}"]) for t in texts], REQUEST_T,
                             LIMITS["short"])
        asked = [w.text(q.tokens[q.spans[0][0]:]) or "What is this text about?" for q in questions]
        rag = w.answer([w.prompt([f"{t}\n{q}"]) for t, q in zip(texts, asked)], temperature, 160)
        sentences = [_sentence(t, rnd) for t in texts]
        german = w.answer([w.prompt([f"Translate English to German: {s}"]) for s in sentences], temperature,
                          LIMITS["sentence"])
        back = w.answer([w.prompt([f"Translate German to English: {w.text(g.tokens[g.spans[0][0]:]) or s}"])
                         for g, s in zip(german, sentences)], temperature, LIMITS["sentence"])
        return docs + summaries + questions + rag + german + back
    if shape in ("qa", "math"):
        asks = w.answer([w.prompt([ASK[shape].format(rnd.choice(TOPICS))]) for _ in range(n)], REQUEST_T,
                        {"qa": LIMITS["short"], "math": 96}[shape])
        written = [w.text(a.tokens[a.spans[0][0]:]) for a in asks]
        return asks + w.answer([w.prompt([q]) for q in written if q], temperature)
    if shape == "code":
        openings = [rnd.choice(OPENINGS[shape]) for _ in range(n)]
        requests = _finish_requests(w, [w.user_start([], o) for o in openings], openings, LIMITS["request"])
        answers = w.answer([w.prompt([r]) for r in requests], temperature)
        code = [w.text(a.tokens[a.spans[0][0]:]) for a in answers]
        explained = w.answer([w.prompt([f"Explain what this code does:\n{c}"]) for c in code if c], temperature)
        return answers + explained
    raise VerispecError(f"unknown corpus shape {shape!r}; choose from {', '.join(SHAPES)}")


def read_corpus(path: str | Path) -> list[Record]:
    """The complete rounds of a corpus file (records of a round cut short by an interruption are dropped).

    Also reads the older format, one token list per line (the whole sequence counts as written text)."""
    path = Path(path)
    records, last_round_done = [], -1
    if not path.exists():
        return records
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                break
            if isinstance(d, list):
                records.append(Record(d, [[1, len(d)]], "legacy", len(records)))
            elif d.get("type") == "end":  # a round's records are followed by its end marker
                last_round_done = d["round"]
            else:
                records.append(Record(d["tokens"], d["spans"], d["shape"], d["round"]))
    if records and records[0].shape != "legacy":
        records = [r for r in records if r.round <= last_round_done]
    return records


def write_corpus(target, path: str | Path, config: CorpusConfig,
                 on_round: Callable[[int, list[Record]], None] | None = None) -> list[Record]:
    """Generate (or resume) ``config.rounds`` rounds into the JSONL file ``path``; returns every record."""
    path = Path(path)
    records = read_corpus(path)
    if records and records[0].shape == "legacy":
        raise VerispecError(f"{path} holds a corpus of the older format; use another folder")
    done = max((r.round for r in records), default=-1) + 1
    # rewrite the complete rounds only (drops a cut-off round), then append
    with path.open("w", encoding="utf-8") as f:
        for rnd in range(done):
            for r in (r for r in records if r.round == rnd):
                f.write(r.to_json() + "\n")
            f.write(json.dumps({"type": "end", "round": rnd}) + "\n")
    w = _Writer(target)
    for rnd_i in range(done, config.rounds):
        new = list(_rounds_from(w, config, rnd_i))
        with path.open("a", encoding="utf-8") as f:
            for r in new:
                f.write(r.to_json() + "\n")
            f.write(json.dumps({"type": "end", "round": rnd_i}) + "\n")
        records += new
        if on_round is not None:
            on_round(rnd_i, new)
    return records


def _rounds_from(w: _Writer, config: CorpusConfig, rnd_i: int) -> Iterator[Record]:
    torch.manual_seed(config.seed * 1_000_003 + rnd_i)
    rnd = random.Random(config.seed * 1_000_003 + rnd_i)
    shape = CYCLE[rnd_i % len(CYCLE)]
    temperature = config.answer_temperatures[rnd_i % len(config.answer_temperatures)]
    for r in _round(w, shape, config.batch, temperature, rnd):
        if len(r.tokens) > 2 and r.spans and r.spans[0][1] > r.spans[0][0]:
            yield Record(r.tokens, r.spans, shape, rnd_i)
