// quant_packed.cpp's kernels for CPUs with AVX2 and no AVX-512 VNNI (AMD Zen 2/3, Intel before Ice Lake): the same
// 16-channel groups, the same integer sums and the same float32 operations in the same order, so a product gives
// the bits of the AVX-512 kernel (the K-quants excepted: quant_packed_avx2_q8k.h rounds their activations per
// 256). Included by quant_packed.cpp inside its namespace, after the layouts (Row, Q4KRow, Q6Row), Acts and
// prefetch; not a stand-alone header.
//
// A 256-bit register holds 8 channels' 4 weights, so a group is two halves of 8 channels. AVX2 has no vpdpbusd:
// vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16 lanes, vpmaddwd by ones adds those pairs
// into the int32 lane of the channel. The int16 sums are exact while they cannot overflow: a 4-bit level times an
// activation is at most 15 x 127, so a block's 8 pair sums add up in int16 and widen once (30,480 at most); 5-bit
// levels (Q5_0, Q5_1, Q5_K) widen every 4 (31,496), Q6_K's 6-bit levels every 2 (32,004); Q8_0's levels are
// signed, so each product takes |w| and x with w's sign (llama.cpp's trick; |w| <= 128, so a pair sum is at most
// 32,512) and widens at once.
//
// With one row of activations (decode) both halves run in one pass over the group's bytes; with more, one half at
// a time (AVX2 has 16 vector registers: 2 halves x MR rows of float and int16 sums do not fit), the second pass
// finding the group's bytes in cache.
#pragma once

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

inline __m256 fp16x8_to_float(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 u8x8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 i8x8_to_float(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// gcc reassociates a chain of integer vector adds (they wrap, so any order is exact): it computed all of a block's
// products first and summed them after, spilling them to the stack. This empty asm makes the sum so far an input
// the chain cannot be rearranged across, so each product is added as it is made.
inline void keep_in_register(__m256i& v) { asm("" : "+x"(v)); }

// An int16 running sum plus a product, added as it is made (above). vpaddw, not vpaddsw: on Zen 3 vpaddsw issues
// on the two pipes vpmaddubsw needs (a loop of both ran 1.8x slower than one with vpaddw, which has four); the
// sums never overflow, by the bounds above. One thread, 1B shapes, 16-1,024 rows: Q4_K +7-12%, Q4_1 +10-17%.
inline __m256i add16(__m256i sum, __m256i product) {
  __m256i s = _mm256_add_epi16(sum, product);
  keep_in_register(s);
  return s;
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// MR rows' 8 outputs of channels [c0, c0 + 8) (those below N). bfloat16 rounds as c10 does: to nearest even, the
// bits of the AVX-512 kernel's conversion.
template <int MR, typename T>
inline void store_half(const __m256* acc, T* y, int64_t m0, int64_t N, int64_t c0) {
  const int64_t valid = std::min<int64_t>(8, N - c0);
  for (int r = 0; r < MR; ++r) {
    T* out = y + (m0 + r) * N + c0;
    if constexpr (std::is_same_v<T, float>) {
      if (valid == 8) {
        _mm256_storeu_ps(out, acc[r]);
        continue;
      }
    }
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, acc[r]);
    for (int64_t i = 0; i < valid; ++i) out[i] = static_cast<T>(tmp[i]);
  }
}

// One block of 32 4-bit weights (`q`: its quants, NH halves from h0) against MR rows of int8 activations (row r's
// block at x + r * stride): the int16 pair sums p[NH * r + h], exact by the bounds above (widened by the caller).
template <int MR, int NH>
__attribute__((always_inline)) inline void nibble_sums(const int8_t* x, int64_t stride, const uint8_t* q, int h0,
                                                       __m256i* p) {
  const __m256i low = _mm256_set1_epi8(15);
  q += 32 * h0;  // the loads below at fixed offsets from one pointer (offsets of h0 took a register each)
  for (int i = 0; i < MR * NH; ++i) p[i] = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    for (int h = 0; h < NH; ++h) {
      const __m256i raw = load32(q + 64 * j + 32 * h);
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = x + r * stride;
        __m256i& pr = p[NH * r + h];
        pr = add16(pr, _mm256_maddubs_epi16(lo, bcast4(xq + 4 * j)));
        pr = add16(pr, _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * j)));
      }
    }
  }
}

// Bit FROM of every byte of v at bit 4, the others cleared: a 16-bit lane shift by at most 4 left or 3 right
// moves no other byte's bit to bit 4 (the 5-bit types' fifth bits, see quant_packed.cpp's layout).
template <int FROM>
inline __m256i bit_to_4(__m256i v) {
  const __m256i m = _mm256_set1_epi8(0x10);
  if constexpr (FROM < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - FROM), m);
  if constexpr (FROM > 4) return _mm256_and_si256(_mm256_srli_epi16(v, FROM - 4), m);
  return _mm256_and_si256(v, m);
}

