// Block-quantized linear layers with 16 output channels interleaved, for AVX-512 VNNI (the kernel in
// quant_packed_512.h; packing in quant_packed_pack.h), and for AVX2 in
// quant_packed_avx2.h (llama.cpp's repacking idea).
//
// quant_linear.cpp reads a weight row by row: per block of 32 weights it unpacks one channel, multiplies it with the
// activations in 256-bit lanes and sums the lanes, so half its instructions are bookkeeping and a decode step is
// bound by them, not by the bytes read. Here the blocks are repacked once, at load, so that one 512-bit register
// holds 4 consecutive weights of each of 16 channels: one `vpdpbusd` with 4 activation bytes broadcast then feeds
// 16 channels at once, the 16 scales load as one vector, and no horizontal sum is needed (lane c is channel c).
//
// Layout: channels in groups of 16 (the last group padded with zero blocks); a group is one row of exactly the
// bytes of its 16 x K / 32 blocks: per block of 32 inputs, 256 B of quants (4-bit) or 512 B (8-bit), 16 fp16
// scales d and Q4_1's 16 fp16 offsets m, arranged as `Row` says so that loads do not straddle cache lines (and
// the weights stream through memory in one pass: a layout with all scales after all quants was slower). 4-bit
// quants of block b: byte 64 j + 4 c + p (j < 4, c < 16, p < 4) holds q[c][4 j + p] in its low nibble and
// q[c][16 + 4 j + p] in its high one. 8-bit: byte 64 j + 4 c + p (j < 8) is q[c][4 j + p] + 128 (unsigned, as
// vpdpbusd wants its first operand), or in an AVX2 build q[c][4 j + p] itself (Q8_STORED_OFFSET). 5-bit (Q5_0,
// Q5_1): the 4-bit layout of the levels' low 4 bits, then 64 B of fifth bits: byte 256 + 4 c + p holds at bit 2 j
// that of q[c][4 j + p] and at bit 2 j + 1 that of q[c][16 + 4 j + p], so that each 64-byte run of nibbles takes
// its fifth bits from one register by a shift.
// Q4_K, Q5_K and Q6_K keep ggml's 256-weight super-blocks: quant_packed_kquants.h.
//
// The arithmetic is quant_linear.cpp's (activations rounded to int8 per block, integer dot products, one scale
// per block): the levels' offsets (Q4_0's 8, Q5_0's 16, Q8_0's 128) are taken off the integer sum exactly (offset
// times the sum of the block's rounded activations), so their results are exact integers times dw * dx; Q4_1 adds
// m * dx * sum(qx). A row's result is the same whatever the other rows of its batch (same operations, same order).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include "../../csrc/balanced.h"
#include "../../csrc/simd.h"
#include "huge_slabs.h"

// RS_PACKED: this build has a packed kernel, RS_PACKED_512 (AVX-512 VNNI) or RS_PACKED_AVX2.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define RS_PACKED 1
#define RS_PACKED_512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_PACKED 1
#define RS_PACKED_AVX2 1
#endif

