"""The bfloat16 attention kernels (``backends/native/attention.cpp``, AVX-512) built without ``-fopenmp``, as they were
up to ``verispec_attention_v2`` (torch's ``at::parallel_for`` then runs serially), and with it, as built now: a
bfloat16 step of the default model on 1 and 8 sequences of 3 rows at 500 cache entries each, the two builds taking
turns, and whether their logits are equal bit for bit (each (slot, head) pair is computed whole by one thread, so
the split over threads cannot change a sum). A measurement, not the benchmark.

    python scripts/experiments/bf16_attention_threads.py
"""

from __future__ import annotations

import functools

import torch

from forward_turns import forwards_in_turns  # this folder's helper (scripts/experiments/forward_turns.py)
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
        ways = {name: functools.partial(setattr, lean, "native", build) for name, build in builds.items()}
        ms, same = forwards_in_turns(target, ways, n_seq, 3, context=500, turns=40, skip=5)
        print(f"{n_seq} sequences x 3 rows, 500 entries: serial {ms['serial']:.1f} ms, "
              f"openmp {ms['openmp']:.1f} ms (medians of 35), logits equal: {same}")


if __name__ == "__main__":
    main()
