// SIMD helpers shared by the CPU kernels: float32 / bfloat16 loads and stores of 16 lanes, e^x, and the sums of
// 16 vectors' lanes at once.
// Every kernel keeps a scalar path for CPUs without AVX-512; these exist only under __AVX512F__.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace radixserve_simd {
using bf16 = c10::BFloat16;

// e^r for |r| <= ln2 / 2 by its Taylor polynomial of degree 7, highest coefficient first (Horner), and the split of
// ln2 that keeps x - n ln2 exact: the one definition both vector widths' exp use.
constexpr float EXP_TAYLOR[8] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
constexpr float LOG2E = 1.4426950408889634f, LN2_HI = 0.693145751953125f, LN2_LO = 1.428606765330187e-06f;
}  // namespace radixserve_simd

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#ifdef __AVX512F__

namespace radixserve_simd {

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
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_TAYLOR[i]));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u = g u / (1 + e^-g), 16 lanes: the one definition of the AVX-512 SiLU-and-multiply (fused_ops' silu_mul
// and bf16_packed's gate/up product compute the same bits). 1 / den by a reciprocal estimate and one Newton step
// (relative error ~1e-7): a division would bound the loop (one per 16 cycles). -g is capped at 80 so that den stays
// finite (inf * 0 would give NaN in the Newton step); there sig ~ 1.8e-35 and the product rounds to -0, as the exact
// one does.
inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g), _mm512_set1_ps(80.0f));
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp(neg));
  const __m512 r0 = _mm512_rcp14_ps(den);
  const __m512 sig = _mm512_mul_ps(r0, _mm512_fnmadd_ps(den, r0, _mm512_set1_ps(2.0f)));
  return _mm512_mul_ps(_mm512_mul_ps(g, sig), u);
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

// 8-lane helpers: the AVX2 kernels' (CPUs without AVX-512: AMD Zen 2/3, Intel before Ice Lake), and the row-layout
// quantized kernel's on every CPU with AVX2.
#if defined(__AVX2__) && defined(__FMA__)
namespace radixserve_simd {

// 8 consecutive values widened to float32 (a bfloat16 is the top half of a float32: exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// e^x for -87 <= x <= 88 (others: the caller's clamp), as the AVX-512 exp computes it, 2^n built in the exponent
// bits (AVX2 has no scalef; n stays within a normal float's exponents).
inline __m256 exp_in_range(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_TAYLOR[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_TAYLOR[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// e^x for x <= 0 (softmax numerators). Below -87 the result is e^-87 (~1e-38: nothing beside a row's largest term,
// 1); a NaN stays NaN.
inline __m256 exp_nonpositive(__m256 x) {
  return exp_in_range(_mm256_max_ps(_mm256_set1_ps(-87.0f), x));  // (max returns its second operand for a NaN)
}

}  // namespace radixserve_simd
#endif
