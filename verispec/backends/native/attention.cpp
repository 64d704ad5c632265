// Attention products over a bfloat16 key/value cache with float32 arithmetic, for the lean forward's bfloat16 path
// (verispec/backends/native.py builds this file). A row's result never depends on the rows, sequences or masked
// padding beside it: every score is one fixed sequence of operations over the head's 64 dimensions, and the
// weighted sum adds the keys in order, one accumulator per output element (a masked key has weight 0 and adds
// nothing), so the lean forward is batch- and row-invariant by construction.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int HD = 64;    // head dimension (the kernels' only one; others use torch's products)
constexpr int TILE = 6;   // query rows per pass over a sequence's keys (24 accumulators of 32 registers)

inline void load_row(const uint16_t* p, __m512 out[4]) {  // 64 bfloat16 values -> 4 x 16 float32 (exact)
  for (int c = 0; c < 4; ++c) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * c)));
    out[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& limits) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1), "shapes");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && q.is_contiguous(), "queries: contiguous float32");
  TORCH_CHECK(k.scalar_type() == torch::kBFloat16 && k.size(3) == HD && k.stride(3) == 1 && k.stride(2) == HD &&
              k.stride(0) == k.size(1) * k.stride(1), "keys/values: bfloat16 [slots, heads, span, 64] of a buffer");
  TORCH_CHECK(limits.dim() == 2 && limits.size(0) == q.size(0) && limits.scalar_type() == torch::kInt &&
              limits.is_contiguous() && q.size(2) % limits.size(1) == 0, "limits: int32 [slots, rows]");
}

// Keys a row sees lie before its limit (``limits`` [S, n]: one more than its last visible key; the query rows of a
// sequence are its query heads' n rows each, row m reading limit m % n): past it every key is masked, so the scores
// there are left unwritten (the caller masks them) and the weighted sum stops there (a masked key adds nothing).
inline int64_t tile_limit(const int32_t* lim, int64_t m0, int rows, int64_t n) {
  int64_t most = 0;
  for (int r = 0; r < rows; ++r) most = std::max<int64_t>(most, lim[(m0 + r) % n]);
  return most;
}

// Both products walk the same tiles: for each (slot, head) pair p of q [S, H, M, .], the query rows r0 .. r0 + rows
// (at most TILE) against the keys 0 .. stop, the last any of those rows sees; ``body(p, r0, rows, stop)`` does one.
template <typename Body>
void for_each_tile(const torch::Tensor& q, const torch::Tensor& limits, int64_t span, Body body) {
  const int64_t H = q.size(1), P = q.size(0) * H, M = q.size(2), n = limits.size(1);
  const int32_t* ld = limits.data_ptr<int32_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t r0 = 0; r0 < M; r0 += TILE) {
        const int rows = static_cast<int>(std::min<int64_t>(TILE, M - r0));
        body(p, r0, rows, std::min<int64_t>(span, tile_limit(ld + (p / H) * n, r0, rows, n)));
      }
    }
  });
}

}  // namespace

// q [S, H, M, 64] float32, k [S, H, span, 64] bfloat16 (a view of a buffer) -> [S, H, M, span]: scale * q . k
torch::Tensor scores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& limits, double scale) {
  check_inputs(q, k, limits);
  const int64_t M = q.size(2), span = k.size(2), ks = k.stride(1);
  auto out = torch::empty({q.size(0), q.size(1), M, span}, q.options());
  const float* qd = q.data_ptr<float>();
  const uint16_t* kd = reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>());
  float* od = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  for_each_tile(q, limits, span, [&](int64_t p, int64_t r0, int rows, int64_t stop) {
    __m512 qv[TILE][4];
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < 4; ++c) qv[r][c] = _mm512_loadu_ps(qd + (p * M + r0 + r) * HD + 16 * c);
    for (int64_t j = 0; j < stop; ++j) {
      __m512 kv[4];
      load_row(kd + p * ks + j * HD, kv);
      for (int r = 0; r < rows; ++r) {
        __m512 acc = _mm512_mul_ps(qv[r][0], kv[0]);
        acc = _mm512_fmadd_ps(qv[r][1], kv[1], acc);
        acc = _mm512_fmadd_ps(qv[r][2], kv[2], acc);
        acc = _mm512_fmadd_ps(qv[r][3], kv[3], acc);
        od[(p * M + r0 + r) * span + j] = _mm512_reduce_add_ps(acc) * s;
      }
    }
  });
  return out;
}

// w [S, H, M, span] float32, v [S, H, span, 64] bfloat16 (a view of a buffer) -> [S, H, M, 64]: w . v, keys in order
torch::Tensor weighted(const torch::Tensor& w, const torch::Tensor& v, const torch::Tensor& limits) {
  check_inputs(w, v, limits);
  TORCH_CHECK(w.size(3) == v.size(2), "weights and values disagree on the span");
  const int64_t M = w.size(2), span = w.size(3), vs = v.stride(1);
  auto out = torch::empty({w.size(0), w.size(1), M, HD}, w.options());
  const float* wd = w.data_ptr<float>();
  const uint16_t* vd = reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>());
  float* od = out.data_ptr<float>();
  for_each_tile(w, limits, span, [&](int64_t p, int64_t r0, int rows, int64_t stop) {
    __m512 acc[TILE][4];
    for (int r = 0; r < TILE; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < stop; ++j) {
      __m512 vv[4];
      load_row(vd + p * vs + j * HD, vv);
      for (int r = 0; r < rows; ++r) {
        const __m512 x = _mm512_set1_ps(wd[(p * M + r0 + r) * span + j]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(x, vv[c], acc[r][c]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(od + (p * M + r0 + r) * HD + 16 * c, acc[r][c]);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("scores", &scores, "scale * q . k over a bfloat16 cache");
  m.def("weighted", &weighted, "w . v over a bfloat16 cache, keys summed in order");
}
