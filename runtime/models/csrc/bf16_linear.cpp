// y = x @ w^T (+ bias) for bfloat16 at decode sizes (a few rows), with AVX-512 BF16 dot products, on CPU.
//
// A decode step multiplies a few rows by every weight once: it is bound by the bytes of weights it streams.
// oneDNN's kernels, packed or not, stream bfloat16 weights at ~13 GB/s here (2-core Xeon with AMX, 30 layers of
// SmolLM2-135M, 1-16 rows) where the cores read ~25 GB/s; this kernel reads each weight row once from memory, in
// place (no packed copy), and multiplies it with every row of x while it sits in L1:
//   for each block of 16 output channels (split over threads):
//     for each row m of x: 16 float32 accumulators, one per channel, fed by vdpbf16ps over K in steps of 32;
//                          one butterfly sums the 16 accumulators' lanes into the 16 outputs of row m.
// Layouts: x [M, K] bfloat16 contiguous, w [N, K] bfloat16 contiguous, bias [N] bfloat16 or empty; K % 32 == 0
// and N % 16 == 0 (the caller checks ``applies`` and keeps oneDNN otherwise). Sums are float32; the output is
// rounded once to bfloat16 (with the bias added in float32), as oneDNN rounds it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../../csrc/simd.h"

namespace radixserve_bf16_linear {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

inline __m512bh load32(const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

}  // namespace

constexpr bool AVAILABLE = true;

torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16_linear: bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "bf16_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "bf16_linear: K % 32 == 0 and N % 16 == 0");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kBFloat16 && bias.numel() == N && bias.is_contiguous()),
              "bf16_linear: bias [N] bfloat16");
  auto y = torch::empty({M, N}, x.options());
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = has_bias ? bias.data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  // Blocks of 16 channels; 4 blocks per task at least so that a thread streams contiguous rows of w.
  at::parallel_for(0, N / 16, 4, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const c10::BFloat16* wb = wp + blk * 16 * K;
      // The next block's rows are on their way while this one is multiplied (the first row of x reads them).
      if (blk + 1 < end) {
        const char* next = reinterpret_cast<const char*>(wb + 16 * K);
        for (int64_t off = 0; off < 16 * K * 2; off += 64) _mm_prefetch(next + off, _MM_HINT_T1);
      }
      const __m512 bv = has_bias ? radixserve_simd::load16(bp + blk * 16) : _mm512_setzero_ps();
      for (int64_t m = 0; m < M; ++m) {
        const c10::BFloat16* xm = xp + m * K;
        __m512 acc[16];
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
          const __m512bh xv = load32(xm + k);
          for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], xv, load32(wb + j * K + k));
        }
        radixserve_simd::store16(yp + m * N + blk * 16, _mm512_add_ps(radixserve_simd::hsum16(acc), bv));
      }
    }
  });
  return y;
}

#else
constexpr bool AVAILABLE = false;

torch::Tensor linear(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "bf16_linear: built without AVX-512 BF16");
  return {};
}
#endif

}  // namespace radixserve_bf16_linear

void register_bf16_linear(pybind11::module_& parent) {
  auto m = parent.def_submodule("bf16_linear");
  m.attr("available") = radixserve_bf16_linear::AVAILABLE;
  m.def("linear", &radixserve_bf16_linear::linear, "bfloat16 x @ w^T (+ bias) for a few rows (AVX-512 BF16)",
        py::call_guard<py::gil_scoped_release>());
}