namespace radixserve_quant_packed {
namespace {

// Q8_0's levels as a packed row stores them: w + 128 for AVX-512's vpdpbusd (unsigned first operand); AVX2's
// kernel takes |w| and w's sign, so it stores w as it is and needs no flip back per load (one vector op fewer per
// 4 weights x 8 channels, shared by a pass's rows).
#ifdef RS_PACKED_AVX2
constexpr int Q8_STORED_OFFSET = 0;
#else
constexpr int Q8_STORED_OFFSET = 128;
#endif
inline int q8_level(uint8_t stored) {
  return Q8_STORED_OFFSET ? static_cast<int>(stored) - 128 : static_cast<int>(static_cast<int8_t>(stored));
}

using radixserve_quant_linear::fp16_to_float;
using radixserve_quant_linear::load_u16;

constexpr int64_t QK = 32, G = 16;
// How far ahead of its loads the kernel prefetches: all 65 linear layers of the 1B Llama (Q4_K_M, one row, 2-core
// AMD EPYC) took 26.2-26.4 ms a pass at 4-16 KB, 27.1 at 8 blocks (2.4 KB of Q4_K), 28.9 at 32 KB, 32.7 at none.
constexpr int64_t PREFETCH_BYTES = 12 << 10;
// Tiles of many-row products (see linear): a quarter of this core's L2 of weights by as many rows as make another
// quarter of int8 activations, so that both stay in L2 while reused. On Zen 4 (1 MB L2: 256 KB each), of the sizes
// tried (64-512 KB of weights, 48-1,024 rows) these were best or level with the best on 2048 x 16384 and 8192 x
// 2048 at 64 and 1,024 rows; a fixed 120 rows ran 8192 x 2048 20% slower (960 KB of activations). On Zen 3 (512
// KB) the same 256 KB each ran Q4_K 8192 x 2048 at 1,024 rows 15% slower than 128 KB each (one thread). Larger
// L2s keep the 256 KB that was measured (larger tiles were not).
int64_t tile_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return std::clamp<int64_t>(l2 > 0 ? l2 / 4 : 256 << 10, 64 << 10, 256 << 10);
  }();
  return bytes;
}
// Rows a kernel call keeps in registers: AVX-512's 32 registers hold 8 rows' sums; AVX2's 16 hold 4 to 6 of one
// half (group_all there picks per type: 6, Q6_K 4). Tiles are a multiple of MAX_MR rows: on AVX2 a
// multiple of 4 left a 4-row pass in every 16-row tile of a K = 8192 product (Q4_K at 1,024 rows, one thread:
// 107-108 GFLOP/s with multiples of 4, 114-118 with multiples of 6, means of 3 alternating runs).
#ifdef RS_PACKED_512
constexpr int MAX_MR = 8;
#else
constexpr int MAX_MR = 6;
#endif
constexpr int64_t Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q4_K = 12, Q5_K = 13, Q6_K = 14;
// ggml's block_q4_K, block_q5_K and block_q6_K: 256 weights each, and as many bytes in a packed group row.
constexpr int64_t Q4_K_BYTES = 144, Q5_K_BYTES = 176, Q6_K_BYTES = 210;
constexpr bool is_kq(int64_t type) { return type == Q4_K || type == Q5_K; }  // scales and minimums per 32

// Bytes of one channel's block of 32 weights, as ggml stores it (Q5_0: d, 4 bytes of fifth bits, 16 of nibbles;
// Q5_1: d, m, then the same).
int64_t block_bytes(int64_t type) {
  if (type == Q5_0) return 22;
  if (type == Q5_1) return 24;
  return radixserve_quant_linear::block_bytes(type);
}
constexpr bool is_q5(int64_t type) { return type == Q5_0 || type == Q5_1; }
constexpr bool has_fifth_bits(int64_t type) { return is_q5(type) || type == Q5_K; }  // 5-bit levels
constexpr bool has_offsets(int64_t type) { return type == Q4_1 || type == Q5_1; }  // weight = d q + m

// Bytes of one channel's weights per block of 32 inputs... as a group row holds them: 16 channels' worth.
int64_t group_block_bytes(int64_t type) {
  if (type == Q6_K) return G * Q6_K_BYTES / 8;
  if (type == Q4_K) return G * Q4_K_BYTES / 8;
  if (type == Q5_K) return G * Q5_K_BYTES / 8;
  return G * block_bytes(type);
}
int64_t weight_block(int64_t type) { return type == Q6_K || is_kq(type) ? 256 : QK; }  // K is a multiple of it

int64_t header_bytes(int64_t type) { return has_offsets(type) ? 4 : 2; }
int64_t quant_bytes(int64_t type) { return G * (block_bytes(type) - header_bytes(type)); }  // per block of 32 inputs

