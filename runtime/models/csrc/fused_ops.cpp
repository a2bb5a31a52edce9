// The small per-layer operations of a decoder layer, fused, for float32 and bfloat16 on CPU.
//
// At a few tokens per step the linear layers are quick, and what remains is a chain of small PyTorch ops per layer
// (RMSNorm alone is five, RoPE six), each paying dispatch and, on several threads, an OpenMP wake-up. Here each is
// one pass over its rows; rows are split over threads only when there are enough of them to be worth it.
//   rms_norm(x [T, H], w [H], eps)                      -> y = x / rms(x) * w
//   add_rms_norm(x [T, H], residual [T, H], w, eps)     -> residual += x (in place); y = rms_norm(residual)
//   rope(qk [T, NH, D] (rows strided), cos, signed_sin) -> rotate-half RoPE in place: q*cos + swap_halves(q)*sin
//   silu_mul(gate_up [T, 2I])                           -> silu(gate) * up, [T, I]
//   store_kv(kv [2, Hkv, N, D], slots [T], k, v)         -> each token's k and v [T, Hkv, D] into its pool slot
// cos / signed_sin are [T, D] rows (signed_sin has its first half negated: see runtime/models/rope.py), in qk's dtype.
// In bfloat16 the arithmetic is float32 and each result is rounded where PyTorch's own ops round it: RMSNorm rounds
// the normalized row, then the product with the weight (HF's order); the residual add rounds its sum; RoPE and
// SiLU-and-mul round once at the end (PyTorch rounds each intermediate op too, so they agree within one bf16 step).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "../../csrc/simd.h"

namespace radixserve_fused_ops {
namespace {

using bf16 = c10::BFloat16;

// Rows per thread below which a loop stays on the calling thread.
constexpr int64_t GRAIN = 16;

void check(const torch::Tensor& t, const char* what) {
  TORCH_CHECK((t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) && t.device().is_cpu(),
              what, ": float32 or bfloat16 on CPU");
}

void check_same(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": tensors of one dtype");
}

inline float f32(float v) { return v; }
inline float f32(bf16 v) { return static_cast<float>(v); }

// y = rms_norm(x) * w. float32: one rounding; bfloat16: HF's w * (x / rms(x)).to(bf16), two.
template <typename T>
inline void norm_row(const T* x, const T* w, float eps, int64_t H, T* y) {
#ifdef __AVX512F__
  using namespace radixserve_simd;
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= H; i += 32) {
    const __m512 a = load16(x + i), b = load16(x + i + 16);
    s0 = _mm512_fmadd_ps(a, a, s0);
    s1 = _mm512_fmadd_ps(b, b, s1);
  }
  for (; i < H; i += 16) {
    const int n = H - i < 16 ? static_cast<int>(H - i) : 16;
    const __m512 a = load_n(x + i, n);
    s0 = _mm512_fmadd_ps(a, a, s0);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(_mm512_add_ps(s0, s1)) / static_cast<float>(H) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  for (i = 0; i < H; i += 16) {
    const int n = H - i < 16 ? static_cast<int>(H - i) : 16;
    const __m512 normed = round_as(_mm512_mul_ps(load_n(x + i, n), iv), x);
    store_n(y + i, _mm512_mul_ps(normed, load_n(w + i, n)), n);
  }
#else
  // The sum of squares in double, 4 partial sums (one AVX2 register): a float32 sum in one sequential chain drifts
  // enough from PyTorch's to round some bfloat16 results two steps away from its RMSNorm (seen on an AVX2 CPU).
  double part[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= H; i += 4)
    for (int l = 0; l < 4; ++l) part[l] += static_cast<double>(f32(x[i + l])) * f32(x[i + l]);
  for (; i < H; ++i) part[0] += static_cast<double>(f32(x[i])) * f32(x[i]);
  const float ss = static_cast<float>((part[0] + part[1]) + (part[2] + part[3]));
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
  for (int64_t i = 0; i < H; ++i) y[i] = T(f32(T(f32(x[i]) * inv)) * f32(w[i]));
#endif
}

template <typename T>
void rms_norm_impl(const torch::Tensor& x, const torch::Tensor& w, float eps, torch::Tensor& y) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, T_, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) norm_row(xp + t * H, wp, eps, H, yp + t * H);
  });
}

