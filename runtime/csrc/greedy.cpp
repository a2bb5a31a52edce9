// Greedy picks over logit rows on the CPU: each row's argmax with a check that the row is finite, in one call,
// and each row's k largest entries.
//
// torch's argmax over one bfloat16 vocabulary row (49,152 logits) takes ~180 us and topk(8) ~85 us on one core of
// a 2-core AMD EPYC Zen 4, where a one-user decode step of a 1B model takes ~22 ms: with the finiteness check and
// its casts, the greedy tail of a step cost ~1 ms. These scan a row once (the top-k: blocks of 16 whose largest
// entry does not beat the current k-th are skipped whole), in float32 as the values widen exactly.
//
// Ties go to the lowest index, as torch.argmax's do; a row with a NaN or an infinity is flagged, and its token
// (some index below the vocabulary size) is never used.
//
// A step's tail after the model runs cold: the step streamed hundreds of MB of weights through the caches, and a
// trivial torch op then took 30-60 us instead of 2-6 (one thread, after 540 MB of products). So the greedy tail
// of a packed head (exact_leaders, the pick and the checks: a dozen torch ops, ~0.45 ms a step) is one call here.
// Included by csrc/module.cpp after quant_packed.cpp (exact_leaders unpacks the head's rows with its `rows`).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "simd.h"

namespace radixserve_greedy {
namespace {

using bf16 = c10::BFloat16;

// Whether x[i, m) is all finite (v - v is 0 exactly where v is finite).
template <typename T>
bool all_finite(const T* x, int64_t i, int64_t m) {
#ifdef __AVX512F__
  __mmask16 ok = 0xFFFF;
  for (; i + 16 <= m; i += 16) {
    const __m512 v = radixserve_simd::load16(x + i);
    ok &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ);
  }
  if (ok != 0xFFFF) return false;
#endif
  for (; i < m; ++i)
    if (!std::isfinite(static_cast<float>(x[i]))) return false;
  return true;
}

// The first index of row x[0, n)'s largest value, and whether x[0, m) (m >= n: padding columns are checked, never
// picked) is all finite.
template <typename T>
std::pair<int64_t, bool> argmax_row(const T* x, int64_t n, int64_t m) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0, i = 0;
  bool finite = true;
#ifdef __AVX512F__
  // Largest value first (one max per 16 values), then its first position.
  __m512 mx = _mm512_set1_ps(best);
  __mmask16 ok = 0xFFFF;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = radixserve_simd::load16(x + i);
    mx = _mm512_max_ps(mx, v);
    ok &= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_EQ_OQ);  // v - v is 0 iff v is finite
  }
  finite = ok == 0xFFFF;
  best = _mm512_reduce_max_ps(mx);
  const __m512 b = _mm512_set1_ps(best);
  int64_t found = -1;
  for (int64_t j = 0; j < i; j += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(radixserve_simd::load16(x + j), b, _CMP_EQ_OQ);
    if (eq != 0) {
      found = j + __builtin_ctz(eq);
      break;
    }
  }
  if (found >= 0) at = found;
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    finite = finite && std::isfinite(v);
    if (v > best) best = v, at = i;
  }
  return {at, finite && all_finite(x, n, m)};
}

// Row x[0, n)'s k largest values' indices into idx, largest first (ties: lower index first).
template <typename T>
void top_row(const T* x, int64_t n, int64_t k, int64_t* idx) {
  float vals[64];
  for (int64_t j = 0; j < k; ++j) vals[j] = -std::numeric_limits<float>::infinity(), idx[j] = j;
  auto offer = [&](int64_t i) {
    const float v = static_cast<float>(x[i]);
    if (!(v > vals[k - 1])) return;
    int64_t j = k - 1;
    for (; j > 0 && v > vals[j - 1]; --j) vals[j] = vals[j - 1], idx[j] = idx[j - 1];
    vals[j] = v, idx[j] = i;
  };
  int64_t i = 0;
  // Until k values are in, every one is offered; -inf entries keep the indices distinct and valid.
  for (; i < std::min(n, k); ++i) {
    const float v = static_cast<float>(x[i]);
    int64_t j = i;
    for (; j > 0 && v > vals[j - 1]; --j) vals[j] = vals[j - 1], idx[j] = idx[j - 1];
    vals[j] = v, idx[j] = i;
  }
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    if (_mm512_cmp_ps_mask(radixserve_simd::load16(x + i), _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ) == 0) continue;
    for (int64_t j = i; j < i + 16; ++j) offer(j);
  }
#endif
  for (; i < n; ++i) offer(i);
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.is_cpu() && x.stride(1) == 1, what, ": x [rows, columns] on the CPU, rows contiguous");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, what,
              ": x float32 or bfloat16");
}

// fn(row r's values, r) for every row of x, in x's dtype, rows split over the intra-op threads.
template <typename F>
void each_row(const torch::Tensor& x, const F& fn) {
  const int64_t stride = x.stride(0);
  auto run = [&](const auto* p) {
    at::parallel_for(0, x.size(0), 8, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) fn(p + r * stride, r);
    });
  };
  if (x.scalar_type() == torch::kBFloat16) {
    run(x.data_ptr<bf16>());
  } else {
    run(x.data_ptr<float>());
  }
}

}  // namespace

