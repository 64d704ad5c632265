// Float32 linear layers for the lean forward on an AVX2 + FMA CPU (verispec/backends/native/__init__.py builds this
// file): y [M, N] = x [M, K] @ W^T (+ bias), with W packed once into panels of 16 output columns, k-major, so that a
// pass over a panel streams it from memory once and keeps 6 rows x 16 columns of sums in 12 registers.
//
// ``pack_half``: the same panels in float16 (half the bytes to stream; ``linear`` takes either), each weight
// converted to float32 exactly as it is loaded: for a weight whose values are float16 values (a draft head saved in
// float16) the results are bit for bit those of the float32 kernel; any other weight is rounded to float16 once, when
// packed.
//
// Every output element is one chain of fused multiply-adds over k = 0 .. K-1 in order, whatever M is and wherever
// its row falls in a tile, then the bias: a row's result never depends on the rows beside it (batch-invariant by
// construction, like native/attention.cpp).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int NB = 16;  // output columns per panel (two 8-float registers)
constexpr int MR = 6;   // rows per pass over a panel (12 accumulators of the 16 registers)
constexpr int PREFETCH_ROWS = 6;  // a later pass of at least these rows fetches the next panel (below)

#define VS_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

// Sixteen weights of a panel's row k as two float32 registers, from float32 or float16 panels.
inline void load16(const float* wp, int64_t k, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(wp + k * NB), w1 = _mm256_loadu_ps(wp + k * NB + 8);
}
inline void load16(const uint16_t* wp, int64_t k, __m256& w0, __m256& w1) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * NB));
  w0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h)), w1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// R rows (1..MR) of x against one panel: ``cols`` (<= 16) output columns written to y (row stride N). ``next``, where
// given, is the panel to be read next, fetched into the cache meanwhile.
template <int R, typename W>
inline void tile(const float* x, int64_t K, const W* wp, float* y, int64_t N, int cols, const float* bias,
                 const W* next) {
  // named accumulators, not an array: GCC kept an array of them in memory under -fopenmp (3x slower)
#define VS_DECL(r) __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();
  VS_ROWS(VS_DECL)
  for (int64_t k = 0; k < K; ++k) {
    if (next) _mm_prefetch(reinterpret_cast<const char*>(next + k * NB), _MM_HINT_T0);
    __m256 w0, w1;
    load16(wp, k, w0, w1);
#define VS_FMA(r)                                                       \
  if constexpr (R > r) {                                                \
    const __m256 b = _mm256_broadcast_ss(x + r * K + k);                \
    c##r##0 = _mm256_fmadd_ps(w0, b, c##r##0);                          \
    c##r##1 = _mm256_fmadd_ps(w1, b, c##r##1);                          \
  }
    VS_ROWS(VS_FMA)
  }
  float bias16[NB] = {0};
  if (bias) std::memcpy(bias16, bias, sizeof(float) * cols);
  const __m256 b0 = _mm256_loadu_ps(bias16), b1 = _mm256_loadu_ps(bias16 + 8);
  float out[NB];
#define VS_STORE(r)                                                            \
  if constexpr (R > r) {                                                       \
    if (cols == NB) {                                                          \
      _mm256_storeu_ps(y + r * N, _mm256_add_ps(c##r##0, b0));                 \
      _mm256_storeu_ps(y + r * N + 8, _mm256_add_ps(c##r##1, b1));             \
    } else {                                                                   \
      _mm256_storeu_ps(out, _mm256_add_ps(c##r##0, b0));                       \
      _mm256_storeu_ps(out + 8, _mm256_add_ps(c##r##1, b1));                   \
      std::memcpy(y + r * N, out, sizeof(float) * cols);                       \
    }                                                                          \
  }
  VS_ROWS(VS_STORE)
}

template <typename W>
void run_tile(int rows, const float* x, int64_t K, const W* wp, float* y, int64_t N, int cols, const float* bias,
              const W* next) {
  switch (rows) {
    case 1: tile<1, W>(x, K, wp, y, N, cols, bias, next); break;
    case 2: tile<2, W>(x, K, wp, y, N, cols, bias, next); break;
    case 3: tile<3, W>(x, K, wp, y, N, cols, bias, next); break;
    case 4: tile<4, W>(x, K, wp, y, N, cols, bias, next); break;
    case 5: tile<5, W>(x, K, wp, y, N, cols, bias, next); break;
    default: tile<6, W>(x, K, wp, y, N, cols, bias, next); break;
  }
}

}  // namespace

// w [N, K] float32 -> panels [ceil(N / 16), K, 16] of ``dtype`` (float32, or float16: rounded to nearest) (the last
// panel's missing columns are zeros)
torch::Tensor pack_as(const torch::Tensor& w, torch::ScalarType dtype) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat, "weight: float32 [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = (N + NB - 1) / NB;
  auto padded = torch::zeros({P * NB, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, NB, K}).transpose(1, 2).to(dtype).contiguous();
}

torch::Tensor pack(const torch::Tensor& w) { return pack_as(w, torch::kFloat); }
torch::Tensor pack_half(const torch::Tensor& w) { return pack_as(w, torch::kHalf); }

// x [M, K] float32 (contiguous), panels from ``pack`` or ``pack_half``, N the weight's rows, bias [N] or None ->
// [M, N]
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool half = panels.scalar_type() == torch::kHalf;
  TORCH_CHECK(panels.dim() == 3 && (half || panels.scalar_type() == torch::kFloat) && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && panels.size(2) == NB && N > (panels.size(0) - 1) * NB &&
              N <= panels.size(0) * NB, "panels: float32 or float16 [ceil(N / 16), K, 16] from pack()");
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat && b.numel() == N, "bias: float32 [N]");
  }
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* bd = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  auto run = [&](auto* wd) {
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int cols = static_cast<int>(std::min<int64_t>(NB, N - p * NB));
        // more rows than one pass holds: the passes after the first read the panel from the cache and leave the
        // memory idle, so those of several rows fetch the thread's next panel meanwhile (its first pass then reads
        // the cache; a shorter pass is over before the memory could deliver it, and fetching stalls it)
        const auto* next = p + 1 < end ? wd + (p + 1) * K * NB : nullptr;
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
          const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
          run_tile(rows, xd + m0 * K, K, wd + p * K * NB, yd + m0 * N + p * NB, N, cols, bd ? bd + p * NB : nullptr,
                   m0 > 0 && rows >= PREFETCH_ROWS ? next : nullptr);
        }
      }
    });
  };
  if (half) {
    run(reinterpret_cast<const uint16_t*>(panels.data_ptr<at::Half>()));
  } else {
    run(panels.data_ptr<float>());
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "w [N, K] float32 -> panels [ceil(N/16), K, 16]");
  m.def("pack_half", &pack_half, "w [N, K] float32 -> float16 panels [ceil(N/16), K, 16] (rounded once)");
  m.def("linear", &linear, "x [M, K] @ w^T + bias from pack()'s or pack_half()'s panels");
}
