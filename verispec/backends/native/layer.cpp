// The lean forward's float32 decoder layers in one native call (verispec/backends/native/__init__.py builds this file
// with the flags of the linear kernel it stands beside): per layer the input norm, q, k and v as one stacked linear
// call, the rotary positions of the queries and keys, the step's keys and values written and every row's attention,
// o and the residual, the second norm, gate and up as one call, SiLU times up, down and the residual. The same
// functions on the same tensors as the Python loop it replaces (``LeanLlama.forward_batch`` with ``_native_calls``):
// the linear, attention and rotary kernels are those files' own code, compiled into this one; the norms and SiLU
// times up are this file's ``rms_norm`` and ``silu_mul``, which the loop calls too; the residual sums are IEEE sums
// in place, torch's ``x + y`` bit for bit. So the results are the loop's bit for bit, without the Python of some 20
// operations a layer nor torch's operators between the kernels, and with the interpreter's lock released while it
// runs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#define VERISPEC_NO_MODULE  // the included files' functions, without their modules
namespace vs_linear {
#include "linear.cpp"
}  // namespace vs_linear
namespace vs_attention {
#include "attention_f32.cpp"
}  // namespace vs_attention
// rope.cpp is built on its own with -ffp-contract=off (torch's three roundings per element, no fused multiply-add)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace vs_rope {
#include "rope.cpp"
}  // namespace vs_rope
#pragma GCC pop_options

namespace {

using torch::Tensor;

Tensor linear(const Tensor& x, const Tensor& panels, int64_t n, const Tensor& bias) {
  return vs_linear::linear(x, panels, n, bias.numel() ? c10::optional<Tensor>(bias) : c10::nullopt);
}

// One row's norm: (x * r) * w with r = 1 / sqrt(sum(x * x) / D + eps). The sum of squares runs in eight lanes, lane
// j summing elements j, j + 8, ... in order with fused multiply-adds, the lanes then added as ((0 + 1) + (2 + 3)) +
// ((4 + 5) + (6 + 7)): the same result on every CPU this file builds for, whatever rows come with it.
inline void rms_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < D; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  alignas(32) float lane[8];
  _mm256_store_ps(lane, acc);
  const float sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  const __m256 r = _mm256_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(D) + eps));
  for (int64_t i = 0; i < D; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r), _mm256_loadu_ps(w + i)));
}

// x += y for contiguous float32 tensors of one shape: IEEE sums, the same bits as torch's ``x + y``.
void add_into(Tensor& x, const Tensor& y) {
  TORCH_CHECK(y.is_contiguous() && y.sizes() == x.sizes(), "a residual of the stream's shape");
  float* xd = x.data_ptr<float>();
  const float* yd = y.data_ptr<float>();
  for (int64_t i = 0, n = x.numel(); i < n; ++i) xd[i] += yd[i];
}

}  // namespace

// SiLU of the gate times up, e^-g by a fixed arithmetic (below) without contraction: the same results on the 256- and
// 512-bit builds and for a row whatever rows come with it.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

// e^x for x in [-87.3, 88.3] (inputs beyond are clamped there): n = round(x log2 e), r = x - n ln 2 in two parts, e^r
// by Cephes' degree-7 polynomial, times 2^n built in the exponent bits: a relative error of about 1e-7.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Eight gates g and ups u: g / (1 + e^-g) * u.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

// Rows of F gates and ups (``g``, ``u`` with row strides ``gs``, ``us``) into ``y`` [R, F]; a tail of fewer than eight
// runs through the same eight-wide arithmetic on a padded copy.
void silu_mul_rows(const float* g, int64_t gs, const float* u, int64_t us, float* y, int64_t R, int64_t F) {
  const int64_t whole = F - F % 8;
  for (int64_t r = 0; r < R; ++r) {
    const float* gr = g + r * gs;
    const float* ur = u + r * us;
    float* yr = y + r * F;
    for (int64_t i = 0; i < whole; i += 8)
      _mm256_storeu_ps(yr + i, silu_mul8(_mm256_loadu_ps(gr + i), _mm256_loadu_ps(ur + i)));
    if (whole < F) {
      alignas(32) float a[8] = {0}, b[8] = {0}, c[8];
      std::memcpy(a, gr + whole, (F - whole) * sizeof(float));
      std::memcpy(b, ur + whole, (F - whole) * sizeof(float));
      _mm256_store_ps(c, silu_mul8(_mm256_load_ps(a), _mm256_load_ps(b)));
      std::memcpy(yr + whole, c, (F - whole) * sizeof(float));
    }
  }
}

}  // namespace
#pragma GCC pop_options