template <typename T>
void add_rms_norm_impl(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& w, float eps,
                       torch::Tensor& y) {
  const int64_t H = x.size(-1), T_ = x.numel() / H;
  const T* xp = x.data_ptr<T>();
  T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, T_, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      T* r = rp + t * H;
      const T* xr = xp + t * H;
#ifdef __AVX512F__
      for (int64_t i = 0; i < H; i += 16) {
        const int n = H - i < 16 ? static_cast<int>(H - i) : 16;
        radixserve_simd::store_n(r + i, _mm512_add_ps(radixserve_simd::load_n(r + i, n),
                                                      radixserve_simd::load_n(xr + i, n)), n);
      }
#else
      for (int64_t i = 0; i < H; ++i) r[i] = T(f32(r[i]) + f32(xr[i]));
#endif
      norm_row(r, wp, eps, H, yp + t * H);
    }
  });
}

template <typename T>
void rope_impl(torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& signed_sin) {
  const int64_t T_ = qk.size(0), NH = qk.size(1), D = qk.size(2), half = D / 2, row = qk.stride(0);
  T* p = qk.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = signed_sin.data_ptr<T>();
  at::parallel_for(0, T_, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const T* ct = c + t * D;
      const T* st = s + t * D;
      for (int64_t h = 0; h < NH; ++h) {
        T* x = p + t * row + h * D;
#ifdef __AVX512F__
        using namespace radixserve_simd;
        for (int64_t i = 0; i < half; i += 16) {
          const int n = half - i < 16 ? static_cast<int>(half - i) : 16;
          const __m512 lo = load_n(x + i, n), hi = load_n(x + i + half, n);
          const __m512 c0 = load_n(ct + i, n), c1 = load_n(ct + i + half, n);
          const __m512 s0 = load_n(st + i, n), s1 = load_n(st + i + half, n);
          store_n(x + i, _mm512_fmadd_ps(lo, c0, _mm512_mul_ps(hi, s0)), n);
          store_n(x + i + half, _mm512_fmadd_ps(hi, c1, _mm512_mul_ps(lo, s1)), n);
        }
        continue;
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float lo = f32(x[i]), hi = f32(x[i + half]);
          x[i] = T(lo * f32(ct[i]) + hi * f32(st[i]));  // x * cos + swap_halves(x) * signed_sin, first half
          x[i + half] = T(hi * f32(ct[i + half]) + lo * f32(st[i + half]));
        }
      }
    }
  });
}

template <typename T>
void silu_mul_impl(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t I2 = gate_up.size(-1), I = I2 / 2, T_ = gate_up.numel() / I2;
  const T* g = gate_up.data_ptr<T>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, T_, GRAIN, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const T* gr = g + t * I2;
      const T* ur = gr + I;
      T* orow = o + t * I;
      int64_t i = 0;  // the vector loops' end: the scalar loop at the bottom takes the rest
#ifdef __AVX512F__
      using namespace radixserve_simd;
      for (; i < I; i += 16) {  // (a masked tail: none is left)
        const int n = I - i < 16 ? static_cast<int>(I - i) : 16;
        store_n(orow + i, radixserve_simd::silu_mul(load_n(gr + i, n), load_n(ur + i, n)), n);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      // As the scalar loop below, 8 at a time, with the AVX-512 path's e^x (std::exp one element at a time was
      // ~2.5% of a 16-row decode step of a 1B model on two Zen 3 cores). -g is clamped to [-87, 80], as the AVX-512
      // path caps it at 80: above 87 den rounds to 1 as the exact one does; below -80 the result is g e^-80
      // (~1.8e-35 g) where the exact one is g e^g, both nothing beside 1.
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = radixserve_simd::load8(gr + i);
        // (max and min return their second operand for a NaN: a NaN stays NaN)
        const __m256 neg = _mm256_min_ps(_mm256_set1_ps(80.0f),
                                         _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_sub_ps(_mm256_setzero_ps(), gv)));
        const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), radixserve_simd::exp_in_range(neg));
        const __m256 v = _mm256_mul_ps(_mm256_div_ps(gv, den), radixserve_simd::load8(ur + i));
        if constexpr (std::is_same_v<T, float>) {
          _mm256_storeu_ps(orow + i, v);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, v);
          for (int k = 0; k < 8; ++k) orow[i + k] = T(tmp[k]);
        }
      }
