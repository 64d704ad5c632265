// Float32 linear layers for the lean forward on an AVX2 + FMA CPU (verispec/backends/native/__init__.py builds this
// file): y [M, N] = x [M, K] @ W^T (+ bias), with W packed once into panels of 16 output columns, k-major, so that a
// pass over a panel streams it from memory once and keeps 6 rows x 16 columns of sums in 12 registers.
//
// ``pack_half``: the same panels in float16 (half the bytes to stream; ``linear`` takes either), each weight
// converted to float32 exactly as it is loaded: for a weight whose values are float16 values (a draft head saved in
// float16) the results are bit for bit those of the float32 kernel; any other weight is rounded to float16 once, when
// packed.
//
// ``pack_exact``: a weight that is the de-quantisation of a GGUF file's Q4_1 or Q8_0 blocks (the default model's
// layers and output head) packed back into those blocks, 0.75 or 1.125 bytes a weight instead of 4. It finds, for
// every block of 32 weights of a row, the float16 scale d (and minimum m) and the integers q that give every weight
// bit for bit as the de-quantisation computed it, ``(d * q) + m`` (Q4_1) or ``q * d`` (Q8_0) in float32, and packs
// the weight only if every block has them (else it returns an empty tensor: the caller packs float32). The kernel
// recomputes each weight the same way (``d * q`` is exact in float32, an 11-bit d times a 4- or 8-bit q, so the only
// rounding is that of the sum with m) and then runs the very same sums: the results are bit for bit those of the
// float32 panels, from a fifth of the bytes.
//
// Every output element is one chain of fused multiply-adds over k = 0 .. K-1 in order, whatever M is and wherever
// its row falls in a tile, then the bias: a row's result never depends on the rows beside it (batch-invariant by
// construction, like native/attention.cpp).
//
// Built with AVX-512 (``__AVX512F__``, ``native.linear_avx512``), a few rows run 512-bit paths instead (``qtile_z``,
// ``tile_z``): the same recomputations and the same chains, so the same results bit for bit as the 256-bit build.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int NB = 16;  // output columns per panel (two 8-float registers)
constexpr int MR = 6;   // rows per pass over a panel (12 accumulators of the 16 registers)
// Rows of x against quantised panels (``linear_exact``): up to QTILE_ROWS in one pass recomputing each weight as it
// is read (at 6 the recomputation's registers and 12 accumulators no longer fit in 16), up to BLOCK_ROWS block by
// block (``block_rows``), more from a whole panel recomputed into memory first (docs/design.md, "The default model's
// weights stream from their GGUF blocks", has the timings).
constexpr int QTILE_ROWS = 5;
constexpr int BLOCK_ROWS = 48;
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

// ---- panels of de-quantised GGUF blocks (``pack_exact``) ----
// A panel is K / 32 blocks, each the 16 columns' float32 scales (and minima), then 32 rows k of 16 weights: Q4_1
// packs column c's q in the low nibble of byte c and column c + 8's in the high one (8 bytes a row), Q8_0 one byte a
// column.
constexpr int QB = 32;
constexpr int64_t Q4_BYTES = 2 * NB * 4 + QB * NB / 2;  // 384
constexpr int64_t Q8_BYTES = NB * 4 + QB * NB;          // 576

struct Q4 {
  static constexpr int64_t BYTES = Q4_BYTES;
  __m256 d0, d1, m0, m1;
  const uint8_t* q;
  inline void block(const uint8_t* b) {
    const float* f = reinterpret_cast<const float*>(b);
    d0 = _mm256_loadu_ps(f), d1 = _mm256_loadu_ps(f + 8), m0 = _mm256_loadu_ps(f + 16), m1 = _mm256_loadu_ps(f + 24);
    q = b + 4 * NB * 2;
  }
  inline void load(int kk, __m256& w0, __m256& w1) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * (NB / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    // d * q is exact, so the fused multiply-add rounds once, as the de-quantisation's sum did
    w0 = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m0);
    w1 = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m1);
  }
};

struct Q8 {
  static constexpr int64_t BYTES = Q8_BYTES;
  __m256 d0, d1;
  const uint8_t* q;
  inline void block(const uint8_t* b) {
    const float* f = reinterpret_cast<const float*>(b);
    d0 = _mm256_loadu_ps(f), d1 = _mm256_loadu_ps(f + 8);
    q = b + 4 * NB;
  }
  inline void load(int kk, __m256& w0, __m256& w1) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * NB));
    w0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d0);
    w1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d1);
  }
};