// Where block b's quants, scales and (Q4_1, Q5_1) offsets are in a group's row of nb blocks. Blocks go in runs of
// P (the last run may be shorter): the run's quants, then its scales, then its offsets, P chosen so that a run is
// whole cache lines (Q4_1: 320 B, Q5_1: 384 B; Q8_0, Q4_0 and Q5_0 in pairs: 1,088, 576 and 704 B) and every quant
// load is one line. PP: blocks per run when the kernel's type fixes it (1 with offsets, 2 without), so that the
// inner loops find a block in a few adds (a division per block cost them an idiv each); 0: known at run time
// (packing).
template <int64_t PP>
struct RowT {
  const uint8_t* row;
  int64_t nb, qb, bs, p;
  RowT(const uint8_t* r, int64_t type, int64_t n)
      : row(r), nb(n), qb(quant_bytes(type)), bs(G * block_bytes(type)), p(has_offsets(type) ? 1 : 2) {}
  int64_t P() const { return PP ? PP : p; }
  int64_t run_start(int64_t b) const { return (b >> (P() - 1)) << (P() - 1); }  // P is 1 or 2
  const uint8_t* run(int64_t b) const { return row + run_start(b) * bs; }
  int64_t in_run(int64_t b) const {
    if constexpr (PP == 1) return 1;
    return std::min(P(), nb - run_start(b));
  }
  const uint8_t* quants(int64_t b) const { return run(b) + (b & (P() - 1)) * qb; }
  const uint8_t* fifth(int64_t b) const { return quants(b) + 256; }  // the 5-bit types'
  const uint8_t* scales(int64_t b) const { return run(b) + in_run(b) * qb + (b & (P() - 1)) * 2 * G; }
  const uint8_t* offsets(int64_t b) const { return run(b) + in_run(b) * (qb + 2 * G) + (b & (P() - 1)) * 2 * G; }
};
using Row = RowT<0>;

// The activations, rounded per block of 32 as the row kernel rounds them (quant_linear.cpp).
using Acts = radixserve_quant_linear::QuantRows;
using radixserve_quant_linear::quantize_rows;

// The 32 weights of channel c in block b of a group's row, as float32 (dequantize, rows).
void unpack_channel(const Row& row, int64_t b, int64_t type, int c, float* out) {
  const float d = fp16_to_float(load_u16(row.scales(b) + 2 * c));
  const uint8_t* q = row.quants(b);
  if (type == Q8_0) {
    for (int k = 0; k < QK; ++k) out[k] = d * static_cast<float>(q8_level(q[64 * (k / 4) + 4 * c + k % 4]));
    return;
  }
  const float m = has_offsets(type) ? fp16_to_float(load_u16(row.offsets(b) + 2 * c))
                                     : (type == Q5_0 ? -16.0f : -8.0f) * d;
  for (int k = 0; k < QK / 2; ++k) {
    const uint8_t b = q[64 * (k / 4) + 4 * c + k % 4];
    int lo = b & 15, hi = b >> 4;
    if (is_q5(type)) {  // the fifth bits (see the layout above)
      const int bits = q[256 + 4 * c + k % 4] >> (2 * (k / 4));
      lo |= (bits & 1) << 4;
      hi |= (bits & 2) << 3;
    }
    out[k] = d * lo + m;
    out[k + QK / 2] = d * hi + m;
  }
}

#ifdef RS_PACKED
// Block b's bytes PREFETCH_BYTES ahead in a group row of `block`-byte blocks (the next group's first ones past the
// row's end: a thread's groups are consecutive in memory). Without this the loads wait on memory: the hardware
// prefetcher falls behind. Only the first rows of a tile read the weights from memory; later rows find them in
// cache, so only they prefetch.
inline void prefetch(const uint8_t* row, int64_t b, int64_t block) {
  const char* ahead = reinterpret_cast<const char*>(row) + b * block + PREFETCH_BYTES;
  for (int64_t off = 0; off < block; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
}
#endif

#ifdef RS_PACKED_512
// Bit FROM of every byte of v at bit 4, the others cleared: a 16-bit lane shift by at most 4 left or 3 right
// moves no other byte's bit to bit 4 (the 5-bit types' fifth bits, see the layout).
template <int FROM>
inline __m512i bit_to_4(__m512i v) {
  const __m512i m = _mm512_set1_epi8(0x10);
  if constexpr (FROM < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - FROM), m);
  if constexpr (FROM > 4) return _mm512_and_si512(_mm512_srli_epi16(v, FROM - 4), m);
  return _mm512_and_si512(v, m);
}