// The lean forward's float32 SiLU(gate) * up (``silu_mul_rows``) of ``gate``, ``up`` [R, F] (float32, each row
// contiguous; views of one output are fine): in the layers below and in the Python loop alike.
Tensor silu_mul(const Tensor& gate, const Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.scalar_type() == torch::kFloat &&
              up.scalar_type() == torch::kFloat && gate.stride(1) == 1 && up.stride(1) == 1,
              "gate, up: float32 [R, F] with contiguous rows");
  auto y = torch::empty(gate.sizes(), gate.options());
  silu_mul_rows(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), y.data_ptr<float>(),
                gate.size(0), gate.size(1));
  return y;
}

// The lean forward's float32 RMS norm of every row of ``x`` [R, D] (contiguous float32, D a multiple of 8) with the
// weight ``w`` [D] (``rms_row``): in the layers below and in the Python loop alike, so both give the same results.
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) % 8 == 0,
              "x: contiguous float32 [R, D], D a multiple of 8");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == torch::kFloat && w.is_contiguous(),
              "w: contiguous float32 [D]");
  const int64_t R = x.size(0), D = x.size(1);
  auto y = torch::empty_like(x);
  const float* xd = x.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  float* yd = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) rms_row(xd + r * D, wd, yd + r * D, D, static_cast<float>(eps));
  return y;
}

