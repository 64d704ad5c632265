// Attention over a float32 key/value cache on an AVX2 + FMA CPU, for the lean forward's float32 path
// (verispec/backends/native/__init__.py builds this file): scores, softmax and weighted sum of one query row at a
// time, the rows of a (slot, head) pair one after another on a thread so that its keys and values come from memory
// once and from the cache for the pair's other rows. A tree's extra rows add arithmetic, not memory traffic, so a
// drafted row costs little more than a decoding one; each row reads its keys only up to its last visible one.
//
// A row's result never depends on the rows, sequences or masked padding beside it: each score is one fixed sequence
// of operations over the head's 64 dimensions (eight lanes of fused multiply-adds, then one fixed tree of additions),
// the softmax's sum runs over the row's own keys in eight lanes in order, and the weighted sum adds the visible keys
// in order, one chain of fused multiply-adds per output element.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int HD = 64;   // head dimension (the kernels' only one; others use torch's products)

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& limits) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1), "shapes");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous(), "queries: contiguous float32");
  TORCH_CHECK(k.scalar_type() == torch::kFloat && k.size(3) == HD && k.stride(3) == 1 && k.stride(2) == HD &&
              k.stride(0) == k.size(1) * k.stride(1), "keys/values: float32 [slots, heads, span, 64] of a buffer");
  TORCH_CHECK(limits.dim() == 2 && limits.size(0) == q.size(0) && limits.scalar_type() == torch::kInt &&
              limits.is_contiguous() && q.size(2) % limits.size(1) == 0, "limits: int32 [slots, rows]");
}

// Four keys' scores from their eight-lane accumulators: lane sums added as ((0+1)+(2+3))+((4+5)+(6+7)) for each.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

inline __m256 dot_lanes(const float* kj, __m256 q0, __m256 q1, __m256 q2, __m256 q3, __m256 q4, __m256 q5,
                        __m256 q6, __m256 q7) {
  __m256 a = _mm256_mul_ps(q0, _mm256_loadu_ps(kj));
  a = _mm256_fmadd_ps(q1, _mm256_loadu_ps(kj + 8), a);
  a = _mm256_fmadd_ps(q2, _mm256_loadu_ps(kj + 16), a);
  a = _mm256_fmadd_ps(q3, _mm256_loadu_ps(kj + 24), a);
  a = _mm256_fmadd_ps(q4, _mm256_loadu_ps(kj + 32), a);
  a = _mm256_fmadd_ps(q5, _mm256_loadu_ps(kj + 40), a);
  a = _mm256_fmadd_ps(q6, _mm256_loadu_ps(kj + 48), a);
  return _mm256_fmadd_ps(q7, _mm256_loadu_ps(kj + 56), a);
}

// One row's scores for keys 0 .. stop-1, written in fours to ``out`` (room for up to three more: a four reaching past
// the span reads its last key again).
inline void score_row(const float* qr, const float* kp, int64_t span, int64_t stop, float s, float* out) {
  const __m256 q0 = _mm256_loadu_ps(qr), q1 = _mm256_loadu_ps(qr + 8), q2 = _mm256_loadu_ps(qr + 16),
               q3 = _mm256_loadu_ps(qr + 24), q4 = _mm256_loadu_ps(qr + 32), q5 = _mm256_loadu_ps(qr + 40),
               q6 = _mm256_loadu_ps(qr + 48), q7 = _mm256_loadu_ps(qr + 56);
  const __m128 scale = _mm_set1_ps(s);
  for (int64_t j = 0; j < stop; j += 4) {
    const float* k0 = kp + j * HD;
    const float* k1 = kp + std::min(j + 1, span - 1) * HD;
    const float* k2 = kp + std::min(j + 2, span - 1) * HD;
    const float* k3 = kp + std::min(j + 3, span - 1) * HD;
    const __m128 r = _mm_mul_ps(reduce4(dot_lanes(k0, q0, q1, q2, q3, q4, q5, q6, q7),
                                        dot_lanes(k1, q0, q1, q2, q3, q4, q5, q6, q7),
                                        dot_lanes(k2, q0, q1, q2, q3, q4, q5, q6, q7),
                                        dot_lanes(k3, q0, q1, q2, q3, q4, q5, q6, q7)), scale);
    _mm_storeu_ps(out + j, r);
  }
}