// R rows of x against one quantised panel: each weight recomputed as it is read, then the float32 tile's sums.
template <int R, typename Q>
inline void qtile(const float* x, int64_t K, const uint8_t* panel, float* y, int64_t N, int cols, const float* bias) {
  VS_ROWS(VS_DECL)
  Q src;
  for (int64_t k0 = 0; k0 < K; k0 += QB) {
    src.block(panel + (k0 / QB) * Q::BYTES);
    for (int kk = 0; kk < QB; ++kk) {
      const int64_t k = k0 + kk;
      __m256 w0, w1;
      src.load(kk, w0, w1);
      VS_ROWS(VS_FMA)
    }
  }
  float bias16[NB] = {0};
  if (bias) std::memcpy(bias16, bias, sizeof(float) * cols);
  const __m256 b0 = _mm256_loadu_ps(bias16), b1 = _mm256_loadu_ps(bias16 + 8);
  float out[NB];
  VS_ROWS(VS_STORE)
}

template <typename Q>
void run_qtile(int rows, const float* x, int64_t K, const uint8_t* panel, float* y, int64_t N, int cols,
               const float* bias) {
  switch (rows) {
    case 1: qtile<1, Q>(x, K, panel, y, N, cols, bias); break;
    case 2: qtile<2, Q>(x, K, panel, y, N, cols, bias); break;
    case 3: qtile<3, Q>(x, K, panel, y, N, cols, bias); break;
    case 4: qtile<4, Q>(x, K, panel, y, N, cols, bias); break;
    default: qtile<5, Q>(x, K, panel, y, N, cols, bias); break;  // QTILE_ROWS at most
  }
}

// The block of a panel that starts at k0, its 32 k of 16 weights recomputed into ``out`` (float32 [32][16]).
template <typename Q>
inline void unpack_block(const uint8_t* panel, int64_t k0, float* out) {
  Q src;
  src.block(panel + (k0 / QB) * Q::BYTES);
  for (int kk = 0; kk < QB; ++kk) {
    __m256 w0, w1;
    src.load(kk, w0, w1);
    _mm256_storeu_ps(out + kk * NB, w0);
    _mm256_storeu_ps(out + kk * NB + 8, w1);
  }
}

// One panel's weights as a float32 panel [K, 16] in ``out`` (more rows than one pass: recomputed once, not per pass).
template <typename Q>
void unpack_panel(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t k0 = 0; k0 < K; k0 += QB) unpack_block<Q>(panel, k0, out + k0 * NB);
}