// ``x`` [R, D] float32 (contiguous) through L decoder layers. Per layer l: ``norms`` [2l], [2l + 1] the input and
// post-attention norms' weights; ``panels`` [4l .. 4l + 3] the native kernel's panels of q, k and v stacked, o, gate
// and up stacked, down, with ``biases`` beside them (an empty tensor: none) and ``widths`` [7l .. 7l + 6] the output
// widths of q, k, v, o, gate, up and down. The rows are S groups, group s rows ``bounds[s]`` .. ``bounds[s + 1]``, each
// attending on buffers of its own: ``kbufs``, ``vbufs`` [l * S + s] layer l's key and value buffers of group s
// ([slots, kv heads, capacity, 64], or [kv heads, capacity, 64] for one sequence's own), with ``slot``, ``pos``,
// ``row``, ``visible``, ``limits`` and ``span`` [s] as ``append_attend`` takes them for its rows (the same every
// layer): one group for a pooled batch or one sequence, a group a sequence for sequences on caches of their own (the
// linear layers read the weights once for all rows). ``cos``, ``sin`` [R, 64] the rows' rotary tables. Returns x after
// each layer l + 1 in ``keep`` (in order), then after the last.
std::vector<Tensor> layers(Tensor x, const std::vector<Tensor>& norms, double eps, const std::vector<Tensor>& panels,
                           const std::vector<Tensor>& biases, const std::vector<int64_t>& widths, int64_t heads,
                           int64_t kv_heads, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& kbufs,
                           const std::vector<Tensor>& vbufs, const std::vector<int64_t>& bounds,
                           const std::vector<Tensor>& slot, const std::vector<Tensor>& pos,
                           const std::vector<Tensor>& row, const std::vector<Tensor>& visible,
                           const std::vector<Tensor>& limits, const std::vector<int64_t>& span, double scale,
                           const std::vector<int64_t>& keep) {
  const int64_t S = static_cast<int64_t>(bounds.size()) - 1, R = x.size(0);
  TORCH_CHECK(S >= 1 && bounds[0] == 0 && bounds[S] == R, "bounds: 0 .. rows, one group or more");
  for (int64_t g = 0; g < S; ++g) TORCH_CHECK(bounds[g] < bounds[g + 1], "a group has rows");
  TORCH_CHECK(static_cast<int64_t>(slot.size()) == S && static_cast<int64_t>(pos.size()) == S &&
              static_cast<int64_t>(row.size()) == S && static_cast<int64_t>(visible.size()) == S &&
              static_cast<int64_t>(limits.size()) == S && static_cast<int64_t>(span.size()) == S &&
              static_cast<int64_t>(kbufs.size()) % S == 0, "per group: buffers of every layer and its attention");
  const int64_t L = static_cast<int64_t>(kbufs.size()) / S;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [R, D]");
  TORCH_CHECK(static_cast<int64_t>(vbufs.size()) == L * S && static_cast<int64_t>(norms.size()) == 2 * L &&
              static_cast<int64_t>(panels.size()) == 4 * L && static_cast<int64_t>(biases.size()) == 4 * L &&
              static_cast<int64_t>(widths.size()) == 7 * L, "per layer: 2 norms, 4 panels and biases, 7 widths");
  for (int64_t l = 0; l < L; ++l)
    TORCH_CHECK(widths[7 * l + 4] == widths[4] && widths[7 * l + 5] == widths[4], "every gate and up as wide");
  x = x.clone();  // the residual stream, added into in place (the caller's x stays as it was)
  Tensor act = torch::empty({R, L ? widths[4] : 0}, x.options());  // SiLU(gate) * up, every layer's in turn
  std::vector<Tensor> out;
  size_t next = 0;
  for (int64_t l = 0; l < L; ++l) {
    const int64_t* w = widths.data() + 7 * l;
    TORCH_CHECK(w[0] == heads * vs_attention::HD && w[1] == kv_heads * vs_attention::HD && w[2] == w[1],
                "q, k and v: heads x 64 wide");
    Tensor h = rms_norm(x, norms[2 * l], eps);
    std::vector<Tensor> qkv = linear(h, panels[4 * l], w[0] + w[1] + w[2], biases[4 * l]).split({w[0], w[1], w[2]}, 1);
    Tensor q = qkv[0].contiguous().view({R, heads, vs_attention::HD});
    Tensor k = qkv[1].contiguous().view({R, kv_heads, vs_attention::HD});
    Tensor v = qkv[2].view({R, kv_heads, vs_attention::HD});
    vs_rope::rope_(q, cos, sin);
    vs_rope::rope_(k, cos, sin);
    std::vector<Tensor> parts;
    for (int64_t g = 0; g < S; ++g) {
      const Tensor& kg = kbufs[l * S + g];
      const Tensor& vg = vbufs[l * S + g];
      const int64_t r0 = bounds[g], n = bounds[g + 1] - bounds[g];
      parts.push_back(vs_attention::append_attend(
          S == 1 ? q : q.narrow(0, r0, n), S == 1 ? k : k.narrow(0, r0, n), S == 1 ? v : v.narrow(0, r0, n),
          kg.dim() == 3 ? kg.unsqueeze(0) : kg, vg.dim() == 3 ? vg.unsqueeze(0) : vg, slot[g], pos[g], row[g],
          visible[g], limits[g], span[g], scale));
    }
    Tensor o = S == 1 ? parts[0] : torch::cat(parts);
    add_into(x, linear(o.view({R, heads * vs_attention::HD}), panels[4 * l + 1], w[3], biases[4 * l + 1]));
    h = rms_norm(x, norms[2 * l + 1], eps);
    const Tensor gu = linear(h, panels[4 * l + 2], w[4] + w[5], biases[4 * l + 2]);
    silu_mul_rows(gu.data_ptr<float>(), w[4] + w[5], gu.data_ptr<float>() + w[4], w[4] + w[5],
                  act.data_ptr<float>(), R, w[4]);
    add_into(x, linear(act, panels[4 * l + 3], w[6], biases[4 * l + 3]));
    if (next < keep.size() && keep[next] == l + 1) {
      out.push_back(x.clone());
      ++next;
    }
  }
  out.push_back(x);
  return out;
}

