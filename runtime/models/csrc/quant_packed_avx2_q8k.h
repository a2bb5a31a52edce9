// The K-quants (Q4_K, Q5_K, Q6_K) on AVX2 with the activations rounded once per super-block of 256 (one scale, as
// llama.cpp's Q8_K rounds them for its K-quant dot products) instead of per block of 32. With one activation scale
// for the 8 blocks of a super-block, the blocks' integer sums are scaled by their integer sub-block scales in the
// integers (vpmaddwd, in place of the widening by ones) and the float work is done once per super-block: per row
// and block the per-32 kernels ran conversions, multiplies and fused multiply-adds, which share pipes with
// vpmaddubsw on Zen 3 (a timing run without them went 1.5x faster). Q4_K's minimums and Q6_K's level offset (32)
// are integer terms too: the rows' sums of rounded activations per block (Q4_K) or half block (Q6_K), two to an
// int32 (Acts256::bpair, hpair), times the 6-bit minimums or the sub-block scales.
//
// Bounds: Q4_K: a block's int16 pair sums as in quant_packed_avx2.h (30,480 at most); times a scale <= 63, summed
// over the super-block's 8 blocks: < 2^25. Q5_K: half a block's (31,496 at most), 16 halves: < 2^26. Q6_K: two
// j's of pair sums (32,004 at most) times |scale| <= 128, 4 of them a block, 8 blocks: < 2^29. Activation sums: a
// block's at most 32 x 127 = 4,064, a half block's 2,032 (int16).
// Included by quant_packed.cpp after quant_packed_avx2.h; not a stand-alone header.
#pragma once

// x rounded to int8 per super-block of 256: d = max|x| / 127, q = nearest-even(x * (1 / d)) (as quantize_rows per
// 32); the sums of q per block of 32, two blocks to a word (low: block 2 k, high: block 2 k + 1), and per half
// block, a block's two halves to a word.
struct Acts256 {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K / 256]
  std::vector<int32_t> bpair;  // [M, K / 64]
  std::vector<int32_t> hpair;  // [M, K / 32]
};

// Two int16 sums as one int32 (two's complement halves, as vpmaddwd reads them): a low, b high.
inline int32_t int16_pair(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(a)) |
                              static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16);
}

template <typename T>
void quantize_rows_256(const T* x, int64_t M, int64_t K, Acts256& out) {
  const int64_t ns = K / 256;
  out.q.resize(M * K);
  out.d.resize(M * ns);
  out.bpair.resize(M * K / 64);
  out.hpair.resize(M * K / 32);
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
        const int32_t first = radixserve_simd::hsum8(_mm256_add_epi32(q[0], q[1]));
        const int32_t last = radixserve_simd::hsum8(_mm256_add_epi32(q[2], q[3]));
        sums[b] = first + last;
        out.hpair[i * 8 + b] = int16_pair(first, last);
      }
      for (int k = 0; k < 4; ++k) out.bpair[i * 4 + k] = int16_pair(sums[2 * k], sums[2 * k + 1]);
      out.d[i] = d;
    }
  });
}

// Lanes: the 6-bit scales (MIN: minimums) of channels c .. c + 7 in block b of a Q4_K (Q5_K) group row (KRowT).
template <bool MIN, bool FIVE>
inline __m256i kq_values8(const KRowT<FIVE>& row, int64_t b, int c) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.low(b) + c)));
  if constexpr (!MIN) {
    return _mm256_and_si256(lo, _mm256_set1_epi32(63));
  } else {
    const __m256i pair = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row.high(b) + c)));
    const __m256i top = _mm256_srl_epi32(pair, _mm_cvtsi32_si128(KRowT<FIVE>::high_shift(b)));
    const __m256i top4 = _mm256_and_si256(top, _mm256_set1_epi32(15));
    return _mm256_or_si256(_mm256_srli_epi32(lo, 6), _mm256_slli_epi32(top4, 2));
  }
}

