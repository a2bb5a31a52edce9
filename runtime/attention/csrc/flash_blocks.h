// The building blocks of flash attention over bfloat16 keys and values on AVX-512 BF16, shared by the prefill kernel
// (extend_attention.cpp) and the prefix of decode rows that share one (decode_attention.cpp's groups): keys and
// values packed in blocks of KB into the operand layouts of vdpbf16ps, scores and weighted values of a few query
// rows per register block, and 2^x for the online softmax.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

namespace radixserve_flash {

constexpr int64_t KB = 64;  // keys per block of the online softmax (4 tiles of 16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define RADIXSERVE_FLASH 1
#include <immintrin.h>

inline __m512bh as_bh(__m512i v) { return (__m512bh)v; }

// Packed keys and values on whole cache lines: a 64-byte load from a buffer that malloc placed 16 bytes into a line
// touches two lines, and the attention kernels load every packed word that way (decode rows over a shared prefix:
// 0.24 or 0.34 ms a layer from one run to the next, by where the buffer fell).
struct Aligned {
  void operator()(uint32_t* p) const { std::free(p); }
};
using PackedWords = std::unique_ptr<uint32_t[], Aligned>;
inline PackedWords packed_words(size_t n) {
  void* p = std::aligned_alloc(64, std::max<size_t>(64, (n * sizeof(uint32_t) + 63) / 64 * 64));
  TORCH_CHECK(p != nullptr, "attention: out of memory for ", n, " packed words");
  return PackedWords(static_cast<uint32_t*>(p));
}

// 16 rows of 16 words (r[i]: row i) into 16 columns (r[c]: word c of every row), in registers.
inline void transpose16(__m512i* r) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {  // words of row pairs, interleaved within each 128-bit lane
    a[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // b[4k + m], 128-bit lane L: rows 4k..4k+3 of column 4L + m
    b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // lane L of b[m], b[4 + m], b[8 + m], b[12 + m]: column 4L + m
    const __m512i even_lo = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x88);
    const __m512i odd_lo = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xdd);
    const __m512i even_hi = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x88);
    const __m512i odd_hi = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xdd);
    r[m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0x88);
    r[8 + m] = _mm512_shuffle_i32x4(even_lo, even_hi, 0xdd);
    r[4 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0x88);
    r[12 + m] = _mm512_shuffle_i32x4(odd_lo, odd_hi, 0xdd);
  }
}

// Packing, for one (sequence, KV head, block of KB keys): keys into Kt tiles, values into Vt pairs; keys from
// ``count`` on are padding, zero. D % 32 == 0.
// Kt: per tile of 16 keys, D/2 registers; register p holds, per key lane, its dimensions (2p, 2p+1) as one word:
// 16 words of 16 keys at a time, transposed in registers.
// Vt: per pair of keys (2j, 2j+1), D/16 registers; register c holds, per lane l, (v[2j][16c+l], v[2j+1][16c+l]):
// 32 dimensions of the two keys interleaved by one permute per register.
inline void pack_block(const uint16_t* keys, const uint16_t* values, const int64_t* slots, int64_t first, int64_t count,
                       int64_t D, uint32_t* kt, uint32_t* vt) {
  const int64_t DP = D / 2;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t tile = 0; tile < KB / 16; ++tile) {
    uint32_t* dst = kt + tile * DP * 16;
    const uint16_t* rows[16];
    for (int64_t lane = 0; lane < 16; ++lane) {
      const int64_t j = first + tile * 16 + lane;
      rows[lane] = j < count ? keys + slots[j] * D : nullptr;
    }
    for (int64_t p0 = 0; p0 < DP; p0 += 16) {
      __m512i r[16];
      for (int lane = 0; lane < 16; ++lane)
        r[lane] = rows[lane] != nullptr ? _mm512_loadu_si512(rows[lane] + 2 * p0) : zero;
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + (p0 + p) * 16, r[p]);
    }
  }
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                      36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t pair = 0; pair < KB / 2; ++pair) {
    uint32_t* dst = vt + pair * D;  // D words: D/16 registers of 16 lanes
    const int64_t j0 = first + 2 * pair, j1 = j0 + 1;
    const uint16_t* v0 = j0 < count ? values + slots[j0] * D : nullptr;
    const uint16_t* v1 = j1 < count ? values + slots[j1] * D : nullptr;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = v0 != nullptr ? _mm512_loadu_si512(v0 + d) : zero;
      const __m512i b = v1 != nullptr ? _mm512_loadu_si512(v1 + d) : zero;
      _mm512_storeu_si512(dst + d, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_storeu_si512(dst + d + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
  }
}

// Scores of MR query rows against the 4 tiles of one key block: s[m][t*16 + lane] = q_m . k_lane.
template <int DP, int MR, int NT>
inline void block_scores(const uint32_t* const* qrows, const uint32_t* kt, float* s) {
  __m512 acc[MR][NT];
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int p = 0; p < DP; ++p) {
    __m512bh k[NT];
    for (int t = 0; t < NT; ++t) k[t] = as_bh(_mm512_loadu_si512(kt + (t * DP + p) * 16));
    for (int m = 0; m < MR; ++m) {
      const __m512bh qv = as_bh(_mm512_set1_epi32(static_cast<int>(qrows[m][p])));
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], k[t], qv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int t = 0; t < NT; ++t) _mm512_storeu_ps(s + m * KB + t * 16, acc[m][t]);
}

