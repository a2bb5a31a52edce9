// y = x @ w^T (+ bias) for bfloat16 on AMX tiles, over the weight packed in pairs of K (bf16_packed.cpp's layout),
// read in place.
//
// TDPBF16PS multiplies A (up to 16 rows x 32 bfloat16) by B (16 rows of 16 pairs: 32 K x 16 output channels, each
// row one pair of K for every channel) into C (16 rows x 16 float32). A block of the pairs layout is exactly a
// column of B tiles: its 16 channels' pairs p = k/2 .. k/2 + 15 are 16 consecutive 64-byte vectors, one 1 KB tile
// at stride 64, read in place. A C tile is 16 rows x 16 channels of y in y's own order: no transpose of the result.
// The rows of x are A tiles too (16 rows x 32 inputs, stride 2K bytes), but at K = 2,048 that stride puts a tile's
// 16 rows in one set of L1: x is first copied in tile order (``as_tiles``: each 1 KB tile contiguous), once a call.
//
//   for each (chunk of rows, unit of two blocks), for each 32 inputs k:
//     C[i][j] (tile 2i + j) += A_i (tile 4 + i: rows 16i .. of the chunk) * B_j (tile 6 + j: block j of the unit)
//   then each C tile, bias added in float32, is rounded once to bfloat16 into y.
//
// A unit is two consecutive blocks, or (gated, ``linear_silu_mul``) a gate block and its up block G = N / 32 blocks
// further, whose C tiles are rounded to bfloat16 and written as silu(gate) * up: fused_ops.silu_mul over ``linear``'s
// output, to the bit. Rows go in chunks of 32 (two A tiles; the last chunk's tiles as many rows as are left), and in
// passes of ~1 MB of x (at least 128 rows: each pass streams the weights once more), which stays in L2 while every
// unit's blocks pass over it.
//
// The tiling is written once over the tile interface of csrc/amx_tiles.h (``Amx``: the instructions; ``Emulated``:
// the same eight tiles in memory, scalar, shapes checked as TDPBF16PS checks them) so that a CPU without AMX tests it
// against F.linear: ``emulated`` runs it (slowly; tests only). bf16_packed's ``linear`` and ``linear_silu_mul`` come
// here from ``from_rows`` rows on, set once by bf16_kernels from what bf16_layout measured (never, by default).
// Layouts: x [M, K] bfloat16 contiguous, K % 32 == 0; packed [N / 16, 16 K] (bf16_packed.pack); bias [N] or empty.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "../../csrc/amx_tiles.h"
#include "../../csrc/balanced.h"
#include "../../csrc/simd.h"

namespace radixserve_bf16_tiles {

using radixserve_simd::bf16;

constexpr int64_t NEVER = std::numeric_limits<int64_t>::max();
// bf16_packed's products of this many rows or more run here (``use_from_rows``); with `emulated_`, emulated.
std::atomic<int64_t> from_rows_{NEVER};
std::atomic<bool> emulated_{false};

inline int64_t from_rows() { return from_rows_.load(std::memory_order_relaxed); }

// The operands both products over the pairs layout take (this file's and bf16_packed.cpp's, named `kernel`).
inline void check_operands(const torch::Tensor& x, const torch::Tensor& packed, bool gated, const char* kernel) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), kernel,
              ": x [M, K] bfloat16, contiguous");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 2 && packed.size(1) == 16 * K &&
                  packed.is_contiguous() && K % 32 == 0,
              kernel, ": packed [N / 16, 16 K] bfloat16 (bf16_packed.pack's), K % 32 == 0");
  TORCH_CHECK(!gated || packed.size(0) % 2 == 0, kernel,
              ": a gate/up weight has as many up blocks as gate blocks");
}

using radixserve_amx::AVAILABLE;
using radixserve_amx::enable;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

using radixserve_amx::Emulated;
using radixserve_amx::Shape;
#ifdef RADIXSERVE_AMX
using radixserve_amx::Amx;
#endif

// The tiles of a chunk whose halves have a0 (1-16) and a1 (0-16) rows: C[i][j] = tile 2i + j (a_i rows of 16
// float32), A_i = tile 4 + i (a_i rows of 32 bfloat16), B_j = tile 6 + j (16 pairs of 16 channels). An unused second
// half gets one row: every C tile is zeroed at each chunk, and an unconfigured tile (no rows, no bytes)
// faults on any use; it is never loaded, multiplied or stored.
inline Shape shape_of(int a0, int a1) {
  Shape s{};
  const int r[2] = {a0, std::max(a1, 1)};
  for (int i = 0; i < 2; ++i) {
    s.rows[2 * i] = s.rows[2 * i + 1] = s.rows[4 + i] = r[i];
    s.rows[6 + i] = 16;
  }
  for (int t = 0; t < 8; ++t) s.colsb[t] = 64;
  return s;
}

