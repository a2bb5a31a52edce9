// y = x @ w^T (+ bias) for bfloat16 at decode and verify sizes (1-64 rows) on AMX tiles, reading w in place.
//
// A decode step multiplies a few rows by every weight once, so it is bound by the bytes of weights it streams.
// AMX multiplies a 16x32 tile by a 32x16 tile in ~16 cycles: one tile of weights (1 KB) per 16 cycles is
// ~190 GB/s a core, far above what memory delivers, so the kernel streams at the memory's rate at any row count.
// oneDNN needs its packed copy of the weight for AMX (and streams it at ~13 GB/s at these sizes); here the weight
// is the tile's *left* operand, which AMX loads from rows of any stride: w [N, K] is read in place, 16 output
// channels by 32 inputs a tile, and the few rows of x are the right operand, repacked once per call into AMX's
// pair-interleaved layout (x^T by pairs of inputs: xt[p][m] = (x[m][2p], x[m][2p+1])).
//
//   for each block of 32 output channels (split over threads), for each chunk of 32 rows of x:
//     C[2][2] 16x16 float32 tiles += A (w: 2 x 16 channels x 32 inputs) * B (xt: 32 inputs x 2 x 16 rows)
//     each C tile (channels x rows) is stored, transposed, rounded once to bfloat16 (bias added in float32).
//
// Layouts: x [M, K] bfloat16 contiguous, w [N, K] bfloat16 contiguous, bias [N] bfloat16 or empty; K % 32 == 0
// and N % 16 == 0 (``applies`` on the Python side keeps oneDNN otherwise). Sums are float32, as oneDNN's.
// The process must be allowed AMX state (Linux arch_prctl ARCH_REQ_XCOMP_PERM): ``enable`` asks once and says
// whether the kernel may run.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../../csrc/simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <vector>
#define RADIXSERVE_AMX 1
#endif

namespace radixserve_amx_linear {

#ifdef RADIXSERVE_AMX
namespace {

constexpr int kArchReqXcompPerm = 0x1023;  // Linux: ask for an extended state component
constexpr int kXfeatureXtiledata = 18;     // AMX tile data

// The tile configuration LDTILECFG reads (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-3 C[a][b] = tile 2a + b (a: channel half, b: row half); 4, 5 A (weights); 6, 7 B (rows of x).
// A C or B tile is as wide as its chunk of rows (``cols`` rows of x: 4 bytes each, a float32 or a pair).
// (A tile of no columns is invalid: an unused second half is configured one row of x wide.)
void configure(int cols0, int cols1) {
  if (cols1 == 0) cols1 = 1;
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(4 * ((t & 1) ? cols1 : cols0));
  }
  for (int t = 4; t < 6; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  cfg.rows[6] = 16;
  cfg.colsb[6] = static_cast<uint16_t>(4 * cols0);
  cfg.rows[7] = 16;
  cfg.colsb[7] = static_cast<uint16_t>(4 * cols1);
  _tile_loadconfig(&cfg);
}

// One C tile (16 channels x cols rows, float32, row stride 64 bytes) written to y's rows as bfloat16.
inline void store_tile(const float* c, int cols, c10::BFloat16* y, int64_t ldy, __m512 bias) {
  const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16));
  for (int m = 0; m < cols; ++m) {
    const __m512 v = _mm512_i32gather_ps(idx, c + m, 4);  // column m: channel j at c[j * 16 + m]
    radixserve_simd::store16(y + m * ldy, _mm512_add_ps(v, bias));
  }
}

}  // namespace

constexpr bool AVAILABLE = true;