// Run j (weights 4 j .. 4 j + 3 and 16 + 4 j .. 16 + 4 j + 3) of a block of 32 5-bit weights against MR rows: the
// int16 pair sums p[NH * r + h] grow by its products (fifth: each half's fifth bits).
template <int J, int MR, int NH>
__attribute__((always_inline)) inline void fifth_run(const int8_t* x, int64_t stride, const uint8_t* q,
                                                     const __m256i* fifth, __m256i* p) {
  const __m256i low = _mm256_set1_epi8(15);
  for (int h = 0; h < NH; ++h) {
    const __m256i raw = load32(q + 64 * J + 32 * h);
    const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low), bit_to_4<2 * J>(fifth[h]));
    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), bit_to_4<2 * J + 1>(fifth[h]));
    for (int r = 0; r < MR; ++r) {
      const int8_t* xq = x + r * stride;
      __m256i& pr = p[NH * r + h];
      pr = add16(pr, _mm256_maddubs_epi16(lo, bcast4(xq + 4 * J)));
      pr = add16(pr, _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * J)));
    }
  }
}

// One block of 32 5-bit weights (the nibbles at q and the fifth bits at `bits`, NH halves from h0) against MR
// rows: the int16 pair sums of runs 0-1 in p01[NH * r + h] and of runs 2-3 in p23 (each exact by the bound above;
// the caller widens both).
template <int MR, int NH>
__attribute__((always_inline)) inline void fifth_sums(const int8_t* x, int64_t stride, const uint8_t* q,
                                                      const uint8_t* bits, int h0, __m256i* p01, __m256i* p23) {
  __m256i fifth[NH];
  q += 32 * h0;  // fixed offsets from one pointer (as nibble_sums)
  for (int h = 0; h < NH; ++h) fifth[h] = load32(bits + 32 * (h0 + h));
  for (int i = 0; i < MR * NH; ++i) p01[i] = p23[i] = _mm256_setzero_si256();
  fifth_run<0, MR, NH>(x, stride, q, fifth, p01);
  fifth_run<1, MR, NH>(x, stride, q, fifth, p01);
  fifth_run<2, MR, NH>(x, stride, q, fifth, p23);
  fifth_run<3, MR, NH>(x, stride, q, fifth, p23);
}

// One block's integer dot products of a half (8 channels at byte offset 32 h of each 64-byte run) with MR rows,
// for the 32-weight types: s[NH * r + h] (int32 lane c: channel c's sum over the block's 32 weights).
template <int64_t TYPE, int MR, int NH>
__attribute__((always_inline)) inline void block_sums(const Acts& a, int64_t m0, int64_t nb, int64_t b,
                                                      const uint8_t* q, int h0, __m256i* s) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (TYPE == Q8_0) {
    for (int i = 0; i < MR * NH; ++i) s[i] = _mm256_setzero_si256();
    const uint8_t* qh = q + 32 * h0;  // fixed offsets from one pointer (as nibble_sums)
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      for (int h = 0; h < NH; ++h) {
        const __m256i w = load32(qh + 64 * j + 32 * h);  // signed levels (Q8_STORED_OFFSET)
        const __m256i aw = _mm256_abs_epi8(w);  // -128 -> 0x80, which vpmaddubsw reads as 128
        for (int r = 0; r < MR; ++r) {
          const __m256i x = bcast4(a.q.data() + ((m0 + r) * nb + b) * QK + 4 * j);
          const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w));
          s[NH * r + h] = _mm256_add_epi32(s[NH * r + h], _mm256_madd_epi16(p, ones));
          keep_in_register(s[NH * r + h]);
        }
      }
    }
  } else if constexpr (is_q5(TYPE)) {
    __m256i p01[MR * NH], p23[MR * NH];
    fifth_sums<MR, NH>(a.q.data() + (m0 * nb + b) * QK, nb * QK, q, q + 256, h0, p01, p23);
    for (int i = 0; i < MR * NH; ++i) {
      s[i] = _mm256_add_epi32(_mm256_madd_epi16(p01[i], ones), _mm256_madd_epi16(p23[i], ones));
    }
  } else {
    __m256i p[MR * NH];
    nibble_sums<MR, NH>(a.q.data() + (m0 * nb + b) * QK, nb * QK, q, h0, p);
    for (int i = 0; i < MR * NH; ++i) s[i] = _mm256_madd_epi16(p[i], ones);
  }
}

