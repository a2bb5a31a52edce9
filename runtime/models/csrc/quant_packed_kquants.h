// The K-quants (Q4_K, Q5_K, Q6_K) in quant_packed.cpp's 16-channel groups: their layouts, how a channel unpacks,
// how ggml's super-blocks are repacked, and Q6_K's kernel (Q4_K and Q5_K run quant_packed.cpp's 4-bit and 5-bit
// kernels with computed scales). Included by quant_packed.cpp inside its namespace, after the helpers it uses
// (Acts, bcast4, prefetch, store_rows); not a stand-alone header.
#pragma once

// Q6_K in a group row: per super-block of 256 inputs (8 blocks of 32), 3,360 B = 16 x 210: the blocks' low
// nibbles as a 4-bit type's quants (8 x 256 B), then their top 2 bits (8 x 128 B: byte 4 c + p of the first 64
// holds, in bits 2 j and 2 j + 1, those of weight 4 j + p, the next 64 those of weight 16 + 4 j + p), then the
// blocks' int8 sub-block scales (8 x 32 B: the 16 channels' first 16 weights', then their last 16 weights'), then
// the 16 channels' fp16 d. Weight = d * scale * (q - 32), q = nibble | top << 4, as in ggml. A super-block is
// 52.5 cache lines, so every other one starts mid-line and its 64-byte loads straddle two lines (Q4_K's 2,368 B
// are 37 whole lines); pairing super-blocks would align them, not measured yet.
struct Q6Row {
  const uint8_t* row;
  explicit Q6Row(const uint8_t* r) : row(r) {}
  const uint8_t* base(int64_t b) const { return row + (b / 8) * G * Q6_K_BYTES; }
  const uint8_t* nibbles(int64_t b) const { return base(b) + (b % 8) * 256; }
  const uint8_t* tops(int64_t b) const { return base(b) + 2048 + (b % 8) * 128; }
  const int8_t* scales(int64_t b) const { return reinterpret_cast<const int8_t*>(base(b) + 3072 + (b % 8) * 32); }
  const uint8_t* d(int64_t b) const { return base(b) + 3328; }
};

// Q4_K in a group row: per super-block of 256 inputs (8 blocks of 32, each one of ggml's sub-blocks), 2,304 B =
// 16 x 144, ggml's own size: the blocks' quants as Q4_1's (8 x 256 B); per block, the 16 channels' 6-bit scales
// with the low 2 bits of their minimums on top (8 x 16 B: byte c = scale | (min & 3) << 6); per pair of blocks, the
// top 4 bits of the minimums (4 x 16 B: byte c = the first block's in bits 0-3, the second's in bits 4-7); then the
// 16 channels' fp16 d and dmin. Weight = d * scale * q - dmin * min, as in ggml: a Q4_1 block whose scale and
// offset are computed (exactly, in float32) instead of loaded. Byte c is channel c throughout, so a kernel widens 16
// (or 8) bytes to lanes and needs no shuffle; the scale is one AND away. (Scales and minimums as whole bytes made
// 148 B per 256 weights: 2.7% more bytes for each Q4_K product to stream.) Q5_K (FIVE): 2,816 B = 16 x 176, the
// blocks' fifth bits (8 x 64 B, laid out as Q5_0's, see quant_packed.cpp) right after their nibbles.
template <bool FIVE>
struct KRowT {
  static constexpr int64_t F = FIVE ? 512 : 0, BYTES = FIVE ? G * Q5_K_BYTES : G * Q4_K_BYTES;
  const uint8_t* row;
  explicit KRowT(const uint8_t* r) : row(r) {}
  const uint8_t* base(int64_t b) const { return row + (b / 8) * BYTES; }
  const uint8_t* quants(int64_t b) const { return base(b) + (b % 8) * 256; }
  const uint8_t* fifth(int64_t b) const { return base(b) + 2048 + (b % 8) * 64; }  // FIVE only
  const uint8_t* low(int64_t b) const { return base(b) + 2048 + F + (b % 8) * 16; }
  const uint8_t* high(int64_t b) const { return base(b) + 2176 + F + (b % 8) / 2 * 16; }  // the pair's byte
  static int high_shift(int64_t b) { return 4 * static_cast<int>(b % 2); }  // block b's nibble of it
  int scale(int64_t b, int c) const { return low(b)[c] & 63; }
  int min(int64_t b, int c) const { return (low(b)[c] >> 6) | ((high(b)[c] >> high_shift(b)) & 15) << 2; }
  const uint8_t* d(int64_t b) const { return base(b) + 2240 + F; }
  const uint8_t* dmin(int64_t b) const { return base(b) + 2272 + F; }
};
using Q4KRow = KRowT<false>;
using Q5KRow = KRowT<true>;