// e^x for x <= 0 (a max-subtracted score), 0 below -87 (and for -inf): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its
// degree-6 Taylor polynomial in Horner form (relative error about 2e-7), times 2^n set in the exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: the first exact in n
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(small, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// One query row's attention: scores for its keys 0 .. stop-1 (a masked key: -inf), their softmax, and the weighted
// sum of the values, keys added in order (a masked key is skipped: its weight is 0), divided by the weights' sum.
// ``buf`` holds stop rounded up to 8 floats and 4 more.
void attend_row(const float* qr, const float* kp, const float* vp, const bool* seen, int64_t span, int64_t stop,
                float scale, float* buf, float* out) {
  score_row(qr, kp, span, stop, scale, buf);
  const int64_t padded = (stop + 7) / 8 * 8;
  for (int64_t j = 0; j < stop; ++j)
    if (!seen[j]) buf[j] = -INFINITY;
  for (int64_t j = stop; j < padded; ++j) buf[j] = -INFINITY;
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < padded; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(buf + j));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const __m256 top = _mm256_set1_ps(_mm_cvtss_f32(h));
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < padded; j += 8) {  // eight lane sums over the keys in order, then one fixed tree
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(buf + j), top));
    _mm256_storeu_ps(buf + j, e);
    total = _mm256_add_ps(total, e);
  }
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  const float sum = _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
  // named accumulators (an array of them may be kept in memory under -fopenmp)
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t j = 0; j < stop; ++j) {
    if (!seen[j]) continue;
    const float* vj = vp + j * HD;
    const __m256 b = _mm256_broadcast_ss(buf + j);
    c0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj), c0);
    c1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 8), c1);
    c2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 16), c2);
    c3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 24), c3);
    c4 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 32), c4);
    c5 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 40), c5);
    c6 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 48), c6);
    c7 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 56), c7);
  }
  const __m256 d = _mm256_set1_ps(sum);
  _mm256_storeu_ps(out, _mm256_div_ps(c0, d)), _mm256_storeu_ps(out + 8, _mm256_div_ps(c1, d));
  _mm256_storeu_ps(out + 16, _mm256_div_ps(c2, d)), _mm256_storeu_ps(out + 24, _mm256_div_ps(c3, d));
  _mm256_storeu_ps(out + 32, _mm256_div_ps(c4, d)), _mm256_storeu_ps(out + 40, _mm256_div_ps(c5, d));
  _mm256_storeu_ps(out + 48, _mm256_div_ps(c6, d)), _mm256_storeu_ps(out + 56, _mm256_div_ps(c7, d));
}

}  // namespace

// softmax(scale * q . k + mask) . v: q [S, H, M, 64], k and v [S, H, span, 64] (views of a buffer), ``visible``
// [S, n, span] (bool: row m of a sequence is its query heads' row m % n), ``limits`` [S, n] (one more than a row's
// last visible key: nothing past it is read) -> [S, H, M, 64]. Split over query rows, a (slot, head) pair's rows one
// after another on a thread, so that its keys and values are read from memory once.
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& visible, const torch::Tensor& limits, double scale) {
  check_inputs(q, k, limits);
  check_inputs(q, v, limits);
  const int64_t S = q.size(0), H = q.size(1), P = S * H, M = q.size(2), span = k.size(2), n = limits.size(1);
  TORCH_CHECK(v.size(2) == span && k.stride(1) == v.stride(1), "keys and values: the same layout");
  TORCH_CHECK(visible.dim() == 3 && visible.size(0) == S && visible.size(1) == n && visible.size(2) == span &&
              visible.scalar_type() == torch::kBool && visible.is_contiguous(), "visible: bool [slots, rows, span]");
  const int64_t ks = k.stride(1);
  auto out = torch::empty({S, H, M, HD}, q.options());
  const float* qd = q.data_ptr<float>();
  const float* kd = k.data_ptr<float>();
  const float* vd = v.data_ptr<float>();
  const bool* md = visible.data_ptr<bool>();
  const int32_t* ld = limits.data_ptr<int32_t>();
  float* od = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, P * M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf((span + 7) / 8 * 8 + 8);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / M, r = item % M, slot = p / H, row = r % n;
      const int64_t stop = std::min<int64_t>(span, ld[slot * n + row]);
      TORCH_CHECK(stop > 0, "a query row sees no key");
      attend_row(qd + item * HD, kd + p * ks, vd + p * ks, md + (slot * n + row) * span, span, stop, s,
                 buf.data(), od + item * HD);
    }
  });
  return out;
}