// One chunk's C tiles (c[t]: rows of 16 float32) into y's rows, the bias added (`bias[j]`: block j's 16 values or
// null); `a[i]` rows in half i; `two`: block 1 is there. GATED: block 0 is the gate, block 1 the up, y gets one block
// of silu(gate) * up, each rounded to bfloat16 first (as bf16_packed.cpp's tiles do).
template <bool GATED>
void write(const float (*c)[256], const int* a, bool two, const float* const* bias, bf16* y, int64_t ldy) {
  for (int i = 0; i < 2; ++i)
    for (int r = 0; r < a[i]; ++r) {
      bf16* row = y + (16 * i + r) * ldy;
      __m512 v[2];
      for (int j = 0; j < (two ? 2 : 1); ++j) {
        v[j] = _mm512_loadu_ps(c[2 * i + j] + 16 * r);
        if (bias[j]) v[j] = _mm512_add_ps(v[j], _mm512_loadu_ps(bias[j]));
      }
      if constexpr (GATED) {
        radixserve_simd::store16(row, radixserve_simd::silu_mul(radixserve_simd::round_as(v[0], row),
                                                                radixserve_simd::round_as(v[1], row)));
      } else {
        for (int j = 0; j < (two ? 2 : 1); ++j) radixserve_simd::store16(row + 16 * j, v[j]);
      }
    }
}

// x [M, K] in A tiles' order: for each 16-row chunk c of it and each 32 inputs s, one tile of 16 rows x 64 bytes at
// out + (c * K / 32 + s) * 512 (rows past M left as they are: a partial tile loads only its rows). In a buffer of the
// calling thread up to 256 KB (decode rows), else in `hold`.
const bf16* as_tiles(const bf16* x, int64_t M, int64_t K, torch::Tensor& hold) {
  const int64_t chunks = (M + 15) / 16, steps = K / 32, n = chunks * 16 * K;
  thread_local std::vector<bf16> small;
  bf16* out;
  if (n <= (int64_t{1} << 17)) {
    if (small.size() < static_cast<size_t>(n)) small.resize(static_cast<size_t>(n));
    out = small.data();
  } else {
    hold = torch::empty({n}, torch::kBFloat16);
    out = hold.data_ptr<bf16>();
  }
  auto copy = [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = 0; r < std::min<int64_t>(16, M - 16 * c); ++r) {
        const bf16* row = x + (16 * c + r) * K;
        for (int64_t s = 0; s < steps; ++s) std::memcpy(out + ((c * steps + s) * 16 + r) * 32, row + 32 * s, 64);
      }
  };
  if (M > 64) {
    at::parallel_for(0, chunks, 1, copy);
  } else {
    copy(0, chunks);
  }
  return out;
}

// Rows [m0, m1) of x (`xt`: as_tiles') against units [u0, u1) (see the file's comment), on this thread's tiles.
template <class T, bool GATED>
void units(const bf16* xt, int64_t m0, int64_t m1, int64_t K, const bf16* packed, int64_t blocks, int64_t u0,
           int64_t u1, const float* bias, bf16* y, int64_t ldy) {
  alignas(64) float c[4][256];
  Shape current{};
  bool configured = false;
  for (int64_t u = u0; u < u1; ++u) {
    // Gated: gate block u, up block u + blocks / 2. Otherwise blocks 2u and 2u + 1 (the last unit may have one).
    const int64_t b0 = GATED ? u : 2 * u, b1 = GATED ? u + blocks / 2 : 2 * u + 1;
    const bool two = b1 < blocks;
    const bf16* w0 = packed + b0 * 16 * K;
    const bf16* w1 = packed + b1 * 16 * K;
    const float* bb[2] = {bias ? bias + 16 * b0 : nullptr, bias && two ? bias + 16 * b1 : nullptr};
    bf16* yu = y + (GATED ? 16 * u : 32 * u);
    for (int64_t m = m0; m < m1; m += 32) {
      const int a[2] = {static_cast<int>(std::min<int64_t>(16, m1 - m)),
                        static_cast<int>(std::clamp<int64_t>(m1 - m - 16, 0, 16))};
      const Shape s = shape_of(a[0], a[1]);
      if (!configured || !(s == current)) {
        T::configure(s);
        current = s;
        configured = true;
      }
      for (int t = 0; t < 4; ++t) T::zero(t);
      const bf16* x0 = xt + m * K;  // chunk m / 16's tiles (m is a multiple of 32), then the next chunk's
      const bf16* x1 = x0 + 16 * K;
      for (int64_t k = 0; k < K; k += 32) {
        T::load(4, x0 + 16 * k, 64);
        T::load(6, w0 + 16 * k, 64);
        T::dot(0, 4, 6);
        if (two) {
          T::load(7, w1 + 16 * k, 64);
          T::dot(1, 4, 7);
        }
        if (a[1] > 0) {
          T::load(5, x1 + 16 * k, 64);
          T::dot(2, 5, 6);
          if (two) T::dot(3, 5, 7);
        }
      }
      for (int t = 0; t < 4; ++t)
        if ((t % 2 == 0 || two) && (t < 2 || a[1] > 0)) T::store(t, c[t], 64);
      write<GATED>(c, a, two, bb, yu + m * ldy, ldy);
    }
  }
  if (configured) T::release();
}