// MR rows against NH halves of group g starting at half h0: y[m0 + r][16 g + 8 h ...] (those below N), for the
// 32-weight types (the K-quants: quant_packed_avx2_q8k.h). The float operations are group_rows' (AVX-512) lane
// for lane.
template <int64_t TYPE, int MR, int NH, typename T, typename R>
void half_rows(const Acts& a, int64_t m0, int64_t K, const R& row, int64_t N, int64_t g, int h0, T* y, bool first) {
  const int64_t nb = K / QK, block = group_block_bytes(TYPE);
  __m256 acc[MR * NH];
  for (int i = 0; i < MR * NH; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch(row.row, b, block);
    __m256 dw[NH], mw[NH];
    for (int h = 0; h < NH; ++h) {
      const int c = 8 * (h0 + h);  // the half's first channel in the group
      dw[h] = fp16x8_to_float(row.scales(b) + 2 * c);
      if constexpr (has_offsets(TYPE)) mw[h] = fp16x8_to_float(row.offsets(b) + 2 * c);
    }
    __m256i s[MR * NH];
    block_sums<TYPE, MR, NH>(a, m0, nb, b, row.quants(b), h0, s);
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      for (int h = 0; h < NH; ++h) {
        __m256i si = s[NH * r + h];
        if constexpr (TYPE == Q4_0) si = _mm256_sub_epi32(si, _mm256_set1_epi32(8 * a.qsum[i]));
        if constexpr (TYPE == Q5_0) si = _mm256_sub_epi32(si, _mm256_set1_epi32(16 * a.qsum[i]));
        __m256& out = acc[NH * r + h];
        out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_mul_ps(dw[h], _mm256_set1_ps(a.d[i])), out);
        if constexpr (has_offsets(TYPE)) out = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(a.sum[i]), out);
      }
    }
  }
  for (int h = 0; h < NH; ++h) {
    __m256 part[MR];
    for (int r = 0; r < MR; ++r) part[r] = acc[NH * r + h];
    store_half<MR>(part, y, m0, N, g * G + 8 * (h0 + h));
  }
}

// MR rows against NH halves with the kernel of the weight's type (A: Acts256 for the K-quants, Acts for the others).
template <int64_t TYPE, int MR, int NH, typename T, typename R, typename A>
inline void halves_of(const A& a, int64_t m0, int64_t K, const R& row, int64_t N, int64_t g, int h0, T* y,
                      bool first) {
  if constexpr (TYPE == Q6_K) {
    half_rows_q6<MR, NH, T>(a, m0, K, row, N, g, h0, y, first);
  } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
    half_rows_kq<MR, NH, T>(a, m0, K, row, N, g, h0, y, first);
  } else {
    half_rows<TYPE, MR, NH, T, R>(a, m0, K, row, N, g, h0, y, first);
  }
}

// Rows [m0, m1) against group g: one row both halves in one pass; more rows MR at a time, half by half (a half
// whose channels are all padding is skipped). MR: as many rows as keep their float and integer sums in the 16
// registers beside the weights (6; Q6_K 4: two sums a row). Measured on Zen 3, one thread, 16 and 256 rows of
// 2048 x 8192 and 8192 x 2048: 4-bit 6 rows 5-15% faster than 4 and than 8, 5 level with 6. Q8_0 and the 5-bit
// types were 5 and 4 while a half's load offsets took registers (block_sums); since they load at fixed offsets,
// 6 rows run them 1-8% faster (16 rows: 3 passes instead of 4).
template <int64_t TYPE, typename T, typename R, typename A>
void group_all(const A& a, int64_t m0, int64_t m1, int64_t K, const R& row, int64_t N, int64_t g, T* y) {
  if (m1 - m0 == 1) {
    halves_of<TYPE, 1, 2, T, R, A>(a, m0, K, row, N, g, 0, y, true);
    return;
  }
  constexpr int MR = TYPE == Q6_K ? 4 : 6;
  for (int h = 0; h < 2 && g * G + 8 * h < N; ++h) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR) halves_of<TYPE, MR, 1, T, R, A>(a, m, K, row, N, g, h, y, h == 0 && m == m0);
    const bool first = h == 0 && m == m0;
    switch (m1 - m) {  // fewer than MR rows left (the cases a type's MR never leaves are not built)
      case 5:
        if constexpr (MR > 5) halves_of<TYPE, 5, 1, T, R, A>(a, m, K, row, N, g, h, y, first);
        break;
      case 4:
        if constexpr (MR > 4) halves_of<TYPE, 4, 1, T, R, A>(a, m, K, row, N, g, h, y, first);
        break;
      case 3: halves_of<TYPE, 3, 1, T, R, A>(a, m, K, row, N, g, h, y, first); break;
      case 2: halves_of<TYPE, 2, 1, T, R, A>(a, m, K, row, N, g, h, y, first); break;
      case 1: halves_of<TYPE, 1, 1, T, R, A>(a, m, K, row, N, g, h, y, first); break;
      default: break;
    }
  }
}
