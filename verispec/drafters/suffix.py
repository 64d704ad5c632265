"""Suffix drafting: the longest earlier match of the text's end, in the context and in the answers already served.

A *suffix automaton* (SAM decoding, Hu et al. 2024, arXiv 2411.10666) over a token sequence has one state per set of
substrings that end at the same positions; extending it by a token and following the longest match of a growing
text are both O(1) amortised. ``SuffixIndex`` keeps one, and for each state where its substrings first occurred, so
that what followed them there is a draft.

``SuffixDrafter`` drafts after a context from two such indexes, whichever matches the context's end longer:

* the context's own (the prompt and the answer so far), extended by the tokens each step commits: where the answer
  copies its prompt or itself, the longest earlier match is long and its continuation is what comes next. Unlike
  the n-gram index of ``NgramDrafter`` (at most 3 tokens), a match has no length limit;
* optionally a ``SuffixCache`` shared by every sequence of an engine or a server (after SuffixDecoding, Oliaro et
  al. 2024, arXiv 2411.04975): the answers already served, so that a request like an earlier one drafts its
  answer. It holds at most ``max_tokens`` tokens (when full, the oldest answers are dropped as a whole until half
  of it is used; about 0.45 KB a token in Python objects: 44 MB for 99,000 tokens of Spec-Bench's text, by
  ``tracemalloc``), and drafts only from a confident match: at least ``min_match`` tokens, and either every earlier occurrence of it went on with the same
  token (SuffixDecoding scores continuations by frequency; a suffix automaton cheaply tells whether they all
  agree) or the match is at least twice that long.

The draft is a chain whose law at each node is a point mass on the matched continuation (``q`` one-hot, children
``topk``): whatever it proposes, every exact verifier keeps the target's law. Which index drafts is decided from the
context and earlier answers alone, before the step's randomness. Sharing a cache makes a request's *seeded* text
depend on what was served before it (its law does not: any draft gives the target's law), so the library's
``generate`` never shares one; a server does when asked.
"""

from __future__ import annotations

import threading

import torch

from .base import Drafter, _Growing, sparse_row
from .registry import register_draft