inline __m512 fp16x16_to_float(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// MR rows' 16 outputs of group g (the first N - 16 g of them in the last group).
template <int MR, typename T>
inline void store_rows(const __m512* acc, T* y, int64_t m0, int64_t N, int64_t g) {
  const int64_t valid = std::min<int64_t>(G, N - g * G);
  for (int r = 0; r < MR; ++r) {
    if (valid == G) {
      radixserve_simd::store16(y + (m0 + r) * N + g * G, acc[r]);
    } else {
      radixserve_simd::store_n(y + (m0 + r) * N + g * G, acc[r], static_cast<int>(valid));
    }
  }
}

#endif

#include "quant_packed_kquants.h"

// Channel c of a group row, all K = 32 nb inputs, as float32.
void unpack_row(const uint8_t* group, int64_t type, int64_t nb, int c, float* out) {
  if (type == Q6_K) {
    const Q6Row row(group);
    for (int64_t b = 0; b < nb; ++b) unpack_channel_q6(row, b, c, out + b * QK);
    return;
  }
  if (type == Q4_K) {
    const Q4KRow row(group);
    for (int64_t b = 0; b < nb; ++b) unpack_channel_kq(row, b, c, out + b * QK);
    return;
  }
  if (type == Q5_K) {
    const Q5KRow row(group);
    for (int64_t b = 0; b < nb; ++b) unpack_channel_kq(row, b, c, out + b * QK);
    return;
  }
  const Row row(group, type, nb);
  for (int64_t b = 0; b < nb; ++b) unpack_channel(row, b, type, c, out + b * QK);
}

#ifdef RS_PACKED_AVX2
#include "quant_packed_avx2.h"
#include "quant_packed_avx2_q8k.h"
#endif

#include "quant_packed_512.h"

void check(const torch::Tensor& w, int64_t type, int64_t K, int64_t N) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_packed: weight groups");
  TORCH_CHECK(K % weight_block(type) == 0 && w.size(1) == K / QK * group_block_bytes(type),
              "quant_packed: K and row bytes disagree");
  TORCH_CHECK(N > (w.size(0) - 1) * G && N <= w.size(0) * G, "quant_packed: N does not fit the channel groups");
}

}  // namespace

// The block of inputs the activations are rounded over for this type: 256 for the K-quants on AVX2
// (quant_packed_avx2_q8k.h), else 32 (reference_linear's act_block).
int64_t activation_block(int64_t type) {
#ifdef RS_PACKED_AVX2
  if (is_kq(type) || type == Q6_K) return 256;
#endif
  return QK;
}

bool supported() {
#ifdef RS_PACKED
  return true;
#else
  return false;
#endif
}

#include "quant_packed_pack.h"

