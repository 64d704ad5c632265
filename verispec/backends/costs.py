"""What a target forward costs on this machine, by the number of tree tokens it runs.

``forward_costs(target)`` times the target's forward over 1..``COSTED_ROWS`` tree tokens once per machine and
``target.forward_id`` (model file, engine, threads, kernels), and keeps the result in the on-disk cache
(``verispec.cache``, kind ``costs``): measured once, then the same numbers every run, so decisions made from them --
and the text a seed gives -- do not depend on a run's timing noise. The ``auto`` draft-length policy weighs depths
by them (``verispec.methods.step_costs``).
"""

from __future__ import annotations

import bisect
import itertools
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

from .. import cache
from ..tree import Tree

COSTED_ROWS = 9  # forward sizes measured: 1..9 tokens (chains up to 8 drafted tokens)


def target_forward_cost(target, context: list[int], sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n tree tokens after ``context``, for each n in ``sizes``; the sizes
    take turns within each round, so that a slow spell of the machine falls on all of them alike."""
    state = target.new_state()
    target.prefill(state, context[:-1])
    shapes = {n: Tree.complete(max(1, n - 1), 1) if n > 1 else Tree.root_only() for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n, tree in shapes.items():
            tokens = torch.tensor(context[-1:] * tree.size)
            pos = state.committed + torch.tensor(tree.depths)
            t = time.perf_counter()
            target.forward(state, tokens, pos, tree.ancestors_mask())
            times[n].append(time.perf_counter() - t)
            target.commit(state, [])
    return {n: statistics.median(ts) for n, ts in times.items()}


def forward_costs(target, repeats: int = 9, measure: bool = True) -> list[float] | None:
    """Seconds of the target's forward over 1..COSTED_ROWS tree tokens (median of ``repeats``), cached on disk;
    None when not cached and ``measure`` is False."""
    entry = cache.key(target.forward_id, platform.machine(), os.cpu_count())
    cached = (cache.read("costs", entry) or {}).get("seconds")
    if isinstance(cached, list) and len(cached) == COSTED_ROWS:
        return cached
    if not measure:
        return None
    seconds = target_forward_cost(target, [5] * 32 + [7], list(range(1, COSTED_ROWS + 1)), repeats)
    out = [seconds[n] for n in range(1, COSTED_ROWS + 1)]
    cache.write("costs", entry, {"seconds": out, "target": target.name})
    return out


BATCH_SIZES = (*range(1, 17), 20, 24, 32, 40, 48, 64)  # rows of one forward, measured for batches


PADDED_ROWS = (1, 2, 3, 4, 6, 8)  # the widest tree of a batch, measured for its padding cost
BATCH_CONTEXT = 256  # cache entries of each sequence while a batch's costs are measured (attention grows with it)
LONG_CONTEXT = 768  # ... and, for the padding, a second time at this many (its cost grows with the batch's span)


def interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    """The value at ``x`` of the line through the points (``xs``, ``ys``), ``xs`` increasing: flat below the first,
    the last segment's slope beyond the last."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (x - xs[-1]) if len(xs) > 1 else ys[-1]
    hi = bisect.bisect_left(xs, x)  # the first point at or beyond x (the planner asks this dozens of times a step)
    lo = hi - 1
    return ys[lo] + (ys[hi] - ys[lo]) * (x - xs[lo]) / (xs[hi] - xs[lo])


@dataclass(frozen=True)
class BatchCosts:
    """Seconds of a target forward over ``rows`` tree tokens shared by ``seqs`` sequences whose widest tree has
    ``widest`` rows: the forward of that many rows of one sequence (measured at ``BATCH_SIZES``, fitted
    non-decreasing, linear in between and beyond), plus ``per_sequence`` for each further sequence (its own
    attention, its own cache: measured as a batch of 8 one-row sequences against one sequence of 8 rows, in the same
    rounds), plus, for each sequence, ``padding`` at ``widest`` (measured at ``PADDED_ROWS``, linear in between): the
    attention of a batch runs every sequence's query rows padded to the widest tree's, so one sequence drafting
    deeper makes the whole batch's attention wider. It is measured the way a loaded batch meets it: 8 sequences of
    which one drafts n rows, against 8 of one row in the same rounds, less the extra rows' own cost; at
    ``BATCH_CONTEXT`` entries (``padding``) and at ``LONG_CONTEXT`` (``long_padding``), and taken on the line through
    the two at the batch's
    ``span`` (its longest sequence's entries: every sequence's padded rows run over that many keys, and the
    attention leaves the fused one-row kernel for the padded one). Plus ``per_key`` for each row
    beyond a sequence's first and each cache entry of its sequence (``context``, the batch's mean): one sequence's
    rows attend together, but in a batch each drafted row reads its own sequence's keys again (measured as 8
    sequences drafting one row each against one of them doing so, at ``BATCH_CONTEXT`` entries, less the rows' own
    cost)."""

    rows: tuple[int, ...]
    seconds_by_rows: tuple[float, ...]
    per_sequence: float
    padding: tuple[float, ...] = ()  # seconds per sequence at each of PADDED_ROWS (0 at one row)
    per_key: float = 0.0
    long_padding: tuple[float, ...] = ()  # the same at LONG_CONTEXT entries (none: as at BATCH_CONTEXT, any span)

    def seconds(self, rows: int, seqs: int = 1, widest: int = 1, context: float = BATCH_CONTEXT,
                span: float | None = None) -> float:
        """``span``: the batch's longest sequence's cache entries (default: ``context``, the mean)."""
        base = interpolate(self.rows, self.seconds_by_rows, rows) + max(seqs - 1, 0) * self.per_sequence
        if seqs < 2 or widest <= 1:
            return base
        base += self.per_key * max(rows - seqs, 0) * context
        if not self.padding:
            return base
        pad = interpolate(PADDED_ROWS[:len(self.padding)], self.padding, widest)
        if self.long_padding:
            far = interpolate(PADDED_ROWS[:len(self.long_padding)], self.long_padding, widest)
            pad += (far - pad) * ((context if span is None else span) - BATCH_CONTEXT) / (LONG_CONTEXT - BATCH_CONTEXT)
        return base + seqs * max(pad, 0.0)


def _monotone(ys: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``ys`` in squared error (pooling adjacent violators): a forward of
    more rows never costs less, and a table that says so is timing noise."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def _batch_seconds(target, states: list, cases: dict, repeats: int) -> dict:
    """Median seconds of one ``forward_batch`` of ``states`` drafting each case's trees (one per state; a state
    whose tree is None sits the case out), for each case; the cases take turns within each round
    (``target_forward_cost``)."""
    times: dict = {key: [] for key in cases}
    for _ in range(repeats):
        for key, trees in cases.items():
            ran = [(s, tree) for s, tree in zip(states, trees) if tree is not None]
            t = time.perf_counter()
            target.forward_batch([s for s, _ in ran], [torch.full((tree.size,), 7) for _, tree in ran],
                                 [s.committed + torch.tensor(tree.depths) for s, tree in ran],
                                 [tree.ancestors_mask() for _, tree in ran])
            times[key].append(time.perf_counter() - t)
            for s, _ in ran:
                target.commit(s, [])
    return {key: statistics.median(ts) for key, ts in times.items()}


def _ragged(target, context: int, repeats: int, plain: "BatchCosts | None" = None
            ) -> tuple["BatchCosts", float, list[float], float]:
    """With 8 sequences of ``context`` cache entries each: the table of rows (one sequence running each of
    ``BATCH_SIZES`` rows, fitted non-decreasing; ``plain``'s where given), and ``per_sequence``, ``padding`` and
    ``per_key`` (``BatchCosts``) against it. Every case is a ``forward_batch`` (the engine's batched forward, which
    need not cost what the one-sequence ``forward`` does: 10 % less for one row, measured in bfloat16) and all take
    turns in the same rounds, so that a slow spell of the machine falls on the differences' two sides alike."""
    prompt = [5] * (context - 1)
    pool = target.state_pool(8, context + max(BATCH_SIZES) + 1)
    states = [pool.acquire() if pool is not None else target.new_state() for _ in range(8)]
    for s in states:
        target.prefill(s, prompt)
    root, chain = Tree.root_only(), Tree.chain(1)
    alone = [None] * 7

    def rows_of(n: int) -> Tree:
        return Tree.complete(n - 1, 1) if n > 1 else root

    cases: dict = {n: [root] * 7 + [rows_of(n)] for n in PADDED_ROWS}
    cases["all"] = [chain] * 8  # every sequence drafts a row: as wide as one doing so (n = 2), 7 rows more
    cases["one"] = [rows_of(8)] + alone  # the same 8 rows in one sequence
    if plain is None:
        cases.update({("rows", n): [rows_of(n)] + alone for n in BATCH_SIZES})
    # the padding is a difference of a few ms between forwards of about the same size: more rounds for it
    ragged = _batch_seconds(target, states, cases, 3 * repeats)
    if plain is None:
        plain = BatchCosts(BATCH_SIZES, tuple(_monotone([ragged["rows", n] for n in BATCH_SIZES])), 0.0)
    per_sequence = max(ragged[1] - ragged["one"], 0.0) / 7
    padding = [max(ragged[n] - ragged[1] - (plain.seconds(7 + n) - plain.seconds(8)), 0.0) / 8 for n in PADDED_ROWS]
    padding = list(itertools.accumulate(padding, max))  # wider never costs less: what looks so is timing noise
    per_key = max(ragged["all"] - ragged[2] - (plain.seconds(16) - plain.seconds(9)), 0.0) / (7 * context)
    return plain, per_sequence, padding, per_key


def batch_costs(target, repeats: int = 5, measure: bool = True) -> BatchCosts | None:
    """The target's ``BatchCosts`` on this machine, measured once (medians) and kept in the cache under
    ``target.forward_id``; None when not cached and ``measure`` is False."""
    entry = cache.key("batch", 7, target.forward_id, platform.machine(), os.cpu_count())
    got = cache.read("costs", entry)
    if got and tuple(got.get("rows", ())) == BATCH_SIZES and len(got.get("padding", ())) == len(PADDED_ROWS) \
            and len(got.get("long_padding", ())) == len(PADDED_ROWS):
        return BatchCosts(tuple(got["rows"]), tuple(got["seconds"]), got["per_sequence"], tuple(got["padding"]),
                          got["per_key"], tuple(got["long_padding"]))
    if not measure:
        return None
    plain, per_sequence, padding, per_key = _ragged(target, BATCH_CONTEXT, repeats)
    _, _, long_padding, _ = _ragged(target, LONG_CONTEXT, repeats, plain)
    out = BatchCosts(plain.rows, plain.seconds_by_rows, per_sequence, tuple(padding), per_key, tuple(long_padding))
    cache.write("costs", entry, {"rows": list(out.rows), "seconds": list(out.seconds_by_rows),
                                 "per_sequence": per_sequence, "padding": padding, "per_key": per_key,
                                 "long_padding": long_padding, "target": target.name})
    return out
