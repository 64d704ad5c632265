// Rotary positions applied in place for the lean forward's float32 path (verispec/backends/native/__init__.py builds
// this file with -ffp-contract=off): out = x * cos + rotate(x) * sin, rotate(x) = [-x[half:], x[:half]], with the
// same three roundings per element as the torch expression it replaces (two products, then their sum; no fused
// multiply-add), so the results are torch's bit for bit. One call for a layer's queries or keys instead of seven
// small torch operations.
#include <torch/extension.h>

#include <vector>

// x [R, H, D] float32 (contiguous, changed in place), cos and sin [R, D] float32 (contiguous), D even.
void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous float32 [R, H, D]");
  const int64_t R = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "an even head dimension");
  for (const torch::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->dim() == 2 && t->size(0) == R && t->size(1) == D && t->scalar_type() == torch::kFloat &&
                t->is_contiguous(), "cos, sin: contiguous float32 [R, D]");
  }
  float* xd = x.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  std::vector<float> v(D);
  for (int64_t r = 0; r < R; ++r) {
    const float* c = cd + r * D;
    const float* s = sd + r * D;
    for (int64_t h = 0; h < H; ++h) {
      float* o = xd + (r * H + h) * D;
      for (int64_t i = 0; i < D; ++i) v[i] = o[i];
      for (int64_t i = 0; i < half; ++i) {
        const float a = v[i] * c[i];
        const float b = -v[i + half] * s[i];
        o[i] = a + b;
      }
      for (int64_t i = half; i < D; ++i) {
        const float a = v[i] * c[i];
        const float b = v[i - half] * s[i];
        o[i] = a + b;
      }
    }
  }
}

#ifndef VERISPEC_NO_MODULE  // layer.cpp includes this file for its functions, under its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_", &rope_, "x * cos + rotate(x) * sin in place, as torch computes it");
}
#endif