// fn(t) for every t in [0, tiles) on the intra-op threads: each thread streams its own contiguous share of the
// weights in order and then takes tiles left in the others' shares (balanced.h: a thread the OS preempts does not
// hold up the product). Every tile runs once, on one thread, so results do not depend on who took what.
template <typename F>
void for_tiles(int64_t tiles, const F& fn) {
  radixserve_balanced::balanced_for(tiles, 1, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

#ifdef RS_PACKED
template <typename T>
void linear_impl(const T* xp, int64_t M, int64_t K, const torch::Tensor& w, int64_t type, int64_t N, T* yp) {
  const int64_t nb = K / QK;
  Acts a;
#ifdef RS_PACKED_AVX2
  Acts256 a256;  // the K-quants' activations (quant_packed_avx2_q8k.h)
  if (is_kq(type) || type == Q6_K) {
    quantize_rows_256(xp, M, K, a256);
  } else {
    quantize_rows(xp, M, K, a);
  }
  const Acts256& kq_acts = a256;
#else
  quantize_rows(xp, M, K, a);
  const Acts& kq_acts = a;
#endif
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int64_t stride = w.size(1);
  // Channel groups are independent: the work is tiles of groups x rows, so that a tile's weights and its rows'
  // activations stay in L2 while each is reused (a prefill chunk's x does not fit: without tiles every group
  // streamed all of it from L3 again, and 1,024 rows ran at 0.7x the rate of 64).
  const int64_t tile_groups = std::max<int64_t>(1, tile_bytes() / stride);
  const int64_t tile_rows = std::max<int64_t>(1, tile_bytes() / K / MAX_MR) * MAX_MR;
  const int64_t groups = w.size(0);
  for_tiles((groups + tile_groups - 1) / tile_groups, [&](int64_t t) {
    const int64_t gt = t * tile_groups, g1 = std::min(groups, gt + tile_groups);
    for (int64_t m0 = 0; m0 < M; m0 += tile_rows) {
      const int64_t m1 = std::min(M, m0 + tile_rows);
      for (int64_t g = gt; g < g1; ++g) {
        if (type == Q6_K) {
          group_all<Q6_K>(kq_acts, m0, m1, K, Q6Row(wp + g * stride), N, g, yp);
          continue;
        }
        if (type == Q4_K) {
          group_all<Q4_K>(kq_acts, m0, m1, K, Q4KRow(wp + g * stride), N, g, yp);
          continue;
        }
        if (type == Q5_K) {
          group_all<Q5_K>(kq_acts, m0, m1, K, Q5KRow(wp + g * stride), N, g, yp);
          continue;
        }
        const uint8_t* group = wp + g * stride;
        switch (type) {
          case Q8_0: group_all<Q8_0>(a, m0, m1, K, RowT<2>(group, type, nb), N, g, yp); break;
          case Q4_0: group_all<Q4_0>(a, m0, m1, K, RowT<2>(group, type, nb), N, g, yp); break;
          case Q5_0: group_all<Q5_0>(a, m0, m1, K, RowT<2>(group, type, nb), N, g, yp); break;
          case Q5_1: group_all<Q5_1>(a, m0, m1, K, RowT<1>(group, type, nb), N, g, yp); break;
          default: group_all<Q4_1>(a, m0, m1, K, RowT<1>(group, type, nb), N, g, yp); break;
        }
      }
    }
  });
}
#endif

// x [M, K] (float32 or bfloat16) @ dequant(w)^T, in x's dtype (bfloat16: the float32 sums rounded once).
torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t K, int64_t N) {
  check(w, type, K, N);
  const bool bf = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && (bf || x.scalar_type() == torch::kFloat32),
              "quant_packed: x [M, K] float32 or bfloat16");
#ifndef RS_PACKED
  TORCH_CHECK(false, "quant_packed: this build has neither AVX-512 VNNI nor AVX2");
#else
  x = x.contiguous();
  auto y = torch::empty({x.size(0), N}, x.options());
  if (bf) {
    linear_impl(x.data_ptr<c10::BFloat16>(), x.size(0), K, w, type, N, y.data_ptr<c10::BFloat16>());
  } else {
    linear_impl(x.data_ptr<float>(), x.size(0), K, w, type, N, y.data_ptr<float>());
  }
  return y;
#endif
}

// The float32 [N, K] matrix (N <= 16 * groups: a slice of groups gives its channels).
torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K, int64_t N) {
  check(w, type, K, N);
  const int64_t nb = K / QK, stride = w.size(1);
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) unpack_row(wp + (n / G) * stride, type, nb, n % G, op + n * K);
  });
  return out;
}

torch::Tensor rows(torch::Tensor w, torch::Tensor ids, int64_t type, int64_t K, int64_t N) {
  check(w, type, K, N);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "quant_packed: ids [T] int64");
  ids = ids.contiguous();
  const int64_t T = ids.size(0), nb = K / QK, stride = w.size(1);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_packed: row id out of range");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) unpack_row(wp + (ip[t] / G) * stride, type, nb, ip[t] % G, op + t * K);
  });
  return out;
}

}  // namespace radixserve_quant_packed

void register_quant_packed(pybind11::module_& parent) {
  namespace qp = radixserve_quant_packed;
  auto m = parent.def_submodule("quant_packed");
  m.def("activation_block", &qp::activation_block, "inputs per activation scale for a block type");
  m.def("supported", &qp::supported, "whether this build has the packed kernel (AVX-512 VNNI or AVX2)");
  m.def("pack", &qp::pack, "blocks -> 16-channel groups", py::call_guard<py::gil_scoped_release>());
  m.def("pack_parts", &qp::pack_parts, "row-concatenated blocks -> 16-channel groups",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &qp::linear, "x @ dequant(w)^T for 16-channel groups", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &qp::dequantize, "float32 matrix of 16-channel groups", py::call_guard<py::gil_scoped_release>());
  m.def("rows", &qp::rows, "float32 rows ids of 16-channel groups", py::call_guard<py::gil_scoped_release>());
}
