"""How fast could a batch's decoding attention be if it read a bfloat16 cache directly? A measurement, not part of the
library: two small AVX-512 kernels (built here with torch's ``cpp_extension``; needs g++ and ninja) compute the
scores and the weighted sum of values from bfloat16 keys and values with float32 arithmetic, summing in a fixed
order (so a row's result does not depend on the batch or on masked padding), against the lean forward's float32
path (``LeanLlama._grouped_attention``) over float32 caches; 30 layers' worth of caches, so that both read them
from memory as a real forward does.

    python scripts/experiments/bf16_attention_kernel.py --slots 8 --context 600
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline void load_bf16_row(const uint16_t* p, __m512 out[4]) {
  for (int c = 0; c < 4; ++c) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + 16 * c)));
    out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// q [P, M, 64] float, k [P, cap, 64] bf16 (as int16), out [P, M, span] float: out = scale * q . k
torch::Tensor scores(torch::Tensor q, torch::Tensor k, int64_t span, double scale) {
  const int64_t P = q.size(0), M = q.size(1), cap = k.size(1);
  auto out = torch::empty({P, M, span}, q.options());
  const float* qd = q.data_ptr<float>();
  const uint16_t* kd = (const uint16_t*)k.data_ptr<at::BFloat16>();
  float* od = out.data_ptr<float>();
  const float s = (float)scale;
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const int rows = (int)std::min<int64_t>(6, M - r0);
        __m512 qv[6][4];
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < 4; ++c) qv[r][c] = _mm512_loadu_ps(qd + (p * M + r0 + r) * 64 + 16 * c);
        for (int64_t j = 0; j < span; ++j) {
          __m512 kv[4];
          load_bf16_row(kd + (p * cap + j) * 64, kv);
          for (int r = 0; r < rows; ++r) {
            __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
            acc = _mm512_fmadd_ps(qv[r][1], kv[1], acc);
            acc = _mm512_fmadd_ps(qv[r][2], kv[2], acc);
            acc = _mm512_fmadd_ps(qv[r][3], kv[3], acc);
            od[(p * M + r0 + r) * span + j] = _mm512_reduce_add_ps(acc) * s;
          }
        }
      }
    }
  });
  return out;
}

// w [P, M, span] float, v [P, cap, 64] bf16, out [P, M, 64] float: out = w . v, summed over keys in order
torch::Tensor weighted(torch::Tensor w, torch::Tensor v) {
  const int64_t P = w.size(0), M = w.size(1), span = w.size(2), cap = v.size(1);
  auto out = torch::empty({P, M, 64}, w.options());
  const float* wd = w.data_ptr<float>();
  const uint16_t* vd = (const uint16_t*)v.data_ptr<at::BFloat16>();
  float* od = out.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) {
      for (int64_t r0 = 0; r0 < M; r0 += 6) {
        const int rows = (int)std::min<int64_t>(6, M - r0);
        __m512 acc[6][4];
        for (int r = 0; r < 6; ++r) for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
        for (int64_t j = 0; j < span; ++j) {
          __m512 vv[4];
          load_bf16_row(vd + (p * cap + j) * 64, vv);
          for (int r = 0; r < rows; ++r) {
            const __m512 x = _mm512_set1_ps(wd[(p * M + r0 + r) * span + j]);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(x, vv[c], acc[r][c]);
          }
        }
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(od + (p * M + r0 + r) * 64 + 16 * c, acc[r][c]);
      }
    }
  });
  return out;
}
"""


def build():
    return load_inline("verispec_bf16_attention", cpp_sources=SOURCE, functions=["scores", "weighted"],
                       extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma"], verbose=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--rows", type=int, default=2, help="query rows per sequence (one decoding row runs as two)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = build()
    from verispec.backends.lean import LeanLlama
    from verispec.backends.kv import whole_blocks

    slots, kv, group, hd, n = args.slots, 3, 3, 64, args.rows
    span = whole_blocks(args.context)
    cap = span + 128
    g = torch.Generator().manual_seed(0)
    k16 = [torch.randn(slots, kv, cap, hd, generator=g).bfloat16() for _ in range(args.layers)]
    v16 = [torch.randn(slots, kv, cap, hd, generator=g).bfloat16() for _ in range(args.layers)]
    k32, v32 = [k.float() for k in k16], [v.float() for v in v16]
    q = torch.randn(slots, kv * group, n, hd, generator=g)
    mask = torch.zeros(slots, 1, n, span, dtype=torch.bool)
    mask[..., :args.context] = True

    class Invariant:  # the lean forward's bfloat16 path, which attends in float32
        invariant = True

    def torch_path(i):
        return LeanLlama._grouped_attention(Invariant(), q, k32[i][:, :, :span], v32[i][:, :, :span], mask)

    def kernel_path(i):
        qq = q.reshape(slots * kv, group * n, hd)
        s = ext.scores(qq, k16[i].view(slots * kv, cap, hd), span, hd ** -0.5).view(slots, kv, group, n, span)
        s.masked_fill_(~mask[:, :, None], float("-inf"))
        w = torch.softmax(s, dim=-1).view(slots * kv, group * n, span)
        return ext.weighted(w, v16[i].view(slots * kv, cap, hd)).view(slots, kv * group, n, hd)

    a, b = torch_path(0), kernel_path(0)
    print(f"max difference from the float32 path: {float((a - b).abs().max()):.2e} (values of size "
          f"{float(a.abs().mean()):.2f})")
    # invariance: one slot alone, and with more masked padding, gives the same bits
    alone = ext.weighted(torch.softmax(ext.scores(q[:1].reshape(kv, group * n, hd), k16[0][:1].view(kv, cap, hd),
                                                  span, hd ** -0.5).view(1, kv, group, n, span)
                                       .masked_fill_(~mask[:1, :, None], float("-inf")), dim=-1)
                         .view(kv, group * n, span), v16[0][:1].view(kv, cap, hd))
    print("slot 0 alone bitwise equal to slot 0 in the batch:", torch.equal(alone.view(1, kv * group, n, hd), b[:1]))
    for name, f in (("float32 path, float32 caches", torch_path), ("kernels, bfloat16 caches", kernel_path)):
        for i in range(args.layers):
            f(i)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            for i in range(args.layers):
                f(i)
            times.append(time.perf_counter() - t)
        print(f"{slots} slots x {args.context} entries x {n} rows, {args.layers} layers: {name} "
              f"{sorted(times)[2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