#endif
      for (; i < I; ++i) {
        const float gv = f32(gr[i]);
        orow[i] = T(gv / (1.0f + std::exp(-gv)) * f32(ur[i]));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check(x, "rms_norm x");
  check_same(x, w, "rms_norm");
  x = x.contiguous();
  w = w.contiguous();
  TORCH_CHECK(w.numel() == x.size(-1), "rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    rms_norm_impl<float>(x, w, e, y);
  } else {
    rms_norm_impl<bf16>(x, w, e, y);
  }
  return y;
}

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check(x, "add_rms_norm x");
  check_same(x, residual, "add_rms_norm");
  check_same(x, w, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && x.sizes() == residual.sizes(), "add_rms_norm: residual [T, H] contiguous");
  x = x.contiguous();
  w = w.contiguous();
  TORCH_CHECK(w.numel() == x.size(-1), "add_rms_norm: weight size");
  auto y = torch::empty_like(x);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kFloat32) {
    add_rms_norm_impl<float>(x, residual, w, e, y);
  } else {
    add_rms_norm_impl<bf16>(x, residual, w, e, y);
  }
  return y;
}

void rope(torch::Tensor qk, torch::Tensor cos, torch::Tensor signed_sin) {
  check(qk, "rope qk");
  check_same(qk, cos, "rope");
  check_same(qk, signed_sin, "rope");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2), "rope: qk [T, NH, D], rows strided");
  const int64_t T = qk.size(0), D = qk.size(2);
  cos = cos.contiguous();
  signed_sin = signed_sin.contiguous();
  TORCH_CHECK(cos.numel() == T * D && signed_sin.numel() == T * D, "rope: cos / sin [T, D]");
  if (qk.scalar_type() == torch::kFloat32) {
    rope_impl<float>(qk, cos, signed_sin);
  } else {
    rope_impl<bf16>(qk, cos, signed_sin);
  }
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check(gate_up, "silu_mul");
  gate_up = gate_up.contiguous();
  auto sizes = gate_up.sizes().vec();
  sizes.back() = gate_up.size(-1) / 2;
  auto out = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_mul_impl<float>(gate_up, out);
  } else {
    silu_mul_impl<bf16>(gate_up, out);
  }
  return out;
}

// KVPool.store's pair of index_copy_ as one pass of row copies: a prefill chunk's keys and values, each token's rows
// of D values into slot slots[t] of each head (SmolLM2, 2,048 tokens: 0.75 ms a layer through index_copy_, whose
// source, a transposed view of the qkv projection, goes element by element). k and v: [T, Hkv, D], any token
// stride, heads and values contiguous (views of the projection's output); kv: one layer of the pool, contiguous.
void store_kv(torch::Tensor kv, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.is_contiguous(), "store_kv: kv [2, Hkv, N, D], contiguous");
  const int64_t Hkv = kv.size(1), N = kv.size(2), D = kv.size(3);
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "store_kv: slots [T]");
  const int64_t T = slots.size(0);
  for (const auto* t : {&k, &v})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == T && t->size(1) == Hkv && t->size(2) == D && t->stride(2) == 1 &&
                    t->stride(1) == D && t->scalar_type() == kv.scalar_type(),
                "store_kv: k and v [T, Hkv, D] in the pool's dtype, heads and values contiguous");
  const int64_t* sp = slots.data_ptr<int64_t>();
  bool ok = true;  // a bad slot must not write outside the pool
  for (int64_t t = 0; t < T; ++t) ok &= sp[t] >= 0 && sp[t] < N;
  TORCH_CHECK(ok, "store_kv: slot out of range");
  const int64_t es = kv.element_size(), row = D * es;
  char* base = static_cast<char*>(kv.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * es, vs = v.stride(0) * es;
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t j = 0; j < Hkv; ++j) {
        std::memcpy(base + (j * N + sp[t]) * row, kp + t * ks + j * row, row);
        std::memcpy(base + ((Hkv + j) * N + sp[t]) * row, vp + t * vs + j * row, row);
      }
  });
}

}  // namespace radixserve_fused_ops

void register_fused_ops(pybind11::module_& parent) {
  auto m = parent.def_submodule("fused_ops");
  m.def("rms_norm", &radixserve_fused_ops::rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &radixserve_fused_ops::add_rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rope", &radixserve_fused_ops::rope, py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &radixserve_fused_ops::silu_mul, py::call_guard<py::gil_scoped_release>());
  m.def("store_kv", &radixserve_fused_ops::store_kv, py::call_guard<py::gil_scoped_release>());
}
