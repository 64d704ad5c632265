"""The bfloat16 attention kernels (``backends/native/attention.cpp``, AVX-512) built without ``-fopenmp``, as they were
up to ``verispec_attention_v2`` (torch's ``at::parallel_for`` then runs serially), and with it, as built now: a
bfloat16 step of the default model on 1 and 8 sequences of 3 rows at 500 cache entries each, the two builds taking
turns, and whether their logits are equal bit for bit (each (slot, head) pair is computed whole by one thread, so
the split over threads cannot change a sum). A measurement, not the benchmark.

    python scripts/experiments/bf16_attention_threads.py
"""

from __future__ import annotations

import statistics
import time

import torch

from verispec import load
from verispec.backends import native


def main() -> None:
    torch.set_num_threads(2)
    flags, cflags = {"avx512f", "avx512bw"}, ["-mavx512f", "-mavx512bw", "-mfma"]
    builds = {"serial": native._build("verispec_attention_serial", "attention.cpp", flags, cflags, "serial build"),
              "openmp": native.attention()}
    if any(b is None for b in builds.values()):
        raise SystemExit("the bfloat16 attention kernels cannot be built here (AVX-512F, AVX-512BW, a compiler, ninja)")
    target = load("smollm2-135m", dtype="bfloat16")
    lean = target._lean
    for n_seq in (1, 8):
        pool = target.state_pool(n_seq, 1024)
        states = [pool.acquire() for _ in range(n_seq)]
        for i, s in enumerate(states):
            target.prefill(s, list(range(100 + i, 600 + i)))
        tokens = [torch.tensor([7, 8, 9]) for _ in states]
        attend = [torch.ones(3, 3, dtype=torch.bool).tril() for _ in states]
        logits, times = {}, {name: [] for name in builds}
        for r in range(40):
            for name in (list(builds) if r % 2 else list(builds)[::-1]):
                lean.native = builds[name]
                positions = [s.committed + torch.arange(3) for s in states]
                t0 = time.perf_counter()
                out = target.forward_batch(states, tokens, positions, attend)
                times[name].append(time.perf_counter() - t0)
                logits[name] = [o.logits for o in out]
                for s in states:
                    target.commit(s, [])
        same = all(torch.equal(a, b) for a, b in zip(logits["serial"], logits["openmp"]))
        print(f"{n_seq} sequences x 3 rows, 500 entries: serial {statistics.median(times['serial'][5:]) * 1e3:.1f} ms, "
              f"openmp {statistics.median(times['openmp'][5:]) * 1e3:.1f} ms (medians of 35), logits equal: {same}")


if __name__ == "__main__":
    main()
