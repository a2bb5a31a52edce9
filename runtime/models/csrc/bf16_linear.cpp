// y = x @ w^T (+ bias) for bfloat16 on CPU, with AVX-512 BF16 dot products over the plain weight, read in place.
//
// A served bfloat16 weight stays as the checkpoint stores it (row-major [N, K], possibly the file's own memory map):
// no packed copy to make at load, none to hold. The product is formed along K, as dot products of weight rows and
// rows of x, so the weight needs no reordering:
//   for each block of 16 output channels (16 weight rows; blocks split over threads, each thread a contiguous run):
//     for each tile of MR rows of x by NR channels of the block (MR x NR = 24 or 16 accumulators):
//       acc[i][j] (16 float32 lanes) += vdpbf16ps(x[i][k : k+32], w[j][k : k+32]) over K in steps of 32;
//       a butterfly sums each accumulator's lanes; the bias is added in float32; the result is rounded once.
// Tiles are 6x4 while six rows remain, then 4x4, 2x8 and 1x16. The block is read from memory by the first tile and
// from L2 by the others, while the next block is prefetched into L2 a few lines per step, spread over every tile of
// the block, so that streaming the weights overlaps all the block's arithmetic (measured on 2 Zen 4 cores, the 1B
// Llama shapes, ``bench/bf16_layer.py``: at 1-16 rows as fast as oneDNN's packed kernels or faster, at 32 within
// 5%; above, oneDNN's products pull ahead and the caller switches to ``F.linear``: ``linear.BF16_KERNEL_MAX_ROWS``).
// A weight may be given in parts (the q, k and v projections of one merged layer, each its own tensor): the output
// columns are the parts' rows in order.
// Layouts: x [M, K] bfloat16 contiguous, each part [N_i, K] bfloat16 contiguous with N_i % 16 == 0, K % 32 == 0,
// bias [sum N_i] bfloat16 or empty. Sums are float32, as oneDNN's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <vector>

#include "../../csrc/balanced.h"
#include "../../csrc/simd.h"

namespace radixserve_bf16_linear {

// `bias` ([N] bfloat16; undefined or empty: none) widened to float32, the bias the bfloat16 kernels add before they
// round (this file's and bf16_packed.cpp's).
inline std::vector<float> bias_floats(const torch::Tensor& bias, int64_t N, const char* kernel) {
  const bool has = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has || (bias.scalar_type() == torch::kBFloat16 && bias.numel() == N && bias.is_contiguous()), kernel,
              ": bias [N] bfloat16");
  std::vector<float> out(has ? N : 0);
  const c10::BFloat16* bp = has ? bias.data_ptr<c10::BFloat16>() : nullptr;
  for (int64_t i = 0; i < static_cast<int64_t>(out.size()); ++i) out[i] = static_cast<float>(bp[i]);
  return out;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

using radixserve_simd::bf16;

inline __m512bh load32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }

// A cursor over the 64-byte lines of the next block of weight rows, prefetched into L2 a few per step.
struct Prefetch {
  const char* row = nullptr;
  int64_t col = 0, row_bytes = 0, left = 0;
  inline void step(int n) {
    for (int q = 0; q < n && left > 0; ++q, --left) {
      _mm_prefetch(row + col, _MM_HINT_T1);
      col += 64;
      if (col == row_bytes) {
        col = 0;
        row += row_bytes;
      }
    }
  }
};

// y[i][j] = x[i] . w[j] (+ bias[j]) for MR rows of x and NR consecutive weight rows.
template <int MR, int NR>
inline void tile(const bf16* x, const bf16* w, int64_t K, Prefetch& pf, int per_step, bf16* y, int64_t ldy,
                 const float* bias) {
  constexpr int kGroups = (MR * NR + 15) / 16;
  __m512 acc[kGroups * 16];
  for (int i = 0; i < kGroups * 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    pf.step(per_step);
    __m512bh xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = load32(x + i * K + k);
    for (int j = 0; j < NR; ++j) {
      const __m512bh wv = load32(w + j * K + k);
      for (int i = 0; i < MR; ++i) acc[i * NR + j] = _mm512_dpbf16_ps(acc[i * NR + j], xv[i], wv);
    }
  }
  alignas(64) float out[kGroups * 16];
  for (int g = 0; g < kGroups; ++g) _mm512_store_ps(out + 16 * g, radixserve_simd::hsum16(acc + 16 * g));
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = bf16(out[i * NR + j] + (bias ? bias[j] : 0.f));
}

