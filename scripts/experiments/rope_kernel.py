"""The native rotary kernel (``native.rope``) against the torch expression it replaces in the lean forward: the
default model's logits and features for prompts (one past the rotary table) and trees of 1-20 rows in batches of
four, with and without it, equal bit for bit; then one-row steps at 400 entries of context, the two taking turns.
A measurement, not the benchmark.

    python scripts/experiments/rope_kernel.py
"""

from __future__ import annotations

import statistics
import time

import torch

from verispec import load


def outputs(target) -> list[torch.Tensor]:
    """Prefills and tree steps of four sequences in one pool, and a prompt past the rotary table."""
    pool = target.state_pool(4, 1024)
    states = [pool.acquire() for _ in range(4)]
    out = [target.prefill(s, list(range(100 + i, 400 + 3 * i))) for i, s in enumerate(states)]
    for n in (1, 3, 8, 20):
        tokens = [torch.arange(7, 7 + n) for _ in states]
        attend = [torch.ones(n, n, dtype=torch.bool).tril() for _ in states]
        positions = [s.committed + torch.arange(n) for s in states]
        got = target.forward_batch(states, tokens, positions, attend, features=(3, 15, 27))
        out += [o.logits for o in got] + [o.hidden for o in got]
        for s in states:
            target.commit(s, list(range(n)))
    out.append(target.prefill(target.new_state(), list(range(50, 9000, 7))))  # 1,279 tokens
    return out


def main() -> None:
    torch.set_num_threads(2)
    target = load("smollm2-135m")
    lean = target._lean
    kernel = lean.rotary
    if kernel is None:
        raise SystemExit("the native rotary kernel cannot be built here (a C++ compiler and ninja)")
    results = {}
    for name, rotary in (("torch", None), ("native", kernel)):
        lean.rotary = rotary
        results[name] = outputs(target)
    print("logits and features equal bit for bit:",
          all(torch.equal(a, b) for a, b in zip(results["torch"], results["native"])))
    state = target.new_state()
    target.prefill(state, list(range(100, 500)))
    times: dict[str, list[float]] = {"torch": [], "native": []}
    for r in range(80):
        for name in (("torch", "native") if r % 2 else ("native", "torch")):
            lean.rotary = kernel if name == "native" else None
            t0 = time.perf_counter()
            target.forward_batch([state], [torch.tensor([7])], [state.committed + torch.arange(1)],
                                 [torch.ones(1, 1, dtype=torch.bool)])
            times[name].append(time.perf_counter() - t0)
            target.commit(state, [])
    lean.rotary = kernel
    print("one-row steps at 400 entries, medians of 70: " +
          ", ".join(f"{name} {statistics.median(ts[10:]) * 1e3:.2f} ms" for name, ts in times.items()))


if __name__ == "__main__":
    main()
