"""The lean forward's bfloat16 attention with the native kernels (``verispec.backends.native``: a bfloat16 cache
read directly, float32 arithmetic in a fixed order) against its pure-torch path (float32 caches, torch's products
over blocks of keys): 30 layers' worth of caches, so that both read them from memory as a real forward does. Also
checks that a slot alone gives the same bits as in the batch.

    python scripts/experiments/bf16_attention_kernel.py --slots 8 --context 600
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.backends import native
from verispec.backends.kv import whole_blocks
from verispec.backends.lean import LeanLlama


class _Path:  # what LeanLlama._grouped_attention reads of its instance
    invariant = True

    _limits = staticmethod(LeanLlama._limits)

    def __init__(self, kernels):
        self.native = kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rows", type=int, default=2, help="query rows per sequence")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = native.attention()
    if kernels is None:
        raise SystemExit("the native kernels cannot be built here (a C++ compiler, ninja and AVX-512 are needed)")
    slots, kv, heads, hd, n = args.slots, 3, 9, 64, args.rows
    span = whole_blocks(args.context)
    cap = span + 128
    g = torch.Generator().manual_seed(0)
    k16 = [torch.randn(slots, kv, cap, hd, generator=g).bfloat16() for _ in range(args.layers)]
    v16 = [torch.randn(slots, kv, cap, hd, generator=g).bfloat16() for _ in range(args.layers)]
    k32, v32 = [k.float() for k in k16], [v.float() for v in v16]
    q = torch.randn(slots, heads, n, hd, generator=g)
    mask = torch.zeros(slots, 1, n, span, dtype=torch.bool)
    mask[..., :args.context] = True
    paths = {"pure torch, float32 caches": (_Path(None), k32, v32), "native, bfloat16 caches": (_Path(kernels), k16, v16)}

    def attend(name, i, s=slice(None)):
        path, ks, vs = paths[name]
        return LeanLlama._grouped_attention(path, q[s], ks[i][s, :, :span], vs[i][s, :, :span], mask[s])

    a, b = (attend(name, 0) for name in paths)
    print(f"largest difference between the paths: {float((a - b).abs().max()):.2e} (values of mean size "
          f"{float(a.abs().mean()):.2f}); slot 0 alone the same bits as in the batch: "
          f"{torch.equal(attend('native, bfloat16 caches', 0, slice(0, 1)), b[:1])}")
    for name in paths:
        for i in range(args.layers):
            attend(name, i)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for i in range(args.layers):
                attend(name, i)
            times.append(time.perf_counter() - t)
        print(f"{slots} slots x {args.context} entries x {n} rows, {args.layers} layers, {name}: "
              f"{sorted(times)[2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