class SuffixIndex:
    """A suffix automaton over a token sequence, extended a token at a time. States are kept in flat lists and one
    dict of transitions keyed by ``state * stride + token`` (a dict per state costs several times the memory); each
    state keeps the end of its substrings' first occurrence (``first``) and the tokens it has transitions on."""

    def __init__(self, stride: int):
        self.stride = stride
        self.tokens: list[int] = []
        self.length = [0]  # longest substring of each state
        self.link = [-1]  # suffix link
        self.first = [-1]  # position of the last token of the state's first occurrence
        self.outs: list[list[int]] = [[]]  # tokens with a transition out of each state
        self.next: dict[int, int] = {}
        self.last = 0

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens) -> None:
        for x in tokens:
            self.add(int(x))

    def add(self, x: int) -> None:
        nxt, stride, length, link, first, outs = self.next, self.stride, self.length, self.link, self.first, self.outs
        pos = len(self.tokens)
        self.tokens.append(x)
        cur = len(length)
        length.append(length[self.last] + 1)
        link.append(0)
        first.append(pos)
        outs.append([])
        p = self.last
        while p != -1 and p * stride + x not in nxt:
            nxt[p * stride + x] = cur
            outs[p].append(x)
            p = link[p]
        if p != -1:
            q = nxt[p * stride + x]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:
                clone = len(length)
                length.append(length[p] + 1)
                link.append(link[q])
                first.append(first[q])
                outs.append(list(outs[q]))
                for y in outs[q]:
                    nxt[clone * stride + y] = nxt[q * stride + y]
                while p != -1 and nxt.get(p * stride + x) == q:
                    nxt[p * stride + x] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def step(self, state: int, matched: int, x: int) -> tuple[int, int]:
        """The longest match after one more token ``x``: from (state, matched length) to the new pair."""
        nxt, stride, length, link = self.next, self.stride, self.length, self.link
        while state != -1 and state * stride + x not in nxt:
            state = link[state]
            matched = length[state] if state != -1 else 0
        if state == -1:
            return 0, 0
        return nxt[state * stride + x], matched + 1

    def match(self, text: list[int]) -> tuple[int, int]:
        """(state, length) of the longest suffix of ``text`` found in the index."""
        state, matched = 0, 0
        for x in text:
            state, matched = self.step(state, matched, x)
        return state, matched

    def earlier(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the indexed sequence that also occurred earlier in it (its
        first occurrence ends before the sequence does): the end's own state's suffix link."""
        s = self.link[self.last] if self.last > 0 else 0
        return s, self.length[s]

    def continuation(self, state: int, n: int) -> list[int]:
        """Up to ``n`` tokens that followed the first occurrence of the state's substrings."""
        e = self.first[state] if state > 0 else -1
        return self.tokens[e + 1:e + 1 + n] if e >= 0 else []


class SuffixCache:
    """Answers already served, for every sequence of an engine or server to draft from (see the module docstring).
    ``add(tokens)`` appends one answer; thread-safe, bounded by ``max_tokens``."""

    def __init__(self, vocab_size: int, max_tokens: int = 100_000, min_match: int = 4):
        if max_tokens < 1 or min_match < 1:
            raise ValueError("max_tokens and min_match must be >= 1")
        self.vocab_size, self.max_tokens, self.min_match = vocab_size, max_tokens, min_match
        self._answers: list[list[int]] = []
        self._lock = threading.Lock()
        self.index = SuffixIndex(vocab_size + 1)  # token vocab_size separates answers: no match runs across two

    def add(self, tokens: list[int]) -> None:
        tokens = [int(t) for t in tokens][-max(self.max_tokens // 2, 1):]
        if not tokens:
            return
        with self._lock:
            self._answers.append(tokens)
            total = sum(len(a) + 1 for a in self._answers)
            if total > self.max_tokens:  # drop the oldest answers until half the bound is used, then rebuild
                while len(self._answers) > 1 and total > self.max_tokens // 2:
                    total -= len(self._answers.pop(0)) + 1
                self.index = SuffixIndex(self.vocab_size + 1)
                for a in self._answers:
                    self.index.extend(a + [self.vocab_size])
            else:
                self.index.extend(tokens + [self.vocab_size])

    def __len__(self) -> int:
        return len(self.index)

    def draft(self, text: list[int], n: int, window: int = 64) -> tuple[list[int], int]:
        """(up to ``n`` tokens after the longest match of the end of ``text`` among the answers, the match's length)
        where the match is confident: at least ``min_match`` tokens, and every earlier occurrence continued the same
        way or the match is at least twice that long; else ([], 0)."""
        with self._lock:
            index = self.index
            state, matched = index.match(text[-window:])
            if matched < self.min_match or (len(index.outs[state]) > 1 and matched < 2 * self.min_match):
                return [], 0
            out = index.continuation(state, n)
        if self.vocab_size in out:
            out = out[:out.index(self.vocab_size)]
        return (out, matched) if out else ([], 0)


class SuffixDrafter(Drafter):
    """Drafts the continuation of the longest earlier match of the context's end, in the context itself or in a
    shared ``SuffixCache`` of served answers (module docstring)."""

    name = "suffix"
    free_root = True
    sparse = True  # a row is one token
    depth_cost = 0.01  # a few dictionary reads a step, no model forward

    def __init__(self, vocab_size: int, cache: SuffixCache | None = None, min_match: int = 1):
        self.vocab_size = vocab_size
        self.cache = cache
        self.min_match = min_match
        self.reset([])

    def reset(self, prompt: list[int]) -> None:
        self.index = SuffixIndex(self.vocab_size)
        self._chain: list[int] = []
        self._match = 0
        self._planned: tuple[int, int] | None = None  # (length, last token) of the context planned for

    def fork(self) -> "SuffixDrafter":
        return SuffixDrafter(self.vocab_size, self.cache, self.min_match)

    def _sync(self, context: list[int]) -> None:
        """Extend the context's index by the tokens committed since the last call (another context: anew)."""
        n = len(self.index)
        if len(context) < n or self.index.tokens[-1:] != context[n - 1:n] or self.index.tokens[:1] != context[:1]:
            self.reset([])
            n = 0
        self.index.extend(context[n:])

    PLAN = 16  # tokens of the matched continuation kept for a step's chain

    def match_length(self, context: list[int]) -> int:
        """The longest earlier match of the context's end: in itself, or in the cache (where it would draft)."""
        self._plan(context)
        return self._match if self._chain else 0

    def _plan(self, context: list[int]) -> None:
        """The step's chain and its match, once per context: the hybrid asks ``match_length`` before drafting."""
        if self._planned == (len(context), context[-1]) and len(self.index) == len(context):
            return
        self._planned = (len(context), context[-1])
        n = self.PLAN
        self._sync(context)
        state, matched = self.index.earlier()
        own = self.index.continuation(state, n) if matched >= self.min_match else []
        self._chain, self._match = own, matched if own else 0
        if self.cache is not None and len(self.cache):
            shared, length = self.cache.draft(context, n)
            if length > self._match:
                self._chain, self._match = shared, length

    def _root_sparse(self, context):
        self._plan(context)
        return sparse_row([self._chain[0]], [0.0]) if self._chain else None

    def _node_sparse(self, g: _Growing, nodes: list[int]):
        rows = []
        for node in nodes:
            path = g.path(node)  # a chain follows the planned continuation
            ok = path == self._chain[:len(path)] and len(path) < len(self._chain)
            rows.append(sparse_row([self._chain[len(path)]], [0.0]) if ok else None)
        return rows

    def confidence(self, nodes: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Longer matches continue more often: ``min(match, 8) / 8`` for every node of the chain."""
        return torch.full((len(nodes),), min(self._match, 8) / 8)


@register_draft("suffix", help="'suffix' (the longest earlier match of the text's end, by a suffix automaton)",
                takes_arg=False)
def _suffix(target, arg, **_) -> SuffixDrafter:
    return SuffixDrafter(target.vocab_size)
