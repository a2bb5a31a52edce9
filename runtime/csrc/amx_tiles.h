// AMX tiles behind a small interface, for the kernels that multiply on them (bf16_tiles.cpp, extend_attention.cpp),
// and the same interface over tiles emulated in memory, so that a CPU without AMX runs and tests those kernels.
//
// The interface (static functions of ``Amx`` and ``Emulated``): ``configure(Shape)`` (LDTILECFG, palette 1: rows and
// bytes per row of tiles 0-7; it zeroes every tile), ``zero(t)`` and ``store(t, p, stride)`` of a C tile,
// ``load(t, p, stride)`` of any (a tile's rows, `stride` bytes apart), ``dot(c, a, b)`` (TDPBF16PS: float32
// C[m][n] += A[m][2p] B[p][2n] + A[m][2p + 1] B[p][2n + 1] over the pairs p, A and B bfloat16) and ``release()``.
// The kernels use C tiles 0-3, A tiles 4-5 and B tiles 6-7. ``Emulated`` checks the shapes as the instruction does
// (C rows = A rows, C bytes = B bytes, A bytes = 4 x B rows): a kernel that runs emulated runs on the tile units, up
// to the order of float32 sums (the instruction also flushes denormals).
// The process must be allowed AMX state (Linux arch_prctl ARCH_REQ_XCOMP_PERM, process-wide): ``enable`` asks once.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_AMX 1
#endif

namespace radixserve_amx {

using radixserve_simd::bf16;

#ifdef RADIXSERVE_AMX
constexpr bool AVAILABLE = true;

inline bool enable() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // Linux: ask for AMX tile data state
  static const bool ok = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ok;
}
#else
constexpr bool AVAILABLE = false;

inline bool enable() { return false; }
#endif

// Rows and bytes per row of each of the 8 tiles (palette 1).
struct Shape {
  int rows[8];
  int colsb[8];
  bool operator==(const Shape& o) const {
    return std::equal(rows, rows + 8, o.rows) && std::equal(colsb, colsb + 8, o.colsb);
  }
};

#ifdef RADIXSERVE_AMX
// The instructions. Tile numbers are immediates (GCC's intrinsics paste them into the mnemonic), hence the switches,
// which fold away where a call site passes constants.
struct Amx {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  static void configure(const Shape& s) {
    Config cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = static_cast<uint8_t>(s.rows[t]);
      cfg.colsb[t] = static_cast<uint16_t>(s.colsb[t]);
    }
    // GCC's intrinsic declares 8 of the 64 bytes it reads: the barrier keeps every store to cfg before it.
    asm volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
  }
  static void zero(int t) {
    switch (t) {
      case 0: _tile_zero(0); break;
      case 1: _tile_zero(1); break;
      case 2: _tile_zero(2); break;
      default: _tile_zero(3); break;
    }
  }
  static void load(int t, const void* p, int64_t stride) {
    // GCC's TILELOADD is an asm with no memory operand: the barrier keeps the kernels' ordinary stores to what a
    // tile then loads (the prefill kernel's rescaled output, its weights row) before the load, not just by luck.
    asm volatile("" : : "r"(p) : "memory");
    switch (t) {
      case 0: _tile_loadd(0, p, stride); break;
      case 1: _tile_loadd(1, p, stride); break;
      case 2: _tile_loadd(2, p, stride); break;
      case 3: _tile_loadd(3, p, stride); break;
      case 4: _tile_loadd(4, p, stride); break;
      case 5: _tile_loadd(5, p, stride); break;
      case 6: _tile_loadd(6, p, stride); break;
      default: _tile_loadd(7, p, stride); break;
    }
  }
  static void dot(int c, int a, int b) {  // C tile c (0-3) += A tile a (4, 5) * B tile b (6, 7)
#define RADIXSERVE_DOT(C, A, B) \
  case (C) * 4 + ((A) - 4) * 2 + ((B) - 6): _tile_dpbf16ps(C, A, B); break;
    switch (c * 4 + (a - 4) * 2 + (b - 6)) {
      RADIXSERVE_DOT(0, 4, 6) RADIXSERVE_DOT(0, 4, 7) RADIXSERVE_DOT(0, 5, 6) RADIXSERVE_DOT(0, 5, 7)
      RADIXSERVE_DOT(1, 4, 6) RADIXSERVE_DOT(1, 4, 7) RADIXSERVE_DOT(1, 5, 6) RADIXSERVE_DOT(1, 5, 7)
      RADIXSERVE_DOT(2, 4, 6) RADIXSERVE_DOT(2, 4, 7) RADIXSERVE_DOT(2, 5, 6) RADIXSERVE_DOT(2, 5, 7)
      RADIXSERVE_DOT(3, 4, 6) RADIXSERVE_DOT(3, 4, 7) RADIXSERVE_DOT(3, 5, 6) RADIXSERVE_DOT(3, 5, 7)
      default: break;
    }
#undef RADIXSERVE_DOT
  }
  static void store(int t, void* p, int64_t stride) {
    switch (t) {
      case 0: _tile_stored(0, p, stride); break;
      case 1: _tile_stored(1, p, stride); break;
      case 2: _tile_stored(2, p, stride); break;
      default: _tile_stored(3, p, stride); break;
    }
  }
  static void release() { _tile_release(); }
};
#endif

