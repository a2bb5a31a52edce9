// AVX-512 helpers shared by the CPU kernels: float32 / bfloat16 loads and stores of 16 lanes, e^x, and the sums of
// 16 vectors' lanes at once.
// Every kernel keeps a scalar path for CPUs without AVX-512; these exist only under __AVX512F__.
#pragma once

#include <c10/util/BFloat16.h>

#ifdef __AVX512F__
#include <immintrin.h>

namespace radixserve_simd {

using bf16 = c10::BFloat16;

// 16 consecutive values widened to float32 (a bfloat16 is the top half of a float32: exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The first n (< 16) values, the other lanes 0.
inline __m512 load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
inline __m512 load_n(const bf16* p, int n) {
  const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// float32 -> bfloat16 rounded to nearest even, NaN kept a quiet NaN: the bits c10::BFloat16(float) gives.
inline __m256i to_bf16(__m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline void store_n(float* p, __m512 v, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
inline void store_n(bf16* p, __m512 v, int n) {
  _mm256_mask_storeu_epi16(p, static_cast<__mmask16>((1u << n) - 1), to_bf16(v));
}

// Rounded to the storage type and back (what a float32 result becomes once stored as T).
inline __m512 round_as(__m512 v, const float*) { return v; }
inline __m512 round_as(__m512 v, const bf16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial of degree 7 (truncation error < 1e-8, below
// float32 rounding), times 2^n by scalef (exact; underflows to 0 below -104, overflows to inf above 88.7).
inline __m512 exp(__m512 x) {
  // max/min return their second operand when either is NaN: a NaN stays NaN.
  x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Lane i of the result is the sum of the 16 lanes of v[i]: a butterfly of 15 additions of half-vectors, then one
// permutation, about 3 instructions a vector instead of a horizontal sum's ~9.
inline __m512 hsum16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i)  // w[i] = [v[2i]: 8 partial sums | v[2i+1]: 8]
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  __m512 x[4];
  for (int i = 0; i < 4; ++i)  // x[i] = v[4i .. 4i+3], 4 partial sums each, one 128-bit block per vector
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  __m512 y[2];
  for (int i = 0; i < 2; ++i)  // block k of y[i]: v[8i+k] and v[8i+4+k], 2 partial sums each
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x88), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xDD));
  // block k of z: v[k], v[4+k], v[8+k], v[12+k], summed: lane 4k + m holds v[4m + k].
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x88), _mm512_shuffle_ps(y[0], y[1], 0xDD));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

}  // namespace radixserve_simd

#endif  // __AVX512F__
