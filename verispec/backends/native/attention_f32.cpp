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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend", &attend, "softmax(scale * q . k + mask) . v over a float32 cache, per row in a fixed order");
}