// R rows of x (row stride K) against one recomputed block of a panel: its 32 k of 16 weights in ``w`` (float32
// [32][16]); the rows' running sums, ``acc`` [R][16], loaded, carried on over the block in k order and stored back.
template <int R>
inline void block_tile(const float* x, int64_t K, int64_t k0, const float* w, float* acc) {
#define VS_LOAD_SUMS(r)                                                                            \
  __m256 c##r##0 = R > r ? _mm256_loadu_ps(acc + r * NB) : _mm256_setzero_ps();                    \
  __m256 c##r##1 = R > r ? _mm256_loadu_ps(acc + r * NB + 8) : _mm256_setzero_ps();
  VS_ROWS(VS_LOAD_SUMS)
  for (int kk = 0; kk < QB; ++kk) {
    const int64_t k = k0 + kk;
    const __m256 w0 = _mm256_loadu_ps(w + kk * NB), w1 = _mm256_loadu_ps(w + kk * NB + 8);
    VS_ROWS(VS_FMA)
  }
#define VS_SAVE_SUMS(r)                                                                            \
  if constexpr (R > r) {                                                                           \
    _mm256_storeu_ps(acc + r * NB, c##r##0);                                                       \
    _mm256_storeu_ps(acc + r * NB + 8, c##r##1);                                                   \
  }
  VS_ROWS(VS_SAVE_SUMS)
}

inline void run_block_tile(int rows, const float* x, int64_t K, int64_t k0, const float* w, float* acc) {
  switch (rows) {
    case 1: block_tile<1>(x, K, k0, w, acc); break;
    case 2: block_tile<2>(x, K, k0, w, acc); break;
    case 3: block_tile<3>(x, K, k0, w, acc); break;
    case 4: block_tile<4>(x, K, k0, w, acc); break;
    case 5: block_tile<5>(x, K, k0, w, acc); break;
    default: block_tile<6>(x, K, k0, w, acc); break;
  }
}

// M rows of x against one quantised panel, block by block: each block's weights recomputed once into ``w`` (2 KiB,
// in the first-level cache) for all rows, then every pass of up to MR rows carries its sums over that block (kept in
// ``acc`` [M][16] between blocks). Each output is the same chain of multiply-adds over k in order as ``qtile``'s and
// ``tile``'s, then the bias. For a few passes' worth of rows: one recomputation of the weights serves them all,
// without a whole panel recomputed into memory first.
template <typename Q>
void block_rows(int64_t M, const float* x, int64_t K, const uint8_t* panel, float* y, int64_t N, int cols,
                const float* bias, float* acc) {
  alignas(32) float w[QB * NB];
  std::fill(acc, acc + M * NB, 0.0f);
  for (int64_t k0 = 0; k0 < K; k0 += QB) {
    unpack_block<Q>(panel, k0, w);
    for (int64_t m0 = 0; m0 < M; m0 += MR) {
      run_block_tile(static_cast<int>(std::min<int64_t>(MR, M - m0)), x + m0 * K, K, k0, w, acc + m0 * NB);
    }
  }
  float bias16[NB] = {0};
  if (bias) std::memcpy(bias16, bias, sizeof(float) * cols);
  const __m256 b0 = _mm256_loadu_ps(bias16), b1 = _mm256_loadu_ps(bias16 + 8);
  float out[NB];
  for (int64_t r = 0; r < M; ++r) {
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(acc + r * NB), b0));
    _mm256_storeu_ps(out + 8, _mm256_add_ps(_mm256_loadu_ps(acc + r * NB + 8), b1));
    std::memcpy(y + r * N, out, sizeof(float) * cols);
  }
}

#ifdef __AVX512F__
// ---- the same sums, sixteen columns to a register (the build for AVX-512 CPUs: ``native.linear_avx512``) ----
// One 512-bit register holds a row's 16 sums, so one pass keeps ZR rows' sums in registers (of 32) where the 256-bit
// code keeps 5 (of 16), and each weight is recomputed once for up to ZR rows. Each weight is recomputed with the same
// exact operations and each output is the same chain of fused multiply-adds over k in order, then the bias: the
// results are bit for bit those of the 256-bit code.
constexpr int ZR = 16;  // rows against quantised panels in one pass (more: the 256-bit code, no faster here)
constexpr int ZT = 8;   // the same against float32 or float16 panels
#define VS_ZROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)

struct Q4z {
  static constexpr int64_t BYTES = Q4_BYTES;
  __m512 d, m;
  const uint8_t* q;
  inline void block(const uint8_t* b) {
    const float* f = reinterpret_cast<const float*>(b);
    d = _mm512_loadu_ps(f), m = _mm512_loadu_ps(f + 16);
    q = b + 4 * NB * 2;
  }
  inline __m512 load(int kk) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + kk * (NB / 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(b, mask), _mm_and_si128(_mm_srli_epi16(b, 4), mask));
    return _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(both)), m);
  }
};

struct Q8z {
  static constexpr int64_t BYTES = Q8_BYTES;
  __m512 d;
  const uint8_t* q;
  inline void block(const uint8_t* b) {
    d = _mm512_loadu_ps(reinterpret_cast<const float*>(b));
    q = b + 4 * NB;
  }
  inline __m512 load(int kk) const {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + kk * NB));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
  }
};

// The rows' sums plus the bias (zeros where there is none, as the 256-bit code adds them), ``cols`` columns of each.
#define VS_ZSTORE(r)                                                                               \
  if constexpr (R > r) {                                                                           \
    const __m512 s = _mm512_add_ps(c##r, b16);                                                     \
    if (cols == NB) _mm512_storeu_ps(y + r * N, s); else _mm512_mask_storeu_ps(y + r * N, mask, s); \
  }
#define VS_ZFMA(r) \
  if constexpr (R > r) c##r = _mm512_fmadd_ps(w, _mm512_set1_ps(x[r * K + k]), c##r);

inline __m512 bias_z(const float* bias, int cols) {
  return bias ? _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << cols) - 1), bias) : _mm512_setzero_ps();
}