bool enable() {
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(enable(), "amx_linear: this process may not use AMX tiles");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "amx_linear: bfloat16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "amx_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "amx_linear: contiguous x and w");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0, "amx_linear: K % 32 == 0 and N % 16 == 0");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kBFloat16 && bias.numel() == N && bias.is_contiguous()),
              "amx_linear: bias [N] bfloat16");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t P = K / 2;                // pairs of inputs
  const int64_t tiles = (M + 15) / 16;    // 16-row tiles of x
  // xt: per 16-row tile of x, P rows of 16 pairs (64 bytes each; rows past M are zeros, never stored).
  std::vector<uint32_t> xt(static_cast<size_t>(tiles * P * 16), 0u);
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  for (int64_t m = 0; m < M; ++m) {
    uint32_t* dst = xt.data() + (m / 16) * P * 16 + (m % 16);
    const uint32_t* src = x32 + m * P;
    for (int64_t p = 0; p < P; ++p) dst[p * 16] = src[p];
  }
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  const c10::BFloat16* bp = has_bias ? bias.data_ptr<c10::BFloat16>() : nullptr;
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t ldw = K * 2;  // bytes between rows of w
  const int64_t blocks = (N + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[4][16 * 16];
    for (int64_t chunk = 0; chunk < tiles; chunk += 2) {
      const int cols0 = static_cast<int>(std::min<int64_t>(16, M - chunk * 16));
      const int cols1 = chunk + 1 < tiles ? static_cast<int>(std::min<int64_t>(16, M - (chunk + 1) * 16)) : 0;
      configure(cols0, cols1);
      const uint32_t* b0 = xt.data() + chunk * P * 16;
      const uint32_t* b1 = b0 + P * 16;
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t n0 = blk * 32;
        const bool two = n0 + 16 < N;  // a second 16 channels (N % 32 == 16 leaves the last block one)
        const c10::BFloat16* a0 = wp + n0 * K;
        const c10::BFloat16* a1 = a0 + 16 * K;
        const char* next = blk + 1 < end ? reinterpret_cast<const char*>(a0 + 32 * K) : nullptr;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          if (next != nullptr && chunk == 0) {  // the next block's rows at this k, one line each, on their way
            for (int r = 0; r < 32; ++r) _mm_prefetch(next + r * ldw + k * 2, _MM_HINT_T0);
          }
          _tile_loadd(6, b0 + (k / 2) * 16, 64);
          _tile_loadd(4, a0 + k, ldw);
          _tile_dpbf16ps(0, 4, 6);
          if (cols1 > 0) {
            _tile_loadd(7, b1 + (k / 2) * 16, 64);
            _tile_dpbf16ps(1, 4, 7);
          }
          if (two) {
            _tile_loadd(5, a1 + k, ldw);
            _tile_dpbf16ps(2, 5, 6);
            if (cols1 > 0) _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c[0], 64);
        if (cols1 > 0) _tile_stored(1, c[1], 64);
        if (two) {
          _tile_stored(2, c[2], 64);
          if (cols1 > 0) _tile_stored(3, c[3], 64);
        }
        for (int a = 0; a < (two ? 2 : 1); ++a) {
          const int64_t n = n0 + 16 * a;
          const __m512 bv = has_bias ? radixserve_simd::load16(bp + n) : _mm512_setzero_ps();
          c10::BFloat16* y0 = yp + chunk * 16 * N + n;
          store_tile(c[2 * a], cols0, y0, N, bv);
          if (cols1 > 0) store_tile(c[2 * a + 1], cols1, y0 + 16 * N, N, bv);
        }
      }
    }
    _tile_release();
  });
  return y;
}

#else
constexpr bool AVAILABLE = false;

bool enable() { return false; }

torch::Tensor linear(torch::Tensor, torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "amx_linear: built without AMX");
  return {};
}
#endif

}  // namespace radixserve_amx_linear

void register_amx_linear(pybind11::module_& parent) {
  auto m = parent.def_submodule("amx_linear");
  m.attr("available") = radixserve_amx_linear::AVAILABLE;
  m.def("enable", &radixserve_amx_linear::enable, "ask Linux for AMX tile state; whether this process may use it");
  m.def("linear", &radixserve_amx_linear::linear, "bfloat16 x @ w^T (+ bias) for 1-64 rows on AMX tiles",
        py::call_guard<py::gil_scoped_release>());
}