// The 32 weights of channel c in block b of a Q6_K group row, as float32.
void unpack_channel_q6(const Q6Row& row, int64_t b, int c, float* out) {
  const float d = fp16_to_float(load_u16(row.d(b) + 2 * c));
  const uint8_t *nib = row.nibbles(b), *top = row.tops(b);
  for (int k = 0; k < QK; ++k) {
    const int kk = k % 16, at = 64 * (kk / 4) + 4 * c + kk % 4;
    const int lo = k < 16 ? nib[at] & 15 : nib[at] >> 4;
    const int hi = (top[(k < 16 ? 0 : 64) + 4 * c + kk % 4] >> (2 * (kk / 4))) & 3;
    out[k] = d * static_cast<float>(row.scales(b)[16 * (k / 16) + c]) * static_cast<float>((lo | hi << 4) - 32);
  }
}

// The 32 weights of channel c in block b of a Q4_K (Q5_K) group row, as float32.
template <bool FIVE>
void unpack_channel_kq(const KRowT<FIVE>& row, int64_t b, int c, float* out) {
  const float scale = fp16_to_float(load_u16(row.d(b) + 2 * c)) * static_cast<float>(row.scale(b, c));
  const float offset = fp16_to_float(load_u16(row.dmin(b) + 2 * c)) * static_cast<float>(row.min(b, c));
  const uint8_t* q = row.quants(b);
  for (int k = 0; k < QK / 2; ++k) {
    const uint8_t v = q[64 * (k / 4) + 4 * c + k % 4];
    int lo = v & 15, hi = v >> 4;
    if constexpr (FIVE) {
      const int bits = row.fifth(b)[4 * c + k % 4] >> (2 * (k / 4));
      lo |= (bits & 1) << 4;
      hi |= (bits & 2) << 3;
    }
    out[k] = scale * lo - offset;
    out[k + QK / 2] = scale * hi - offset;
  }
}

// Four bytes at p, as one word (the packers move 4 bytes at a time: a packed run holds 4 consecutive weights of a
// channel; byte order is the memory's either way, so this is portable).
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store_u32(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }
constexpr uint32_t LOW4 = 0x0F0F0F0Fu, LOW2 = 0x03030303u;