// The loop both kernels share: for each super-block s, the int32 sums si[SUMS] start at zero, block(b, si) adds
// each of its 8 blocks of 32 to them, and finish(s, si) scales them into the rows' float sums.
template <int SUMS, typename Block, typename Finish>
__attribute__((always_inline)) inline void each_super_block(int64_t ns, const Block& block, const Finish& finish) {
  for (int64_t s = 0; s < ns; ++s) {
    __m256i si[SUMS];
    for (int i = 0; i < SUMS; ++i) si[i] = _mm256_setzero_si256();
    for (int64_t b = 8 * s; b < 8 * s + 8; ++b) block(b, si);
    finish(s, si);
  }
}

// MR rows against NH halves of a Q4_K (Q5_K) group, starting at half h0 (as half_rows). Q5_K's 5-bit levels sum
// in int16 over half a block at a time (quant_packed_avx2.h's bounds), each half scaled by the block's scale.
template <int MR, int NH, typename T, bool FIVE>
void half_rows_kq(const Acts256& a, int64_t m0, int64_t K, const KRowT<FIVE>& row, int64_t N, int64_t g, int h0,
                  T* y, bool first) {
  const int64_t ns = K / 256, block = KRowT<FIVE>::BYTES / 8;
  __m256 acc[MR * NH];
  for (int i = 0; i < MR * NH; ++i) acc[i] = _mm256_setzero_ps();
  const auto add_block = [&](int64_t b, __m256i* si) {
    if (first) prefetch(row.row, b, block);
    __m256i p[MR * NH], p23[MR * NH];
    if constexpr (FIVE) {
      fifth_sums<MR, NH>(a.q.data() + m0 * K + 32 * b, K, row.quants(b), row.fifth(b), h0, p, p23);
    } else {
      nibble_sums<MR, NH>(a.q.data() + m0 * K + 32 * b, K, row.quants(b), h0, p);
    }
    for (int h = 0; h < NH; ++h) {
      const __m256i v = kq_values8<false>(row, b, 8 * (h0 + h));
      const __m256i sc = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));  // in both int16 halves
      for (int r = 0; r < MR; ++r) {
        si[NH * r + h] = _mm256_add_epi32(si[NH * r + h], _mm256_madd_epi16(p[NH * r + h], sc));
        if constexpr (FIVE) {
          si[NH * r + h] = _mm256_add_epi32(si[NH * r + h], _mm256_madd_epi16(p23[NH * r + h], sc));
        }
      }
    }
  };
  const auto finish = [&](int64_t s, const __m256i* si) {
    for (int h = 0; h < NH; ++h) {
      const int c = 8 * (h0 + h);
      const __m256 d = fp16x8_to_float(row.d(8 * s) + 2 * c), dmin = fp16x8_to_float(row.dmin(8 * s) + 2 * c);
      __m256i mn[4];
      for (int k = 0; k < 4; ++k)
        mn[k] = _mm256_or_si256(kq_values8<true>(row, 8 * s + 2 * k, c),
                                _mm256_slli_epi32(kq_values8<true>(row, 8 * s + 2 * k + 1, c), 16));
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
  };
  each_super_block<MR * NH>(ns, add_block, finish);
  for (int h = 0; h < NH; ++h) {
    __m256 part[MR];
    for (int r = 0; r < MR; ++r) part[r] = acc[NH * r + h];
    store_half<MR>(part, y, m0, N, g * G + 8 * (h0 + h));
  }
}

// Signed bytes as int32 lanes, each value in both of its int16 halves.
inline __m256i signed_bytes_in_pairs(const int8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(v, 16));
}
// Lane c: a[c] in the low int16, b[c] in the high one (signed).
inline __m256i signed_bytes_as_pair(const int8_t* a, const int8_t* b) {
  const __m256i lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m256i hi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(hi, 16));
}

