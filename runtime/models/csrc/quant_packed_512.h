// quant_packed.cpp's AVX-512 VNNI kernel: MR rows of activations against one 16-channel group, per block type
// (Q6_K's in quant_packed_kquants.h). Included by quant_packed.cpp inside its namespace, after the helpers it uses
// (Acts, bcast4, bit_to_4, fp16x16_to_float, prefetch, store_rows, the K-quant rows); not a stand-alone header.
#pragma once

#ifdef RS_PACKED_512
// Run j of a block of 32 4-bit (or, with their fifth bits at bit 4, 5-bit) weights against MR rows of
// activations (row r's block at x + r * stride): low levels into s0, high ones into s1.
// HIGH16 (4-bit levels only, s1 a chain of its own): the high nibbles stay where they lie, one AND instead of a
// shift and an AND, and s1 sums 16 x their products (at most 4 x 240 x 128 a lane and run: no overflow).
template <int64_t TYPE, int J, int MR, bool HIGH16>
__attribute__((always_inline)) inline void nibble_run(const int8_t* x, int64_t stride, const uint8_t* q,
                                                      __m512i fifth, __m512i* s0, __m512i* s1) {
  const __m512i low = _mm512_set1_epi8(15);
  const __m512i raw = _mm512_loadu_si512(q + 64 * J);
  __m512i lo = _mm512_and_si512(raw, low);
  __m512i hi;
  if constexpr (HIGH16) {
    hi = _mm512_and_si512(raw, _mm512_set1_epi8(static_cast<char>(0xF0)));
  } else {
    hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
  }
  if constexpr (has_fifth_bits(TYPE)) {
    lo = _mm512_or_si512(lo, bit_to_4<2 * J>(fifth));
    hi = _mm512_or_si512(hi, bit_to_4<2 * J + 1>(fifth));
  }
  for (int r = 0; r < MR; ++r) {
    s0[r] = _mm512_dpbusd_epi32(s0[r], lo, bcast4(x + r * stride + 4 * J));
    s1[r] = _mm512_dpbusd_epi32(s1[r], hi, bcast4(x + r * stride + 16 + 4 * J));
  }
}

// Block b's 16 scales d * scale and offsets -dmin * min of a Q4_K (Q5_K) group row (see KRowT); ODD: the second
// block of its pair, whose minimums' top bits are the high nibbles of the pair's bytes.
template <bool ODD, typename R>
__attribute__((always_inline)) inline void kq_scales(const R& row, int64_t b, __m512 d, __m512 neg_dmin, __m512& dw,
                                                     __m512& mw) {
  const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.low(b))));
  const __m512i pair = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row.high(b))));
  // The minimums' top 4 bits to bits 2-5: the pair byte's low nibble up by 2, its high one down by 2.
  const __m512i top = ODD ? _mm512_srli_epi32(pair, 2) : _mm512_slli_epi32(pair, 2);
  const __m512i sc = _mm512_and_si512(lo, _mm512_set1_epi32(63));
  // 0xF8: A | (B & C), the minimum's low 2 bits (the byte's top ones) with its top 4.
  const __m512i mn = _mm512_ternarylogic_epi32(_mm512_srli_epi32(lo, 6), top, _mm512_set1_epi32(0x3C), 0xF8);
  dw = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
  mw = _mm512_mul_ps(neg_dmin, _mm512_cvtepi32_ps(mn));
}

