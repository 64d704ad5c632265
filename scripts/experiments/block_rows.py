"""The native kernel's ways of running rows against the default model's GGUF-block panels, before and after
``block_rows`` (``backends/native/linear.cpp``): the previous build (``verispec_linear_v4``: one pass recomputing
each weight up to 6 rows, a whole panel recomputed into memory first beyond) and the current one (one pass up to 5,
block by block up to 48), on the same panels. Prints whole forwards of the lean model for a few batch shapes, the
two builds taking turns, and whether their logits are equal bit for bit; then closed loops of ``ar`` at N = 8 (the
default's load-aware plan rarely drafts there), the builds taking turns. A measurement, not the benchmark.

    python scripts/experiments/block_rows.py
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import torch

from forward_turns import forwards_in_turns  # this folder's helper (scripts/experiments/forward_turns.py)
from verispec import load
from verispec.backends import native
from verispec.bench.concurrency import verispec_loop
from verispec.datasets import spec_bench_problems
from verispec.drafters import build_drafter
from verispec.methods import resolve


def previous_build():
    """linear.cpp as of verispec_linear_v4 (git d4b57f4), built under its own name."""
    import subprocess  # noqa: PLC0415

    source = subprocess.run(["git", "show", "d4b57f4:verispec/backends/native/linear.cpp"], check=True,
                            capture_output=True, text=True).stdout
    here = Path(native.__file__).with_name("linear_v4_for_comparison.cpp")
    here.write_text(source)
    try:
        return native._build("verispec_linear_v4_cmp", here.name, {"avx2", "fma", "f16c"},
                             ["-mavx2", "-mfma", "-mf16c", "-fopenmp"], "previous linear kernel")
    finally:
        here.unlink()


def main() -> None:
    torch.set_num_threads(2)
    builds = {"before": previous_build(), "after": native.linear()}
    if any(b is None for b in builds.values()):
        raise SystemExit("the native linear kernel cannot be built here (AVX2, FMA, F16C, a compiler, ninja)")
    target = load("smollm2-135m")
    use = native.linear

    def switch(name: str) -> None:
        native.linear = lambda: builds[name]

    try:
        for seqs, rows in ((1, 1), (1, 6), (2, 3), (4, 2), (8, 1), (8, 2)):
            ms, same = forwards_in_turns(target, {name: functools.partial(switch, name) for name in builds}, seqs,
                                         rows)
            b, a = ms["before"], ms["after"]
            print(f"{seqs} sequences x {rows} rows, 400 entries: before {b:.1f} ms, after {a:.1f} ms "
                  f"({b / a:.2f}x), logits equal: {same}", flush=True)
        drafter = build_drafter("auto", target)
        problems = spec_bench_problems(3)
        ids = [target.encode_prompt(p.prompt, chat=p.chat) for p in problems]
        plan = resolve("ar", temperature=0.0)
        verispec_loop(target, plan, drafter, problems[:8], ids[:8], 8, 0.0, 0, 16)
        rates = {n: [] for n in builds}
        for r in range(2):
            for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
                switch(name)
                t0 = time.perf_counter()
                reqs = verispec_loop(target, plan, drafter, problems, ids, 8, 0.0, 0, 128)
                rates[name].append(sum(len(q.token_ids) for q in reqs) / (time.perf_counter() - t0))
                print(f"ar, N = 8, round {r + 1}, {name}: {rates[name][-1]:.1f} tokens/s", flush=True)
        print(f"ar at N = 8, after / before: {statistics.mean(rates['after']) / statistics.mean(rates['before']):.3f}")
    finally:
        native.linear = use


if __name__ == "__main__":
    main()