// x [B, M] float32 or bfloat16 -> int64 [2 B]: per row 1 if all M values are finite, else 0; then per row the
// first index of the largest of its first n values.
torch::Tensor argmax_checked(const torch::Tensor& x, int64_t n) {
  check_rows(x, "argmax_checked");
  const int64_t B = x.size(0), M = x.size(1);
  TORCH_CHECK(n > 0 && n <= M, "argmax_checked: 0 < n <= columns");
  auto out = torch::empty({2 * B}, torch::dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  each_row(x, [&](const auto* row, int64_t b) {
    const auto [at, ok] = argmax_row(row, n, M);
    o[b] = ok, o[B + b] = at;
  });
  return out;
}

// x [R, V] float32 or bfloat16 -> int64 [R, k]: each row's k largest values' indices, largest first.
torch::Tensor top_indices(const torch::Tensor& x, int64_t k) {
  check_rows(x, "top_indices");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(k > 0 && k <= std::min<int64_t>(V, 64), "top_indices: 0 < k <= min(columns, 64)");
  auto out = torch::empty({R, k}, torch::dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  each_row(x, [&](const auto* row, int64_t r) { top_row(row, V, k, o + r * k); });
  return out;
}

// x [B, M] float32 or bfloat16 -> int64 [B]: 1 where row b is all finite, else 0.
torch::Tensor finite_rows(const torch::Tensor& x) {
  check_rows(x, "finite_rows");
  const int64_t B = x.size(0), M = x.size(1);
  auto out = torch::empty({B}, torch::dtype(torch::kInt64));
  int64_t* o = out.data_ptr<int64_t>();
  each_row(x, [&](const auto* row, int64_t b) { o[b] = all_finite(row, 0, M); });
  return out;
}

// exact_leaders (runtime/models/llama.py) for a head in packed blocks (quant_packed's layout, `type`, [N, K]): in
// each row of logits [B, N] (the head's output for hidden [B, K]; float32 or bfloat16, written in place) its k
// largest values are replaced by the float64 sum of hidden's row times that row of the head (dequantized to
// float32, as quant_packed.rows gives it), plus bias (float64) where given, rounded to float32 and then, for
// bfloat16 logits, to bfloat16 (as torch rounds a float64 tensor to bfloat16). Each sum: 8 lanes over K in order,
// then the lanes in order.
void exact_leaders(torch::Tensor logits, const torch::Tensor& hidden, const torch::Tensor& w, int64_t type, int64_t K,
                   int64_t N, int64_t k, const std::optional<torch::Tensor>& bias) {
  check_rows(logits, "exact_leaders");
  check_rows(hidden, "exact_leaders");
  const int64_t B = logits.size(0);
  TORCH_CHECK(logits.size(1) == N && hidden.size(0) == B && hidden.size(1) == K && K % 8 == 0,
              "exact_leaders: logits [B, N] and hidden [B, K] of the head's shape");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N), "exact_leaders: bias [N]");
  const torch::Tensor top = top_indices(logits, k);                                   // [B, k]
  const torch::Tensor rows = radixserve_quant_packed::rows(w, top.reshape({-1}), type, K, N);  // [B k, K]
  const torch::Tensor h = hidden.to(torch::kDouble).contiguous();
  const torch::Tensor bd = bias.has_value() ? bias->to(torch::kDouble).contiguous() : torch::Tensor();
  const int64_t* tp = top.data_ptr<int64_t>();
  const float* rp = rows.data_ptr<float>();
  const double* hp = h.data_ptr<double>();
  const double* bp = bd.defined() ? bd.data_ptr<double>() : nullptr;
  const int64_t stride = logits.stride(0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < k; ++j) {
      const float* wr = rp + (b * k + j) * K;
      const double* hr = hp + b * K;
      double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t i = 0; i < K; i += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += static_cast<double>(wr[i + l]) * hr[i + l];
      double sum = 0;
      for (double lane : lanes) sum += lane;
      const int64_t v = tp[b * k + j];
      if (bp != nullptr) sum += bp[v];
      const float f = static_cast<float>(sum);
      if (logits.scalar_type() == torch::kBFloat16) {
        logits.data_ptr<bf16>()[b * stride + v] = bf16(f);
      } else {
        logits.data_ptr<float>()[b * stride + v] = f;
      }
    }
}

// The greedy step's tail for a packed head: exact_leaders on logits (in place), then argmax_checked(logits, n).
torch::Tensor exact_argmax_checked(torch::Tensor logits, const torch::Tensor& hidden, const torch::Tensor& w,
                                   int64_t type, int64_t K, int64_t N, int64_t k,
                                   const std::optional<torch::Tensor>& bias, int64_t n) {
  exact_leaders(logits, hidden, w, type, K, N, k, bias);
  return argmax_checked(logits, n);
}

}  // namespace radixserve_greedy

void register_greedy(pybind11::module_& parent) {
  auto m = parent.def_submodule("greedy");
  m.def("argmax_checked", &radixserve_greedy::argmax_checked, "per row: all finite, then the argmax of the first n",
        py::call_guard<py::gil_scoped_release>());
  m.def("top_indices", &radixserve_greedy::top_indices, "per row: the k largest values' indices, largest first",
        py::call_guard<py::gil_scoped_release>());
  m.def("finite_rows", &radixserve_greedy::finite_rows, "per row: 1 if all finite, else 0",
        py::call_guard<py::gil_scoped_release>());
  m.def("exact_leaders", &radixserve_greedy::exact_leaders,
        "each row's k largest logits recomputed in float64 from a packed head, in place",
        py::call_guard<py::gil_scoped_release>());
  m.def("exact_argmax_checked", &radixserve_greedy::exact_argmax_checked, "exact_leaders, then argmax_checked",
        py::call_guard<py::gil_scoped_release>());
}
