"""One timing loop for the experiments that compare ways of running the same target forward (kernel builds, thread
settings, kernel calls): ``forwards_in_turns`` times a batch of sequences' forwards, the ways taking turns, and says
whether their logits are equal bit for bit; ``loops_in_turns`` does the same for closed loops of Spec-Bench requests
and their tokens. A helper, not an experiment."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def forwards_in_turns(target, ways: dict[str, Callable[[], None]], seqs: int, rows: int, context: int = 400,
                      turns: int = 30, skip: int = 4) -> tuple[dict[str, float], bool]:
    """Median ms of ``target.forward_batch`` over ``seqs`` sequences of ``rows`` rows each (a causal chain) after
    ``context`` entries of cache, for each way (``ways[name]()`` switches to it), the ways in alternating order over
    ``turns`` rounds, the first ``skip`` left out; and whether every way's logits were equal bit for bit."""
    pool = target.state_pool(seqs, 1024)
    states = [pool.acquire() for _ in range(seqs)]
    for i, s in enumerate(states):
        target.prefill(s, list(range(100 + i, 100 + context + i)))
    tokens = [torch.arange(7, 7 + rows) for _ in states]
    attend = [torch.ones(rows, rows, dtype=torch.bool).tril() for _ in states]
    times: dict[str, list[float]] = {name: [] for name in ways}
    logits = {}
    for r in range(turns):
        for name in (list(ways) if r % 2 else list(ways)[::-1]):
            ways[name]()
            positions = [s.committed + torch.arange(rows) for s in states]
            t0 = time.perf_counter()
            out = target.forward_batch(states, tokens, positions, attend)
            times[name].append(time.perf_counter() - t0)
            logits[name] = [o.logits for o in out]
            for s in states:
                target.commit(s, [])
    first, *others = logits.values()
    same = all(torch.equal(a, b) for other in others for a, b in zip(first, other))
    return {name: statistics.median(t[skip:]) * 1e3 for name, t in times.items()}, same


def loops_in_turns(target, ways: dict[str, Callable[[], None]], methods: list[str], concurrency: list[int],
                   limit: int = 3, max_new_tokens: int = 128, rounds: int = 2) -> None:
    """Closed loops of each method on Spec-Bench requests at T = 0 with N in flight (``limit`` questions a category),
    for each way (``ways[name]()`` switches to it) ``rounds`` times, the ways' order reversed every other round
    (A B B A); prints per method and N the two ways' mean tokens per second, their ratio, each round's rate, and
    whether every request's tokens were the same."""
    from verispec.bench.concurrency import verispec_loop  # noqa: PLC0415 - only the scripts that run loops need it
    from verispec.datasets import spec_bench_problems  # noqa: PLC0415
    from verispec.drafters import build_drafter  # noqa: PLC0415
    from verispec.methods import resolve  # noqa: PLC0415

    names = list(ways)
    drafter = build_drafter("auto", target)
    problems = spec_bench_problems(limit)
    ids = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
    for method in methods:
        plan = resolve(method, temperature=0.0)
        for n in concurrency:
            verispec_loop(target, plan, drafter, problems[:n], ids[:n], n, 0.0, 0, 16)  # warm: costs, kernels
            rates: dict[str, list[float]] = {name: [] for name in names}
            texts = {}
            for r in range(rounds):
                for name in (names if r % 2 == 0 else names[::-1]):
                    ways[name]()
                    t0 = time.perf_counter()
                    reqs = verispec_loop(target, plan, drafter, problems, ids, n, 0.0, 0, max_new_tokens)
                    rates[name].append(sum(len(q.token_ids) for q in reqs) / (time.perf_counter() - t0))
                    texts[name] = [q.token_ids for q in reqs]
            a, b = (statistics.mean(rates[name]) for name in names)
            print(f"{method}, N = {n}, T = 0: {names[0]} {a:.1f}, {names[1]} {b:.1f} tokens/s ({b / a:.3f}x; rounds "
                  f"{[round(x, 1) for x in rates[names[0]]]} / {[round(x, 1) for x in rates[names[1]]]}), "
                  f"same tokens: {texts[names[0]] == texts[names[1]]}", flush=True)