// R rows (1..ZR) of x against one quantised panel, each weight recomputed as it is read.
template <int R, typename Q>
inline void qtile_z(const float* x, int64_t K, const uint8_t* panel, float* y, int64_t N, int cols,
                    const float* bias) {
#define VS_ZDECL(r) __m512 c##r = _mm512_setzero_ps();
  VS_ZROWS(VS_ZDECL)
  Q src;
  for (int64_t k0 = 0; k0 < K; k0 += QB) {
    src.block(panel + (k0 / QB) * Q::BYTES);
    for (int kk = 0; kk < QB; ++kk) {
      const int64_t k = k0 + kk;
      const __m512 w = src.load(kk);
      VS_ZROWS(VS_ZFMA)
    }
  }
  const __m512 b16 = bias_z(bias, cols);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  VS_ZROWS(VS_ZSTORE)
}

inline __m512 load16_z(const float* wp, int64_t k) { return _mm512_loadu_ps(wp + k * NB); }
inline __m512 load16_z(const uint16_t* wp, int64_t k) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wp + k * NB)));
}

// R rows (1..ZT) of x against a float32 or float16 panel [K][16].
template <int R, typename W>
inline void tile_z(const float* x, int64_t K, const W* wp, float* y, int64_t N, int cols, const float* bias) {
  VS_ZROWS(VS_ZDECL)
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w = load16_z(wp, k);
    VS_ZROWS(VS_ZFMA)
  }
  const __m512 b16 = bias_z(bias, cols);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  VS_ZROWS(VS_ZSTORE)
}

template <typename Q>
void run_qtile_z(int rows, const float* x, int64_t K, const uint8_t* panel, float* y, int64_t N, int cols,
                 const float* bias) {
  switch (rows) {
#define VS_ZCASE(r) case r + 1: qtile_z<r + 1, Q>(x, K, panel, y, N, cols, bias); break;
    VS_ZROWS(VS_ZCASE)
    default: break;
  }
}

template <typename W>
void run_tile_z(int rows, const float* x, int64_t K, const W* wp, float* y, int64_t N, int cols,
                const float* bias) {
  switch (rows) {
    case 1: tile_z<1, W>(x, K, wp, y, N, cols, bias); break;
    case 2: tile_z<2, W>(x, K, wp, y, N, cols, bias); break;
    case 3: tile_z<3, W>(x, K, wp, y, N, cols, bias); break;
    case 4: tile_z<4, W>(x, K, wp, y, N, cols, bias); break;
    case 5: tile_z<5, W>(x, K, wp, y, N, cols, bias); break;
    case 6: tile_z<6, W>(x, K, wp, y, N, cols, bias); break;
    case 7: tile_z<7, W>(x, K, wp, y, N, cols, bias); break;
    default: tile_z<ZT, W>(x, K, wp, y, N, cols, bias); break;  // ZT at most
  }
}
#endif

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float half_float(uint16_t h) { return _cvtsh_ss(h); }

// The float16 scale d that ``fit`` accepts (``fit(d)``: whether integers q give the block's weights bit for bit with
// it, writing them), tried from the float16 nearest to ``estimate`` outwards, ``reach`` steps each way.
template <typename Fit>
bool find_scale(float estimate, int reach, float* d_out, Fit fit) {
  const int near = _cvtss_sh(estimate, 0);
  for (int step = 0; step <= 2 * reach; ++step) {
    const int h = near + (step % 2 ? -(step + 1) / 2 : step / 2);  // near, near - 1, near + 1, ...
    if (h < 0 || h > 0x7BFF) continue;  // a positive float16 (or zero), not infinity
    const float d = half_float(static_cast<uint16_t>(h));
    if (fit(d)) {
      *d_out = d;
      return true;
    }
  }
  return false;
}