// A draft head's depth in one call (``EagleHead.depth``): its input, its decoder layers (``layers`` above), its final
// norm and its output layer, with the Python between them gone. The input of each new row is ``fc([g; e])``: ``g`` the
// rows of ``g_in`` -- the target's features, each of ``chunks`` equal slices scaled to unit RMS and mapped by
// ``fuse`` (``unit_rms`` and ``fuse`` of head.py, in torch's arithmetic), where ``chunks`` > 1; else as given (the
// target's last features, or the head's own output at a drafted node's parent) -- and ``e`` the rows of ``table`` at
// ``tokens``. ``fuse``, ``fc`` and ``out`` are the native kernel's calls (panels, output width, bias: an empty tensor,
// none), as ``kernels.native_args`` makes them, so each product is the one the module's own call gives. The output
// layer runs on the rows ``picked`` only. The rows may be several sequences' (``bounds``, as ``layers`` takes them).
// Returns the logits of the picked rows and every row's final-normed hidden state.
std::vector<Tensor> draft_depth(const Tensor& g_in, int64_t chunks, const Tensor& fuse_panels, int64_t fuse_n,
                                const Tensor& table, const Tensor& tokens, const Tensor& fc_panels, int64_t fc_n,
                                const Tensor& fc_bias, const std::vector<Tensor>& norms, double eps,
                                const std::vector<Tensor>& panels, const std::vector<Tensor>& biases,
                                const std::vector<int64_t>& widths, int64_t heads, int64_t kv_heads, const Tensor& cos,
                                const Tensor& sin, const std::vector<Tensor>& kbufs, const std::vector<Tensor>& vbufs,
                                const std::vector<int64_t>& bounds, const std::vector<Tensor>& slot,
                                const std::vector<Tensor>& pos, const std::vector<Tensor>& row,
                                const std::vector<Tensor>& visible, const std::vector<Tensor>& limits,
                                const std::vector<int64_t>& span, double scale, const Tensor& norm,
                                const Tensor& out_panels, int64_t out_n, const Tensor& picked) {
  TORCH_CHECK(g_in.dim() == 2 && g_in.scalar_type() == torch::kFloat, "g_in: float32 [R, F]");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == g_in.size(0), "one token per row");
  TORCH_CHECK(picked.dim() == 1 && picked.scalar_type() == torch::kLong && picked.size(0) > 0,
              "picked: the rows of the logits, int64");
  Tensor g = g_in.contiguous();
  if (chunks > 1) {
    TORCH_CHECK(g.size(1) % chunks == 0, "g_in: chunks equal slices");
    Tensor parts = g.view({g.size(0), chunks, g.size(1) / chunks});
    parts = parts * torch::rsqrt(parts.pow(2).mean(-1, true) + 1e-6);
    g = linear(parts.reshape({g.size(0), g.size(1)}).contiguous(), fuse_panels, fuse_n, torch::empty({0}));
  }
  const Tensor e = table.index_select(0, tokens);
  const Tensor x = linear(torch::cat({g, e}, 1).contiguous(), fc_panels, fc_n, fc_bias);
  const std::vector<int64_t> none;
  const Tensor last = layers(x, norms, eps, panels, biases, widths, heads, kv_heads, cos, sin, kbufs, vbufs, bounds,
                             slot, pos, row, visible, limits, span, scale, none).back();
  const Tensor h = rms_norm(last, norm, eps);
  const Tensor logits = linear(h.index_select(0, picked), out_panels, out_n, torch::empty({0}));
  return {logits, h};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "the lean forward's float32 RMS norm of each row, in a fixed order");
  m.def("silu_mul", &silu_mul, "the lean forward's float32 SiLU(gate) * up, in a fixed arithmetic");
  m.def("layers", &layers, "float32 decoder layers: norms, linear calls, rotary positions, attention, residuals",
        py::call_guard<py::gil_scoped_release>());
  m.def("draft_depth", &draft_depth, "a float32 draft head's depth: input, decoder layers, final norm, output layer",
        py::call_guard<py::gil_scoped_release>());
}