// o[m] = o[m] * alpha[m] + P[m] . V over one key block, for MR rows of ND * 16 dimensions (float32 in memory).
template <int ND, int MR>
inline void block_values(const uint32_t* const* prow, const float* alpha, const uint32_t* vt, float* const* orow,
                         int pairs) {
  __m512 acc[MR][ND];
  for (int m = 0; m < MR; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int c = 0; c < ND; ++c) acc[m][c] = _mm512_mul_ps(_mm512_loadu_ps(orow[m] + c * 16), a);
  }
  for (int pair = 0; pair < pairs; ++pair) {
    __m512bh v[ND];
    for (int c = 0; c < ND; ++c) v[c] = as_bh(_mm512_loadu_si512(vt + (pair * ND + c) * 16));
    for (int m = 0; m < MR; ++m) {
      const __m512bh pv = as_bh(_mm512_set1_epi32(static_cast<int>(prow[m][pair])));
      for (int c = 0; c < ND; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], v[c], pv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(orow[m] + c * 16, acc[m][c]);
}

// 2^x for x <= 0 (-inf included: 0): x = n + f, |f| <= 1/2, 2^f by its Taylor polynomial of degree 6 in f ln2
// (truncation error < 2e-7, about float32's rounding), times 2^n by scalef.
inline __m512 exp2v(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-160.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  constexpr float L = 0.6931471805599453f;
  __m512 p = _mm512_set1_ps(L * L * L * L * L * L / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(L * L * L * L * L / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(L * L * L * L / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(L * L * L / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(L * L / 2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(L));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Scores of rows [0, Rp) (Rp a multiple of MR) against the first nt tiles of a packed block of keys.
template <int DP, int MR>
inline void scores_rows(const uint32_t* const* qrows, int64_t Rp, const uint32_t* kt, int nt, float* s) {
  for (int64_t r = 0; r < Rp; r += MR) {
    switch (nt) {
      case 1: block_scores<DP, MR, 1>(qrows + r, kt, s + r * KB); break;
      case 2: block_scores<DP, MR, 2>(qrows + r, kt, s + r * KB); break;
      case 3: block_scores<DP, MR, 3>(qrows + r, kt, s + r * KB); break;
      default: block_scores<DP, MR, 4>(qrows + r, kt, s + r * KB); break;
    }
  }
}

// One row's weights over a block, for the online softmax: p = 2^(cv s - mc) of its KB scores ``sr`` (masked ones
// -inf), rounded to bfloat16 into ``pr`` for the product with the values; its per-lane running sums ``lr`` rescaled
// by ``alpha`` and increased by the unrounded weights.
inline void weights_row(const float* sr, __m512 cv, float mc, float alpha, uint16_t* pr, float* lr) {
  const __m512 m = _mm512_set1_ps(mc);
  __m512 sum = _mm512_setzero_ps();
  for (int t = 0; t < 4; ++t) {
    const __m512 e = exp2v(_mm512_fmsub_ps(_mm512_loadu_ps(sr + t * 16), cv, m));
    sum = _mm512_add_ps(sum, e);
    const __m256bh rounded = _mm512_cvtneps_pbh(e);
    std::memcpy(pr + t * 16, &rounded, sizeof(rounded));
  }
  _mm512_storeu_ps(lr, _mm512_fmadd_ps(_mm512_loadu_ps(lr), _mm512_set1_ps(alpha), sum));
}

// o[r] = o[r] * alpha[r] + P[r] . V for rows [0, Rp) (a multiple of 16 / ND): weights ``pb`` (rows of KB), outputs
// ``o`` (rows of ND * 16 float32), over the first nt tiles of a packed block of values.
template <int ND>
inline void values_rows(const uint16_t* pb, const float* alpha, int64_t Rp, const uint32_t* vt, int nt, float* o) {
  constexpr int MRV = 16 / ND;  // rows per register block: 16 accumulators + ND value registers
  for (int64_t r = 0; r < Rp; r += MRV) {
    const uint32_t* prow[MRV];
    float* orow[MRV];
    for (int m = 0; m < MRV; ++m) {
      prow[m] = reinterpret_cast<const uint32_t*>(pb + (r + m) * KB);
      orow[m] = o + (r + m) * ND * 16;
    }
    block_values<ND, MRV>(prow, alpha + r, vt, orow, nt * 8);
  }
}

#endif

}  // namespace radixserve_flash