// A Q4_1 block: m is the smallest weight (q = 0 gives m itself), d near (largest - m) / 15; ``d * q`` is exact, so
// ``d * q + m`` rounds once, fused or not.
bool q4_block(const float* v, float* d_out, float* m_out, uint8_t* q) {
  float lo = v[0], hi = v[0];
  for (int i = 1; i < QB; ++i) lo = std::min(lo, v[i]), hi = std::max(hi, v[i]);
  const float m = lo;
  if (!std::isfinite(m) || !std::isfinite(hi) || bits(half_float(_cvtss_sh(m, 0))) != bits(m)) return false;
  *m_out = m;
  return find_scale((hi - m) / 15.0f, 3, d_out, [&](float d) {
    for (int i = 0; i < QB; ++i) {
      const float t = d > 0 ? std::nearbyint((v[i] - m) / d) : 0.0f;
      if (!(t >= 0 && t <= 15) || bits(d * t + m) != bits(v[i])) return false;
      q[i] = static_cast<uint8_t>(t);
    }
    return true;
  });
}

// A Q8_0 block: d near the largest magnitude / 127, each weight ``q * d`` exactly.
bool q8_block(const float* v, float* d_out, int8_t* q) {
  float amax = 0;
  for (int i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(v[i]));
  if (!std::isfinite(amax)) return false;
  return find_scale(amax / 127.0f, 2, d_out, [&](float d) {
    for (int i = 0; i < QB; ++i) {
      const float t = d > 0 ? std::nearbyint(v[i] / d) : 0.0f;
      if (!(t >= -128 && t <= 127) || bits(t * d) != bits(v[i])) return false;
      q[i] = static_cast<int8_t>(t);
    }
    return true;
  });
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

// w [N, K] float32 -> uint8 panels [ceil(N / 16), K / 32, 384] of Q4_1 blocks or [.., 576] of Q8_0 blocks that give
// every weight bit for bit (Q4_1 tried first), or an empty tensor where K is not a multiple of 32 or some block has
// neither form (the caller then packs float32). The last panel's missing columns are zero blocks.
torch::Tensor pack_exact(const torch::Tensor& w_) {
  TORCH_CHECK(w_.dim() == 2 && w_.scalar_type() == torch::kFloat, "weight: float32 [N, K]");
  const torch::Tensor w = w_.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = (N + NB - 1) / NB, B = K / QB;
  if (K % QB != 0 || N == 0) return torch::empty({0}, torch::kUInt8);
  const float* wd = w.data_ptr<float>();
  for (int format = 4; format <= 8; format += 4) {
    const int64_t bytes = format == 4 ? Q4_BYTES : Q8_BYTES;
    auto out = torch::zeros({P, B, bytes}, torch::kUInt8);
    uint8_t* od = out.data_ptr<uint8_t>();
    std::atomic<bool> ok{true};
    at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {  // by panels: a byte holds two columns' q
      uint8_t q[QB];
      for (int64_t n = begin * NB; n < std::min(N, end * NB) && ok.load(std::memory_order_relaxed); ++n) {
        const int64_t p = n / NB, c = n % NB;
        for (int64_t b = 0; b < B; ++b) {
          uint8_t* blk = od + (p * B + b) * bytes;
          float* f = reinterpret_cast<float*>(blk);
          const float* v = wd + n * K + b * QB;
          const bool found = format == 4 ? q4_block(v, f + c, f + NB + c, q)
                                         : q8_block(v, f + c, reinterpret_cast<int8_t*>(q));
          if (!found) {
            ok.store(false, std::memory_order_relaxed);
            return;
          }
          uint8_t* rows = blk + (format == 4 ? 2 : 1) * 4 * NB;
          for (int kk = 0; kk < QB; ++kk) {
            if (format == 8) {
              rows[kk * NB + c] = q[kk];
            } else {
              uint8_t& byte = rows[kk * (NB / 2) + c % 8];
              byte = static_cast<uint8_t>(c < 8 ? (byte & 0xF0) | q[kk] : (byte & 0x0F) | (q[kk] << 4));
            }
          }
        }
      }
    });
    if (ok.load()) return out;
  }
  return torch::empty({0}, torch::kUInt8);
}

// The bias as a contiguous float32 [N] tensor (undefined where there is none).
torch::Tensor checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  torch::Tensor b = bias->contiguous();
  TORCH_CHECK(b.scalar_type() == torch::kFloat && b.numel() == N, "bias: float32 [N]");
  return b;
}