// One channel's Q6_K super-block into a group row (see Q6Row). Four weights per word operation: nibbles and top
// bits are per byte, and every shift below stays within its byte once masked.
void fill_q6(uint8_t* group, int c, int64_t s, const uint8_t* blk) {
  const Q6Row row(group);
  const uint8_t *ql = blk, *qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  // ggml's order: per half of 128 weights, weight 32 t + l (t < 4, l < 32) has its nibble in ql[l + 32 (t & 1)]
  // (the high one for t >= 2) and its top bits at 2 t of qh[l]. q: the 6-bit levels in weight order.
  alignas(16) uint8_t q[256];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < 4; ++t)
      for (int l = 0; l < 32; l += 4) {
        const uint32_t b = load_u32(ql + 64 * h + l + 32 * (t & 1));
        const uint32_t nib = t >= 2 ? (b >> 4) & LOW4 : b & LOW4;
        const uint32_t top = (load_u32(qh + 32 * h + l) >> (2 * t)) & LOW2;
        store_u32(q + 128 * h + 32 * t + l, nib | (top << 4));
      }
  const uint8_t* base = row.base(s * 8);
  for (int bi = 0; bi < 8; ++bi) {
    uint8_t* nib = const_cast<uint8_t*>(base + bi * 256);
    uint8_t* tp = const_cast<uint8_t*>(base + 2048 + bi * 128);
    const uint8_t* qb = q + 32 * bi;
    uint32_t tops_lo = 0, tops_hi = 0;  // stored whole: the group's memory is not zeroed (packed_groups)
    for (int j = 0; j < 4; ++j) {  // weights 4 j .. 4 j + 3 and 16 + 4 j .. 16 + 4 j + 3
      const uint32_t x = load_u32(qb + 4 * j), y = load_u32(qb + 16 + 4 * j);
      store_u32(nib + 64 * j + 4 * c, (x & LOW4) | ((y & LOW4) << 4));
      tops_lo |= ((x >> 4) & LOW2) << (2 * j);
      tops_hi |= ((y >> 4) & LOW2) << (2 * j);
    }
    store_u32(tp + 4 * c, tops_lo);
    store_u32(tp + 64 + 4 * c, tops_hi);
    int8_t* scs = reinterpret_cast<int8_t*>(const_cast<uint8_t*>(base + 3072 + bi * 32));
    scs[c] = sc[2 * bi];
    scs[16 + c] = sc[2 * bi + 1];
  }
  std::memcpy(const_cast<uint8_t*>(base + 3328) + 2 * c, blk + 208, 2);
}

// One channel's Q4_K (FIVE: Q5_K) super-block into a group row (see KRowT), four weights per word operation.
// ggml's block_q5_K is block_q4_K's with qh[32] before the nibbles: bit j of qh[l] is the fifth bit of weight l of
// sub-block j.
template <bool FIVE>
void fill_kq(uint8_t* group, int c, int64_t s, const uint8_t* blk) {
  const KRowT<FIVE> row(group);
  const uint8_t *sc = blk + 4, *qh = blk + 16, *qs = blk + (FIVE ? 48 : 16);
  std::memcpy(const_cast<uint8_t*>(row.d(s * 8)) + 2 * c, blk, 2);
  std::memcpy(const_cast<uint8_t*>(row.dmin(s * 8)) + 2 * c, blk + 2, 2);
  for (int j = 0; j < 8; ++j) {
    const int64_t b = s * 8 + j;
    // ggml's get_scale_min_k4: 6-bit scale and minimum of sub-block j.
    const int scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
    const int min = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    const_cast<uint8_t*>(row.low(b))[c] = static_cast<uint8_t>(scale | (min & 3) << 6);
    // The pair's byte is written whole by its first block and completed by its second (the group's memory is not
    // zeroed: packed_groups).
    uint8_t* high = const_cast<uint8_t*>(row.high(b)) + c;
    const int top = (min >> 2) << KRowT<FIVE>::high_shift(b);
    *high = static_cast<uint8_t>(j % 2 ? *high | top : top);
    // Sub-block j's quants: the low (even j) or high (odd j) nibbles of the 32 bytes qs[32 (j / 2) ...]; packed
    // byte k holds weight k low and weight k + 16 high.
    const uint8_t* run = qs + 32 * (j / 2);
    uint8_t* q = const_cast<uint8_t*>(row.quants(b));
    const int shift = j % 2 ? 4 : 0;
    for (int w = 0; w < 4; ++w) {
      const uint32_t lo = (load_u32(run + 4 * w) >> shift) & LOW4, hi = (load_u32(run + 16 + 4 * w) >> shift) & LOW4;
      store_u32(q + 64 * w + 4 * c, lo | (hi << 4));
    }
    if constexpr (FIVE) {  // the fifth-bit plane: byte 4 c + p, bit 2 w of weight 4 w + p, bit 2 w + 1 of 16 + 4 w + p
      uint8_t* bits = const_cast<uint8_t*>(row.fifth(b)) + 4 * c;
      for (int p = 0; p < 4; ++p) {
        uint32_t v = 0;
        for (int w = 0; w < 4; ++w)
          v |= ((qh[4 * w + p] >> j) & 1u) << (2 * w) | ((qh[16 + 4 * w + p] >> j) & 1u) << (2 * w + 1);
        bits[p] = static_cast<uint8_t>(v);
      }
    }
  }
}

