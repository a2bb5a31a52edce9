// Q4_K on AVX2 with the activations rounded once per super-block of 256 (one scale, as llama.cpp's Q8_K rounds
// them for its K-quant dot products) instead of per block of 32. With one activation scale for the 8 blocks of a
// super-block, each block's integer sums are scaled by its 6-bit scale in the integers (vpmaddwd, in place of the
// widening by ones) and the float work is done once per super-block: per row and block of 32 the per-32 kernel
// ran a conversion, a multiply and two fused multiply-adds, which share pipes with vpmaddubsw on Zen 3 (a timing
// run without them went 1.5x faster). The minimums' term is integer too: the rows' sums of rounded activations
// per block, two to an int32 (Acts256::bpair), times the 6-bit minimums, two blocks per vpmaddwd.
//
// Bounds: a block's int16 pair sums as in quant_packed_avx2.h (30,480 at most); times a scale <= 63, summed over
// the super-block's 8 blocks: < 2^25 in int32. A block's activation sum is at most 32 x 127 = 4,064 (int16).
// Included by quant_packed.cpp after quant_packed_avx2.h; not a stand-alone header.
#pragma once

// x rounded to int8 per super-block of 256: d = max|x| / 127, q = nearest-even(x * (1 / d)) (as quantize_rows per
// 32), and the sums of q per block of 32, two blocks to a word (low: block 2 k, high: block 2 k + 1).
struct Acts256 {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K / 256]
  std::vector<int32_t> bpair;  // [M, K / 64]
};

template <typename T>
void quantize_rows_256(const T* x, int64_t M, int64_t K, Acts256& out) {
  const int64_t ns = K / 256;
  out.q.resize(M * K);
  out.d.resize(M * ns);
  out.bpair.resize(M * K / 64);
  at::parallel_for(0, M * ns, 16, [&](int64_t i0, int64_t i1) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = i0; i < i1; ++i) {
      const T* xs = x + i * 256;
      __m256 m = _mm256_setzero_ps();
      for (int k = 0; k < 32; ++k) m = _mm256_max_ps(m, _mm256_and_ps(radixserve_simd::load8(xs + 8 * k), abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 127.0f;
      const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      int32_t sums[8];
      for (int b = 0; b < 8; ++b) {
        __m256i q[4];  // nearest-even, as nearbyint (the default rounding mode)
        for (int k = 0; k < 4; ++k)
          q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(radixserve_simd::load8(xs + 32 * b + 8 * k), id));
        // int32 -> int8; the packs interleave 128-bit lanes, the permutation restores the order.
        const __m256i b16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * 256 + 32 * b),
                            _mm256_permutevar8x32_epi32(b16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        sums[b] =
            radixserve_simd::hsum8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
      }
      for (int k = 0; k < 4; ++k) {  // two's complement int16 halves, as vpmaddwd reads them
        const uint32_t lo = static_cast<uint16_t>(sums[2 * k]), hi = static_cast<uint16_t>(sums[2 * k + 1]);
        out.bpair[i * 4 + k] = static_cast<int32_t>(lo | hi << 16);
      }
      out.d[i] = d;
    }
  });
}

// 8 bytes as int32 lanes, each value in both of its int16 halves (vpmaddwd then scales both of a channel's pair
// sums by it).
inline __m256i bytes_in_pairs(const uint8_t* p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}
// Lane c: a[c] in the low int16, b[c] in the high one.
inline __m256i bytes_as_pair(const uint8_t* a, const uint8_t* b) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16));
}

// MR rows against NH halves of a Q4_K group, starting at half h0 (as half_rows).
template <int MR, int NH, typename T>
void half_rows_q4k(const Acts256& a, int64_t m0, int64_t K, const Q4KRow& row, int64_t N, int64_t g, int h0, T* y,
                   bool first) {
  const int64_t ns = K / 256, block = G * Q4_K_PACKED / 8;
  __m256 acc[MR * NH];
  for (int i = 0; i < MR * NH; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t s = 0; s < ns; ++s) {
    __m256i si[MR * NH];
    for (int i = 0; i < MR * NH; ++i) si[i] = _mm256_setzero_si256();
    for (int64_t b = 8 * s; b < 8 * s + 8; ++b) {
      if (first) prefetch(row.row, b, block);
      __m256i p[MR * NH];
      nibble_sums<MR, NH>(a.q.data() + m0 * K + 32 * b, K, row.quants(b), h0, p);
      for (int h = 0; h < NH; ++h) {
        const __m256i sc = bytes_in_pairs(row.scales(b) + 8 * (h0 + h));
        for (int r = 0; r < MR; ++r)
          si[NH * r + h] = _mm256_add_epi32(si[NH * r + h], _mm256_madd_epi16(p[NH * r + h], sc));
      }
    }
    for (int h = 0; h < NH; ++h) {
      const int c = 8 * (h0 + h);
      const __m256 d = fp16x8_to_float(row.d(8 * s) + 2 * c), dmin = fp16x8_to_float(row.dmin(8 * s) + 2 * c);
      __m256i mn[4];
      for (int k = 0; k < 4; ++k) mn[k] = bytes_as_pair(row.mins(8 * s + 2 * k) + c, row.mins(8 * s + 2 * k + 1) + c);
      for (int r = 0; r < MR; ++r) {
        const int64_t i = (m0 + r) * ns + s;
        __m256i mi = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k)
          mi = _mm256_add_epi32(mi, _mm256_madd_epi16(mn[k], _mm256_set1_epi32(a.bpair[4 * i + k])));
        const __m256 dx = _mm256_set1_ps(a.d[i]);
        __m256& out = acc[NH * r + h];
        out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[NH * r + h]), _mm256_mul_ps(d, dx), out);
        out = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mi), _mm256_mul_ps(dmin, dx), out);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    __m256 part[MR];
    for (int r = 0; r < MR; ++r) part[r] = acc[NH * r + h];
    store_half<MR>(part, y, m0, N, g * G + 8 * (h0 + h));
  }
}