// Tile calls per block of 16 channels for M rows (6x4 tiles, then 4x4, 2x8, 1x16).
inline int64_t tiles_per_block(int64_t M) {
  return (M / 6) * 4 + (M % 6 / 4) * 4 + (M % 6 % 4 / 2) * 2 + M % 2;
}

}  // namespace

constexpr bool AVAILABLE = true;

torch::Tensor linear(torch::Tensor x, std::vector<torch::Tensor> parts, torch::Tensor bias) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "bf16_linear: x [M, K] bfloat16, contiguous");
  TORCH_CHECK(!parts.empty(), "bf16_linear: no weight");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "bf16_linear: K % 32 == 0");
  std::vector<const bf16*> blocks;  // the first row of each block of 16 channels, in output order
  for (const auto& w : parts) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.size(1) == K && w.is_contiguous() &&
                    w.size(0) % 16 == 0,
                "bf16_linear: each weight part [N_i, K] bfloat16, contiguous, N_i % 16 == 0");
    const bf16* p = w.data_ptr<bf16>();
    for (int64_t r = 0; r < w.size(0); r += 16) blocks.push_back(p + r * K);
  }
  const int64_t N = static_cast<int64_t>(blocks.size()) * 16;
  const std::vector<float> bias_f = bias_floats(bias, N, "bf16_linear");
  const bool has_bias = !bias_f.empty();
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const bf16* xp = x.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  // The next block's lines, spread evenly over every k-step of this block's tiles.
  const int64_t lines = 16 * K * 2 / 64, steps = tiles_per_block(M) * (K / 32);
  const int per_step = static_cast<int>((lines + steps - 1) / steps);
  radixserve_balanced::balanced_for(N / 16, 1, [&](int64_t begin, int64_t end, int64_t limit) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const bf16* wb = blocks[blk];
      Prefetch pf;
      if (blk + 1 < limit) {  // the block this thread most likely takes next
        pf.row = reinterpret_cast<const char*>(blocks[blk + 1]);
        pf.row_bytes = K * 2;
        pf.left = lines;
      }
      const int64_t n0 = blk * 16;
      const float* bb = has_bias ? bias_f.data() + n0 : nullptr;
      auto at = [&](int c) { return bb ? bb + c : nullptr; };
      int64_t m = 0;
      for (; m + 6 <= M; m += 6)
        for (int c = 0; c < 16; c += 4) tile<6, 4>(xp + m * K, wb + c * K, K, pf, per_step, yp + m * N + n0 + c, N, at(c));
      for (; m + 4 <= M; m += 4)
        for (int c = 0; c < 16; c += 4) tile<4, 4>(xp + m * K, wb + c * K, K, pf, per_step, yp + m * N + n0 + c, N, at(c));
      for (; m + 2 <= M; m += 2)
        for (int c = 0; c < 16; c += 8) tile<2, 8>(xp + m * K, wb + c * K, K, pf, per_step, yp + m * N + n0 + c, N, at(c));
      for (; m < M; ++m) tile<1, 16>(xp + m * K, wb, K, pf, per_step, yp + m * N + n0, N, bb);
    }
  });
  return y;
}

#else
constexpr bool AVAILABLE = false;

torch::Tensor linear(torch::Tensor, std::vector<torch::Tensor>, torch::Tensor) {
  TORCH_CHECK(false, "bf16_linear: built without AVX-512 BF16");
  return {};
}
#endif

}  // namespace radixserve_bf16_linear

void register_bf16_linear(pybind11::module_& parent) {
  auto m = parent.def_submodule("bf16_linear");
  m.attr("available") = radixserve_bf16_linear::AVAILABLE;
  m.def("linear", &radixserve_bf16_linear::linear, "bfloat16 x @ w^T (+ bias), w in parts of rows read in place (AVX-512 BF16)",
        py::call_guard<py::gil_scoped_release>());
}
