// The lean forward's float32 decoder layers in one native call (verispec/backends/native/__init__.py builds this file
// with the flags of the linear kernel it stands beside): per layer the input norm, q, k and v as one stacked linear
// call, the rotary positions of the queries and keys, the step's keys and values written and every row's attention,
// o and the residual, the second norm, gate and up as one call, SiLU times up, down and the residual. The same
// functions on the same tensors as the Python loop it replaces (``LeanLlama.forward_batch`` with ``_native_calls``):
// the linear, attention and rotary kernels are those files' own code, compiled into this one; the norms are this
// file's ``rms_norm``, which the loop calls too; SiLU, products and sums are torch's own operators, called as the
// loop calls them (a strided view stays strided). So the results are the loop's bit for bit, without the Python of
// some 20 operations a layer, and with the interpreter's lock released while it runs.
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

}  // namespace

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
// widths of q, k, v, o, gate, up and down; ``kbufs``, ``vbufs`` [l] its key and value buffers ([slots, kv heads,
// capacity, 64], or [kv heads, capacity, 64] for one sequence's own). ``cos``, ``sin`` [R, 64] the rows' rotary
// tables; ``slot``, ``pos``, ``row``, ``visible``, ``limits``, ``span`` and ``scale`` as ``append_attend`` takes them
// (the same every layer). Returns x after each layer l + 1 in ``keep`` (in order), then after the last.
std::vector<Tensor> layers(Tensor x, const std::vector<Tensor>& norms, double eps, const std::vector<Tensor>& panels,
                           const std::vector<Tensor>& biases, const std::vector<int64_t>& widths, int64_t heads,
                           int64_t kv_heads, const Tensor& cos, const Tensor& sin, const std::vector<Tensor>& kbufs,
                           const std::vector<Tensor>& vbufs, const Tensor& slot, const Tensor& pos, const Tensor& row,
                           const Tensor& visible, const Tensor& limits, int64_t span, double scale,
                           const std::vector<int64_t>& keep) {
  const int64_t L = static_cast<int64_t>(kbufs.size()), R = x.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [R, D]");
  TORCH_CHECK(static_cast<int64_t>(vbufs.size()) == L && static_cast<int64_t>(norms.size()) == 2 * L &&
              static_cast<int64_t>(panels.size()) == 4 * L && static_cast<int64_t>(biases.size()) == 4 * L &&
              static_cast<int64_t>(widths.size()) == 7 * L, "per layer: 2 norms, 4 panels and biases, 7 widths");
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
    Tensor kb = kbufs[l].dim() == 3 ? kbufs[l].unsqueeze(0) : kbufs[l];
    Tensor vb = vbufs[l].dim() == 3 ? vbufs[l].unsqueeze(0) : vbufs[l];
    Tensor o = vs_attention::append_attend(q, k, v, kb, vb, slot, pos, row, visible, limits, span, scale);
    x = x + linear(o.view({R, heads * vs_attention::HD}), panels[4 * l + 1], w[3], biases[4 * l + 1]);
    h = rms_norm(x, norms[2 * l + 1], eps);
    std::vector<Tensor> gu = linear(h, panels[4 * l + 2], w[4] + w[5], biases[4 * l + 2]).split({w[4], w[5]}, 1);
    x = x + linear(at::silu(gu[0]) * gu[1], panels[4 * l + 3], w[6], biases[4 * l + 3]);
    if (next < keep.size() && keep[next] == l + 1) {
      out.push_back(x);
      ++next;
    }
  }
  out.push_back(x);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "the lean forward's float32 RMS norm of each row, in a fixed order");
  m.def("layers", &layers, "float32 decoder layers: norms, linear calls, rotary positions, attention, residuals",
        py::call_guard<py::gil_scoped_release>());
}
