"""linear.cpp's 512-bit build against its 256-bit build on an AVX-512 CPU (``native.linear_avx512`` and
``native.linear_avx2``: the same panels, the same results bit for bit). First the default model's decoder layers
alone for 1 to 136 rows; then whole forwards of the lean model for a few batch shapes, the builds taking turns, with
whether their logits are equal bit for bit; then the closed loops of ``ar`` and ``default`` (its draft head's layers
on the same build) on Spec-Bench requests at a few concurrencies, the builds taking turns (A B B A). A measurement,
not the benchmark.

    python scripts/experiments/linear_avx512.py --concurrency 1 2 8
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from forward_turns import forwards_in_turns, loops_in_turns  # scripts/experiments/forward_turns.py
from verispec import load
from verispec.backends import native


def median_ms(times: list[float], skip: int = 0) -> float:
    return statistics.median(times[skip:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 2, 8])
    ap.add_argument("--methods", nargs="+", default=["ar", "default"])
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(2)
    builds = {"256-bit": native.linear_avx2(), "512-bit": native.linear_avx512()}
    if any(b is None for b in builds.values()):
        raise SystemExit("needs a CPU with AVX-512 (F, BW, VL, DQ), AVX2, FMA and F16C, a C++ compiler and ninja")
    use = native.linear

    def switch(name: str) -> None:
        native.linear = lambda: builds[name]

    def turns(r: int) -> list[str]:
        return list(builds) if r % 2 == 0 else list(builds)[::-1]

    target = load("smollm2-135m")
    try:
        layers = [m for n, m in target.hf.named_modules() if isinstance(m, torch.nn.Linear) and "layers." in n]
        packed = [(builds["256-bit"].pack_exact(m.weight.detach()), *m.weight.shape) for m in layers]
        print(f"the model's {len(packed)} decoder matrices from their GGUF blocks, ms (median of 7):")
        for rows in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 48, 136):
            xs = {k: torch.randn(rows, k) for _, _, k in packed}
            times: dict[str, list[float]] = {n: [] for n in builds}
            for r in range(7):
                for name in turns(r):
                    t0 = time.perf_counter()
                    for p, n, k in packed:
                        builds[name].linear(xs[k], p, n, None)
                    times[name].append(time.perf_counter() - t0)
            a, b = (median_ms(times[n]) for n in builds)
            print(f"  {rows:3d} rows: 256-bit {a:6.1f}, 512-bit {b:6.1f} ({a / b:.2f}x)", flush=True)

        for seqs, rows in ((1, 1), (1, 3), (2, 1), (2, 3), (4, 2), (8, 1), (8, 2)):
            ms, same = forwards_in_turns(target, {name: functools.partial(switch, name) for name in builds}, seqs,
                                         rows)
            a, b = ms.values()
            print(f"forward, {seqs} sequences x {rows} rows, 400 entries: 256-bit {a:.1f} ms, 512-bit {b:.1f} ms "
                  f"({a / b:.2f}x), logits equal: {same}", flush=True)

        loops_in_turns(target, {name: functools.partial(switch, name) for name in builds}, args.methods,
                       args.concurrency, args.limit, args.max_new_tokens)
    finally:
        native.linear = use


if __name__ == "__main__":
    main()