// MR rows against NH halves of a Q6_K group (see Q6Row): 6-bit levels from the nibbles and the top bits, int16 sums
// over two j's, each sub-block's scaled by its int8 scale into the super-block's int32 sum, the levels' offset
// taken off as 32 x (scale x the half block's activation sum); d x dx once per super-block.
template <int MR, int NH, typename T>
void half_rows_q6(const Acts256& a, int64_t m0, int64_t K, const Q6Row& row, int64_t N, int64_t g, int h0, T* y,
                  bool first) {
  const int64_t ns = K / 256, nb = K / QK, block = G * Q6_K_BYTES / 8;
  const __m256i low = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  __m256 acc[MR * NH];
  for (int i = 0; i < MR * NH; ++i) acc[i] = _mm256_setzero_ps();
  const auto add_block = [&](int64_t b, __m256i* si) {
    if (first) prefetch(row.row, b, block);
    const int8_t* sc = row.scales(b);
    const uint8_t *nib = row.nibbles(b), *tp = row.tops(b);
    for (int h = 0; h < NH; ++h) {
      const int c = 8 * (h0 + h);
      const __m256i sc0 = signed_bytes_in_pairs(sc + c), sc1 = signed_bytes_in_pairs(sc + 16 + c);
      const __m256i t0 = load32(tp + 4 * c), t1 = load32(tp + 64 + 4 * c);
      for (int jj = 0; jj < 4; jj += 2) {  // two j's of int16 sums, then widened by their scales
        __m256i p0[MR], p1[MR];
        for (int r = 0; r < MR; ++r) p0[r] = p1[r] = _mm256_setzero_si256();
        for (int j = jj; j < jj + 2; ++j) {
          const __m256i raw = load32(nib + 64 * j + 4 * c);
          // Top bits 2 j, 2 j + 1 of each byte moved to bits 4, 5 (what a 16-bit shift moves across bytes is
          // masked).
          __m256i u0, u1;
          switch (j) {
            case 0: u0 = _mm256_slli_epi16(t0, 4); u1 = _mm256_slli_epi16(t1, 4); break;
            case 1: u0 = _mm256_slli_epi16(t0, 2); u1 = _mm256_slli_epi16(t1, 2); break;
            case 2: u0 = t0; u1 = t1; break;
            default: u0 = _mm256_srli_epi16(t0, 2); u1 = _mm256_srli_epi16(t1, 2); break;
          }
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, low), _mm256_and_si256(u0, top2));
          const __m256i hi =
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), low), _mm256_and_si256(u1, top2));
          for (int r = 0; r < MR; ++r) {
            const int8_t* xq = a.q.data() + (m0 + r) * K + 32 * b;
            p0[r] = add16(p0[r], _mm256_maddubs_epi16(lo, bcast4(xq + 4 * j)));
            p1[r] = add16(p1[r], _mm256_maddubs_epi16(hi, bcast4(xq + 16 + 4 * j)));
          }
        }
        for (int r = 0; r < MR; ++r) {
          __m256i& sum = si[NH * r + h];
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p0[r], sc0));
          sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p1[r], sc1));
        }
      }
      const __m256i scp = signed_bytes_as_pair(sc + c, sc + 16 + c);
      for (int r = 0; r < MR; ++r) {
        const __m256i offset = _mm256_madd_epi16(scp, _mm256_set1_epi32(a.hpair[(m0 + r) * nb + b]));
        si[NH * r + h] = _mm256_sub_epi32(si[NH * r + h], _mm256_slli_epi32(offset, 5));
      }
    }
  };
  const auto finish = [&](int64_t s, const __m256i* si) {
    for (int h = 0; h < NH; ++h) {
      const __m256 d = fp16x8_to_float(row.d(8 * s) + 2 * 8 * (h0 + h));
      for (int r = 0; r < MR; ++r) {
        const __m256 dx = _mm256_set1_ps(a.d[(m0 + r) * ns + s]);
        __m256& out = acc[NH * r + h];
        out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si[NH * r + h]), _mm256_mul_ps(d, dx), out);
      }
    }
  };
  each_super_block<MR * NH>(ns, add_block, finish);
  for (int h = 0; h < NH; ++h) {
    __m256 part[MR];
    for (int r = 0; r < MR; ++r) part[r] = acc[NH * r + h];
    store_half<MR>(part, y, m0, N, g * G + 8 * (h0 + h));
  }
}