// ``attend`` for a step's new rows as the lean forward makes them, with the step's keys and values written first:
// row r's keys and values ``k_new``, ``v_new`` [R, KV, 64] (rows of 64 in a row's stride) go into the buffers ``kbuf``,
// ``vbuf`` [S, KV, capacity, 64] at [slot[r], :, pos[r]]; then each row's query heads ``q`` [R, H, 64] attend to the
// first ``span`` entries of their slot's buffers with its mask row ``visible[slot[r], row[r]]`` ([S, n, span]) and
// ``limits`` [S, n]. Returns [R, H, 64]: each row's result is ``attend``'s for that row, bit for bit (the same
// ``attend_row`` on the same inputs), without a padded query tensor, the queries' and results' transposes, or the
// Python that writes the keys. The rows of a slot are consecutive; the work is split as ``attend`` splits it: a
// (slot, key/value head) pair's query rows one after another on a thread.
torch::Tensor append_attend(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                            torch::Tensor kbuf, torch::Tensor vbuf, const torch::Tensor& slot,
                            const torch::Tensor& pos, const torch::Tensor& row, const torch::Tensor& visible,
                            const torch::Tensor& limits, int64_t span, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == HD && q.scalar_type() == torch::kFloat && q.is_contiguous(),
              "queries: contiguous float32 [rows, heads, 64]");
  const int64_t R = q.size(0), H = q.size(1);
  TORCH_CHECK(kbuf.dim() == 4 && kbuf.scalar_type() == torch::kFloat && kbuf.is_contiguous() && kbuf.size(3) == HD &&
              vbuf.sizes() == kbuf.sizes() && vbuf.scalar_type() == torch::kFloat && vbuf.is_contiguous(),
              "buffers: contiguous float32 [slots, kv heads, capacity, 64]");
  const int64_t S = kbuf.size(0), KV = kbuf.size(1), cap = kbuf.size(2);
  TORCH_CHECK(KV > 0 && H % KV == 0 && span > 0 && span <= cap, "heads, span");
  for (const torch::Tensor* t : {&k_new, &v_new})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == R && t->size(1) == KV && t->size(2) == HD && t->stride(2) == 1 &&
                t->stride(1) == HD && t->scalar_type() == torch::kFloat, "new keys and values: float32 [rows, kv, 64]");
  for (const torch::Tensor* t : {&slot, &pos, &row})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == R && t->scalar_type() == torch::kInt && t->is_contiguous(),
                "slot, pos, row: int32 [rows]");
  TORCH_CHECK(visible.dim() == 3 && visible.size(2) == span && visible.scalar_type() == torch::kBool &&
              visible.is_contiguous() && visible.size(0) <= S, "visible: bool [slots, rows, span]");
  const int64_t n = visible.size(1), used = visible.size(0);
  TORCH_CHECK(limits.dim() == 2 && limits.size(0) == used && limits.size(1) == n &&
              limits.scalar_type() == torch::kInt && limits.is_contiguous(), "limits: int32 [slots, rows]");
  const int32_t* sd = slot.data_ptr<int32_t>();
  const int32_t* pd = pos.data_ptr<int32_t>();
  const int32_t* rd = row.data_ptr<int32_t>();
  float* kd = kbuf.data_ptr<float>();
  float* vd = vbuf.data_ptr<float>();
  const float* knd = k_new.data_ptr<float>();
  const float* vnd = v_new.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(sd[r] >= 0 && sd[r] < used && pd[r] >= 0 && pd[r] < span && rd[r] >= 0 && rd[r] < n,
                "a row's slot, position or mask row is out of range");
    TORCH_CHECK(r == 0 || sd[r] == sd[r - 1] || std::find(sd, sd + r, sd[r]) == sd + r,
                "a slot's rows are consecutive");
    for (int64_t h = 0; h < KV; ++h) {
      std::copy_n(knd + r * k_new.stride(0) + h * HD, HD, kd + ((sd[r] * KV + h) * cap + pd[r]) * HD);
      std::copy_n(vnd + r * v_new.stride(0) + h * HD, HD, vd + ((sd[r] * KV + h) * cap + pd[r]) * HD);
    }
  }
  // the work items in ``attend``'s order: per run of a slot's rows, per key/value head, its query heads' rows
  const int64_t G = H / KV;
  std::vector<int64_t> items;  // row * H + query head
  items.reserve(R * H);
  for (int64_t r0 = 0; r0 < R;) {
    int64_t r1 = r0 + 1;
    while (r1 < R && sd[r1] == sd[r0]) ++r1;
    for (int64_t h = 0; h < KV; ++h)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t r = r0; r < r1; ++r) items.push_back(r * H + h * G + g);
    r0 = r1;
  }
  auto out = torch::empty({R, H, HD}, q.options());
  const float* qd = q.data_ptr<float>();
  const bool* md = visible.data_ptr<bool>();
  const int32_t* ld = limits.data_ptr<int32_t>();
  float* od = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf((span + 7) / 8 * 8 + 8);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t item = items[i], r = item / H, head = item % H, h = head / G;
      const int64_t at = sd[r] * n + rd[r];
      const int64_t stop = std::min<int64_t>(span, ld[at]);
      TORCH_CHECK(stop > 0, "a query row sees no key");
      const int64_t pair = (sd[r] * KV + h) * cap * HD;
      attend_row(qd + item * HD, kd + pair, vd + pair, md + at * span, span, stop, s, buf.data(), od + item * HD);
    }
  });
  return out;
}

#ifndef VERISPEC_NO_MODULE  // layer.cpp includes this file for its functions, under its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "softmax(scale * q . k + mask) . v over a float32 cache, per row in a fixed order");
  m.def("append_attend", &append_attend, "a step's new keys and values written into their buffers, then attend");
}
#endif