// ``linear`` on ``pack_exact``'s panels: up to QTILE_ROWS rows recompute each weight as they read it, up to
// BLOCK_ROWS recompute each block once for all (``block_rows``), more recompute a panel once into a float32 panel and
// run the float32 tiles on it. Every way, each output is the same chain of multiply-adds: the same results bit for bit.
torch::Tensor linear_exact(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                           const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && K % QB == 0 && panels.size(1) == K / QB &&
              (panels.size(2) == Q4_BYTES || panels.size(2) == Q8_BYTES) && N > (P - 1) * NB && N <= P * NB,
              "panels: uint8 [ceil(N / 16), K / 32, 384 or 576] from pack_exact()");
  const torch::Tensor b = checked_bias(bias, N);
  const bool q4 = panels.size(2) == Q4_BYTES;
  const int64_t stride = (K / QB) * panels.size(2);
  auto y = torch::empty({M, N}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* bd = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const uint8_t* pd = panels.data_ptr<uint8_t>();
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> unpacked(M > BLOCK_ROWS ? K * NB : 0);
    std::vector<float> sums(M > QTILE_ROWS && M <= BLOCK_ROWS ? M * NB : 0);
    for (int64_t p = begin; p < end; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NB, N - p * NB));
      const uint8_t* panel = pd + p * stride;
      const float* bp = bd ? bd + p * NB : nullptr;
#ifdef __AVX512F__
      if (M <= ZR) {
        if (q4) {
          run_qtile_z<Q4z>(static_cast<int>(M), xd, K, panel, yd + p * NB, N, cols, bp);
        } else {
          run_qtile_z<Q8z>(static_cast<int>(M), xd, K, panel, yd + p * NB, N, cols, bp);
        }
        continue;
      }
#endif
      if (M > QTILE_ROWS && M <= BLOCK_ROWS) {
        if (q4) {
          block_rows<Q4>(M, xd, K, panel, yd + p * NB, N, cols, bp, sums.data());
        } else {
          block_rows<Q8>(M, xd, K, panel, yd + p * NB, N, cols, bp, sums.data());
        }
        continue;
      }
      if (M <= QTILE_ROWS) {
        if (q4) {
          run_qtile<Q4>(static_cast<int>(M), xd, K, panel, yd + p * NB, N, cols, bp);
        } else {
          run_qtile<Q8>(static_cast<int>(M), xd, K, panel, yd + p * NB, N, cols, bp);
        }
        continue;
      }
      if (q4) {
        unpack_panel<Q4>(panel, K, unpacked.data());
      } else {
        unpack_panel<Q8>(panel, K, unpacked.data());
      }
      for (int64_t m0 = 0; m0 < M; m0 += MR) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m0));
        run_tile<float>(rows, xd + m0 * K, K, unpacked.data(), yd + m0 * N + p * NB, N, cols, bp, nullptr);
      }
    }
  });
  return y;
}

// x [M, K] float32 (contiguous), panels from ``pack`` or ``pack_half``, N the weight's rows, bias [N] or None ->
// [M, N]
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& panels, int64_t N,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  if (panels.scalar_type() == torch::kByte) return linear_exact(x, panels, N, bias);
  const bool half = panels.scalar_type() == torch::kHalf;
  TORCH_CHECK(panels.dim() == 3 && (half || panels.scalar_type() == torch::kFloat) && panels.is_contiguous() &&
              panels.size(1) == x.size(1) && panels.size(2) == NB && N > (panels.size(0) - 1) * NB &&
              N <= panels.size(0) * NB, "panels: float32 or float16 [ceil(N / 16), K, 16] from pack()");
  const torch::Tensor b = checked_bias(bias, N);
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
#ifdef __AVX512F__
        if (M <= ZT) {
          run_tile_z(static_cast<int>(M), xd, K, wd + p * K * NB, yd + p * NB, N, cols, bd ? bd + p * NB : nullptr);
          continue;
        }
#endif
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

#ifndef VERISPEC_NO_MODULE  // layer.cpp includes this file for its functions, under its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "w [N, K] float32 -> panels [ceil(N/16), K, 16]");
  m.def("pack_half", &pack_half, "w [N, K] float32 -> float16 panels [ceil(N/16), K, 16] (rounded once)");
  m.def("pack_exact", &pack_exact,
        "w [N, K] float32 -> uint8 panels of Q4_1 or Q8_0 blocks giving w bit for bit, or an empty tensor");
  m.def("linear", &linear, "x [M, K] @ w^T + bias from pack()'s, pack_half()'s or pack_exact()'s panels");
}
#endif