// The same eight tiles in this thread's memory, each row 64 bytes, with TDPBF16PS's arithmetic in float32 and its
// shape checks.
struct Emulated {
  struct File {
    Shape shape{};
    alignas(64) uint8_t data[8][1024] = {};
  };
  static File& file() {
    thread_local File f;
    return f;
  }
  static void configure(const Shape& s) {
    for (int t = 0; t < 8; ++t)
      TORCH_CHECK(s.rows[t] >= 1 && s.rows[t] <= 16 && s.colsb[t] >= 4 && s.colsb[t] <= 64 && s.colsb[t] % 4 == 0,
                  "amx_tiles: tile ", t, " configured ", s.rows[t], " x ", s.colsb[t], " bytes");
    File& f = file();
    f.shape = s;
    std::memset(f.data, 0, sizeof(f.data));  // LDTILECFG zeroes the tiles
  }
  static void zero(int t) {
    TORCH_CHECK(t >= 0 && t < 4, "amx_tiles: zero a C tile (0-3)");
    std::memset(file().data[t], 0, 1024);
  }
  static void load(int t, const void* p, int64_t stride) {
    File& f = file();
    for (int r = 0; r < f.shape.rows[t]; ++r)
      std::memcpy(f.data[t] + 64 * r, static_cast<const char*>(p) + r * stride, f.shape.colsb[t]);
  }
  static void dot(int c, int a, int b) {
    TORCH_CHECK(c >= 0 && c < 4 && (a == 4 || a == 5) && (b == 6 || b == 7), "amx_tiles: C 0-3, A 4-5, B 6-7");
    File& f = file();
    const Shape& s = f.shape;
    TORCH_CHECK(s.rows[c] == s.rows[a] && s.colsb[c] == s.colsb[b] && s.rows[b] * 4 == s.colsb[a],
                "amx_tiles: tile shapes TDPBF16PS refuses (C ", c, ", A ", a, ", B ", b, ")");
    float* C = reinterpret_cast<float*>(f.data[c]);
    const bf16* A = reinterpret_cast<const bf16*>(f.data[a]);
    const bf16* B = reinterpret_cast<const bf16*>(f.data[b]);
    for (int m = 0; m < s.rows[c]; ++m)
      for (int n = 0; n < s.colsb[c] / 4; ++n) {
        float acc = C[16 * m + n];
        for (int p = 0; p < s.rows[b]; ++p)
          acc += static_cast<float>(A[32 * m + 2 * p]) * static_cast<float>(B[32 * p + 2 * n]) +
                 static_cast<float>(A[32 * m + 2 * p + 1]) * static_cast<float>(B[32 * p + 2 * n + 1]);
        C[16 * m + n] = acc;
      }
  }
  static void store(int t, void* p, int64_t stride) {
    TORCH_CHECK(t >= 0 && t < 4, "amx_tiles: store a C tile (0-3)");
    File& f = file();
    for (int r = 0; r < f.shape.rows[t]; ++r)
      std::memcpy(static_cast<char*>(p) + r * stride, f.data[t] + 64 * r, f.shape.colsb[t]);
  }
  static void release() {}
};

}  // namespace radixserve_amx