// MR rows of x against channel group g: y[m0 + r][16 g .. 16 g + 15] (the first `valid` of them).
template <int64_t TYPE, int MR, typename T, typename R>
void group_rows(const Acts& a, int64_t m0, int64_t K, const R& row, int64_t N, int64_t g, T* y, bool first) {
  const int64_t nb = K / QK;
  const __m512i low = _mm512_set1_epi8(15);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t block = group_block_bytes(TYPE);
  __m512 d = _mm512_setzero_ps(), neg_dmin = _mm512_setzero_ps();  // a K-quant's super-block's, decoded here
  // Two integer chains per row where there are few rows (the dot products' latency), one where rows give enough
  // independent work. Integer sums are exact: the result is the same either way.
  constexpr bool TWO = MR <= 2;
  // With two chains, 4-bit types multiply their high nibbles where they lie (one AND, no shift: see nibble_run).
  constexpr bool HIGH16 = TWO && TYPE != Q8_0 && !has_fifth_bits(TYPE);
  // Decoding K-quant scales here takes the blocks in pairs (nb is a multiple of 8), so that which nibble of the
  // pair's bytes a block reads (e) is a constant.
  constexpr int STEP = is_kq(TYPE) ? 2 : 1;
  for (int64_t b0 = 0; b0 < nb; b0 += STEP)
#pragma GCC unroll 2
  for (int e = 0; e < STEP; ++e) {
    const int64_t b = b0 + e;
    if (first) prefetch(row.row, b, block);
    __m512 dw, mw;
    if constexpr (is_kq(TYPE)) {
      if (b % 8 == 0) {
        d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.d(b))));
        neg_dmin = _mm512_sub_ps(_mm512_setzero_ps(),
                                 _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.dmin(b)))));
      }
      if (e) {
        kq_scales<true>(row, b, d, neg_dmin, dw, mw);
      } else {
        kq_scales<false>(row, b, d, neg_dmin, dw, mw);
      }
    } else {
      dw = fp16x16_to_float(row.scales(b));
      if constexpr (has_offsets(TYPE)) mw = fp16x16_to_float(row.offsets(b));
    }
    const uint8_t* q = row.quants(b);
    __m512i s0[MR], s1[MR];
    for (int r = 0; r < MR; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
    __m512i(&s1_)[MR] = TWO ? s1 : s0;
    if constexpr (TYPE == Q8_0) {
      for (int j = 0; j < 8; j += 2) {
        const __m512i w0 = _mm512_loadu_si512(q + 64 * j), w1 = _mm512_loadu_si512(q + 64 * (j + 1));
        for (int r = 0; r < MR; ++r) {
          const int8_t* xq = a.q.data() + ((m0 + r) * nb + b) * QK;
          s0[r] = _mm512_dpbusd_epi32(s0[r], w0, bcast4(xq + 4 * j));
          s1_[r] = _mm512_dpbusd_epi32(s1_[r], w1, bcast4(xq + 4 * (j + 1)));
        }
      }
    } else {
      [[maybe_unused]] const __m512i fifth =
          has_fifth_bits(TYPE) ? _mm512_loadu_si512(row.fifth(b)) : low;
      const int8_t* xq = a.q.data() + (m0 * nb + b) * QK;
      nibble_run<TYPE, 0, MR, HIGH16>(xq, nb * QK, q, fifth, s0, s1_);
      nibble_run<TYPE, 1, MR, HIGH16>(xq, nb * QK, q, fifth, s0, s1_);
      nibble_run<TYPE, 2, MR, HIGH16>(xq, nb * QK, q, fifth, s0, s1_);
      nibble_run<TYPE, 3, MR, HIGH16>(xq, nb * QK, q, fifth, s0, s1_);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      // HIGH16's sums are 16 x the levels' (every product a multiple of 16): the shift is exact.
      __m512i s = TWO ? _mm512_add_epi32(s0[r], HIGH16 ? _mm512_srai_epi32(s1[r], 4) : s1[r]) : s0[r];
      if constexpr (TYPE == Q8_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * a.qsum[i]));
      if constexpr (TYPE == Q4_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(8 * a.qsum[i]));
      if constexpr (TYPE == Q5_0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(16 * a.qsum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i])), acc[r]);
      if constexpr (has_offsets(TYPE) || is_kq(TYPE)) {
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.sum[i]), acc[r]);
      }
    }
  }
  store_rows<MR>(acc, y, m0, N, g);
}

// MR rows against group g with the kernel of the weight's type.
template <int64_t TYPE, int MR, typename T, typename R>
inline void rows_of(const Acts& a, int64_t m0, int64_t K, const R& row, int64_t N, int64_t g, T* y, bool first) {
  if constexpr (TYPE == Q6_K) {
    group_rows_q6<MR, T>(a, m0, K, row, N, g, y, first);
  } else {
    group_rows<TYPE, MR, T, R>(a, m0, K, row, N, g, y, first);
  }
}

// Rows [m0, m1) against group g, MAX_MR rows at a time (all accumulators in registers).
template <int64_t TYPE, typename T, typename R>
void group_all(const Acts& a, int64_t m0, int64_t m1, int64_t K, const R& row, int64_t N, int64_t g, T* y) {
  const int64_t start = m0;
  for (; m0 + MAX_MR <= m1; m0 += MAX_MR) rows_of<TYPE, MAX_MR, T, R>(a, m0, K, row, N, g, y, m0 == start);
  switch (m1 - m0) {
    case 7: rows_of<TYPE, 7, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 6: rows_of<TYPE, 6, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 5: rows_of<TYPE, 5, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 4: rows_of<TYPE, 4, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 3: rows_of<TYPE, 3, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 2: rows_of<TYPE, 2, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    case 1: rows_of<TYPE, 1, T, R>(a, m0, K, row, N, g, y, m0 == start); break;
    default: break;
  }
}
#endif
