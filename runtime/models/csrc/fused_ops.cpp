// The small per-layer operations of a decoder layer, fused, for float32 on CPU.
//
// At a few tokens per step the linear layers are quick, and what remains is a chain of small PyTorch ops per layer
// (RMSNorm alone is five, RoPE six), each paying dispatch and, on several threads, an OpenMP wake-up. Here each is
// one pass over its rows; rows are split over threads only when there are enough of them to be worth it.
//   rms_norm(x [T, H], w [H], eps)                      -> y = x / rms(x) * w
//   add_rms_norm(x [T, H], residual [T, H], w, eps)     -> residual += x (in place); y = rms_norm(residual)
//   rope(qk [T, NH, D] (rows strided), cos, signed_sin) -> rotate-half RoPE in place: q*cos + swap_halves(q)*sin
//   silu_mul(gate_up [T, 2I])                           -> silu(gate) * up, [T, I]
// cos / signed_sin are [T, D] rows (signed_sin has its first half negated: see runtime/models/rope.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace radixserve_fused_ops {
namespace {

// Rows per thread below which a loop stays on the calling thread.
constexpr int64_t GRAIN = 16;

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), what, ": float32 on CPU");
}

inline void norm_row(const float* x, const float* w, float eps, int64_t H, float* y) {
  double ss = 0.0;  // double: the same sum of squares whatever H, as the float32 reference within rounding
  for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(ss / H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = x[i] * inv * w[i];
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "rms_norm x");
  check_f32(w, "rms_norm w");
  x = x.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) norm_row(xp + t * H, wp, e, H, yp + t * H);
  });
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(x, "add_rms_norm x");
  check_f32(residual, "add_rms_norm residual");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: residual [T, H] contiguous");
  x = x.contiguous();
  const int64_t H = x.size(-1), T = x.numel() / H;
  TORCH_CHECK(w.numel() == H, "add_rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.contiguous().data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      float* r = rp + t * H;
      const float* xr = xp + t * H;
      for (int64_t i = 0; i < H; ++i) r[i] += xr[i];
      norm_row(r, wp, e, H, yp + t * H);
    }
  });
  return y;
}

void rope(torch::Tensor qk, torch::Tensor cos, torch::Tensor signed_sin) {
  check_f32(qk, "rope qk");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "rope: qk [T, NH, D], rows strided");
  const int64_t T = qk.size(0), NH = qk.size(1), D = qk.size(2), half = D / 2, row = qk.stride(0);
  cos = cos.contiguous();
  signed_sin = signed_sin.contiguous();
  TORCH_CHECK(cos.numel() == T * D && signed_sin.numel() == T * D, "rope: cos / sin [T, D]");
  float* p = qk.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = signed_sin.data_ptr<float>();
  at::parallel_for(0, T, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const float* ct = c + t * D;
      const float* st = s + t * D;
      for (int64_t h = 0; h < NH; ++h) {
        float* x = p + t * row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float lo = x[i], hi = x[i + half];
          x[i] = lo * ct[i] + hi * st[i];             // x * cos + swap_halves(x) * signed_sin, first half
          x[i + half] = hi * ct[i + half] + lo * st[i + half];
        }
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "silu_mul");
  gate_up = gate_up.contiguous();
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, T = gate_up.numel() / I2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const float* gr = g + t * I2;
      const float* ur = gr + I;
      float* orow = o + t * I;
      for (int64_t i = 0; i < I; ++i) orow[i] = gr[i] / (1.0f + std::exp(-gr[i])) * ur[i];
    }
  });
  return out;
}

}  // namespace radixserve_fused_ops

void register_fused_ops(pybind11::module_& parent) {
  auto m = parent.def_submodule("fused_ops");
  m.def("rms_norm", &radixserve_fused_ops::rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &radixserve_fused_ops::add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope", &radixserve_fused_ops::rope, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &radixserve_fused_ops::silu_mul, py::call_guard<py::gil_scoped_release>());
}