template <class T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias, bool gated) {
  check_operands(x, packed, gated, "bf16_tiles");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = 16 * blocks;
  const std::vector<float> bias_f = radixserve_bf16_linear::bias_floats(bias, N, "bf16_tiles");
  const float* bp = bias_f.empty() ? nullptr : bias_f.data();
  const int64_t ldy = gated ? N / 2 : N, count = gated ? blocks / 2 : (blocks + 1) / 2;
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  torch::Tensor hold;
  const bf16* xp = as_tiles(x.data_ptr<bf16>(), M, K, hold);
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  // Passes of ~1 MB of x (whole chunks of 32 rows, at least 128 rows), each over every unit; the work is every
  // (pass, unit), pass by pass, claimed 4 units at a time (balanced.h: a claim configures the tiles once) where
  // there are enough for every thread, else one at a time.
  const int64_t most = std::max<int64_t>(128, (int64_t{1} << 20) / (2 * K) / 32 * 32);
  const int64_t passes = (M + most - 1) / most;
  const int64_t claim = passes * count >= 8 * at::get_num_threads() ? 4 : 1;
  radixserve_balanced::balanced_for(passes * count, claim, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t t = begin; t < end;) {
      const int64_t p = t / count, u0 = t % count, u1 = std::min(count, u0 + end - t);
      const int64_t m0 = p * most, m1 = std::min(M, m0 + most);
      if (gated) {
        units<T, true>(xp, m0, m1, K, wp, blocks, u0, u1, bp, yp, ldy);
      } else {
        units<T, false>(xp, m0, m1, K, wp, blocks, u0, u1, bp, yp, ldy);
      }
      t += u1 - u0;
    }
  });
  return y;
}

}  // namespace

// On the tile units (or, `emulated`, in memory: see Emulated).
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias, bool gated,
                      bool emulated) {
  if (emulated) return run<Emulated>(x, packed, bias, gated);
#ifdef RADIXSERVE_AMX
  TORCH_CHECK(enable(), "bf16_tiles: this process may not use AMX tiles");
  return run<Amx>(x, packed, bias, gated);
#else
  TORCH_CHECK(false, "bf16_tiles: built without AMX");
  return {};
#endif
}

#else
torch::Tensor product(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, bool, bool) {
  TORCH_CHECK(false, "bf16_tiles: built without AVX-512 BF16");
  return {};
}
#endif

// bf16_packed's entry, from from_rows() rows on.
inline torch::Tensor packed_product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias,
                                    bool gated) {
  return product(x, packed, bias, gated, emulated_.load(std::memory_order_relaxed));
}

// From `rows` rows on (NEVER: no longer), bf16_packed's products run on the tiles; `emulated` (tests) in memory.
void use_from_rows(int64_t rows, bool emulated) {
  TORCH_CHECK(rows >= 1, "bf16_tiles: from at least one row");
  TORCH_CHECK(emulated || rows == NEVER || (AVAILABLE && enable()), "bf16_tiles: AMX tiles are not usable here");
  emulated_.store(emulated, std::memory_order_relaxed);
  from_rows_.store(rows, std::memory_order_relaxed);
}

}  // namespace radixserve_bf16_tiles

void register_bf16_tiles(pybind11::module_& parent) {
  namespace bt = radixserve_bf16_tiles;
  auto m = parent.def_submodule("bf16_tiles");
  m.attr("available") = bt::AVAILABLE;
  m.attr("NEVER") = bt::NEVER;
  m.def("enable", &bt::enable, "ask Linux for AMX tile state once; whether this process may use the tiles");
  m.def(
      "linear", [](torch::Tensor x, torch::Tensor p, torch::Tensor b) { return bt::product(x, p, b, false, false); },
      "bfloat16 x @ w^T (+ bias) over bf16_packed's layout on AMX tiles", py::call_guard<py::gil_scoped_release>());
  m.def(
      "linear_silu_mul",
      [](torch::Tensor x, torch::Tensor p, torch::Tensor b) { return bt::product(x, p, b, true, false); },
      "bfloat16 silu(x @ gate^T) * (x @ up^T) over bf16_packed's layout of [gate; up] on AMX tiles",
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "emulated",
      [](torch::Tensor x, torch::Tensor p, torch::Tensor b, bool gated) { return bt::product(x, p, b, gated, true); },
      "the tiles' product (gated: linear_silu_mul's) with the tiles emulated in memory (tests; slow)",
      py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("gated") = false,
      py::call_guard<py::gil_scoped_release>());
  m.def("use_from_rows", &bt::use_from_rows, "bf16_packed's products of this many rows or more run on the tiles",
        py::arg("rows"), py::arg("emulated") = false);
  m.def("from_rows", &bt::from_rows, "from how many rows bf16_packed's products run on the tiles");
}