#ifdef RS_PACKED_512
inline __m512 int8x16_to_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The Q6_K version of group_rows. Per block: the 8 registers of 6-bit levels are built from the nibbles and the
// top bits (shared by the MR rows); each row keeps one integer sum per sub-block of 16, takes 32 x its rounded
// activations' sum off each (the levels' offset, exactly), and scales them by d * scale (exact in float32).
template <int MR, typename T>
void group_rows_q6(const Acts& a, int64_t m0, int64_t K, const Q6Row& row, int64_t N, int64_t g, T* y, bool first) {
  const int64_t nb = K / QK, block = G * Q6_K_BYTES / 8;
  const __m512i low = _mm512_set1_epi8(15), top2 = _mm512_set1_epi8(0x30);
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  __m512 d = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    if (first) prefetch(row.row, b, block);
    if (b % 8 == 0) d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row.d(b))));
    const int8_t* sc = row.scales(b);
    const __m512 sc0 = _mm512_mul_ps(d, int8x16_to_float(sc)), sc1 = _mm512_mul_ps(d, int8x16_to_float(sc + 16));
    const uint8_t *nib = row.nibbles(b), *tp = row.tops(b);
    const __m512i h0 = _mm512_loadu_si512(tp), h1 = _mm512_loadu_si512(tp + 64);
    __m512i s0[MR], s1[MR];
    for (int r = 0; r < MR; ++r) s0[r] = s1[r] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_loadu_si512(nib + 64 * j);
      // Top bits 2 j, 2 j + 1 of each byte moved to bits 4, 5 (16-bit shifts: what crosses bytes is masked off).
      __m512i t0, t1;
      switch (j) {
        case 0: t0 = _mm512_slli_epi16(h0, 4); t1 = _mm512_slli_epi16(h1, 4); break;
        case 1: t0 = _mm512_slli_epi16(h0, 2); t1 = _mm512_slli_epi16(h1, 2); break;
        case 2: t0 = h0; t1 = h1; break;
        default: t0 = _mm512_srli_epi16(h0, 2); t1 = _mm512_srli_epi16(h1, 2); break;
      }
      // (nibble & 15) | (top & 0x30): 0xEA is (A & B) | C.
      const __m512i lo = _mm512_ternarylogic_epi32(raw, low, _mm512_and_si512(t0, top2), 0xEA);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4), low, _mm512_and_si512(t1, top2), 0xEA);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xq = a.q.data() + ((m0 + r) * nb + b) * QK;
        s0[r] = _mm512_dpbusd_epi32(s0[r], lo, bcast4(xq + 4 * j));
        s1[r] = _mm512_dpbusd_epi32(s1[r], hi, bcast4(xq + 16 + 4 * j));
      }
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const __m512i c0 = _mm512_sub_epi32(s0[r], _mm512_set1_epi32(32 * a.half[i]));
      const __m512i c1 = _mm512_sub_epi32(s1[r], _mm512_set1_epi32(32 * (a.qsum[i] - a.half[i])));
      const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), sc1, _mm512_mul_ps(_mm512_cvtepi32_ps(c0), sc0));
      acc[r] = _mm512_fmadd_ps(t, _mm512_set1_ps(a.d[i]), acc[r]);
    }
  }
  store_rows<MR>(acc, y, m0, N, g);
}

#endif
