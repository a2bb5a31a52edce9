// Prefill ("extend") attention straight from the KV pool, in bfloat16 on CPUs with AVX-512 BF16.
//
// Every prefill chunk of a step attends causally to its sequence's keys: a cached prefix (at any slots of the pool)
// followed by the chunk's own tokens, which the backend has written into the pool before attention runs. The
// PyTorch path gathers a cached prefix's K/V into a copy and runs SDPA with a mask, one sequence at a time; in
// bfloat16 on a CPU without AMX, SDPA's flash kernel widens to float32 and multiplies with sgemm (~25 GFLOP/s on
// the 2-core Zen 4). Here the products are vdpbf16ps (two bfloat16 products summed into a float32 lane).
//
// Two phases in one call, each split over the cores:
//   1. pack: each (sequence, KV head)'s keys, read in place from their slots, into tiles of 16 keys where one
//      512-bit register holds one pair of dimensions of 16 keys (``Kt``), and its values into registers that hold
//      16 dimensions of two consecutive keys (``Vt``), the operand layouts vdpbf16ps needs. Padding is zero.
//   2. attend: per (sequence, KV head, block of QB query positions, slice of at most 8 of the KV head's G query
//      heads), the block's query rows (the query heads of a KV head share its keys) run flash attention over
//      blocks of KB keys: scores in float32, an online softmax (running max and sum per row; e^x as 2^x with the
//      scale folded in, the rows' rescale factors 16 at a time), probabilities rounded to bfloat16 for the product
//      with the values (as SDPA's reduced-precision path does), float32 accumulators. Key blocks wholly after a
//      block's last query, or wholly before its first query's window, are skipped, and so are the tiles of 16 keys
//      of the last block that lie after it: SmolLM2's heads, one 600-token prompt, 2 cores of the Zen 4: 257 ->
//      ~330 GFLOP/s over the kernel before these three (``bench/extend_attention.py``).
// ``extend_attention_tiles`` runs the same two phases with the scores and the weighted values on AMX tiles
// (``tile_scores``, ``tile_values``; csrc/amx_tiles.h, or its emulation in tests): Kt and Vt are already the tiles'
// B operands. The softmax between them is the same code.
//
// Layouts (contiguous): q [T, H, D] bfloat16 (query head i uses KV head i / (H / Hkv)); kv [2, Hkv, N, D]
// bfloat16 (one layer of the pool); slots int64, every sequence's kv_len slots one after another; seqs [B, 4]
// int64 rows of (q_start, q_len, kv_len, slot_offset): the query at offset i of a chunk sits at position
// kv_len - q_len + i and sees keys [max(0, pos - window + 1), pos] (window 0: no window). Returns out [T, H, D]
// bfloat16; rows of q outside every chunk are left as they were in ``out`` (uninitialized: callers cover them).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "../../csrc/amx_tiles.h"
#include "../../csrc/balanced.h"
#include "flash_blocks.h"
#include "../../csrc/simd.h"

namespace radixserve_extend_attention {
namespace {

constexpr int64_t QB = 16;  // query positions per task
constexpr int64_t MAX_GS = 8;  // query heads of one KV head per task (more: several tasks)
using radixserve_flash::KB;  // keys per block of the online softmax (4 tiles of 16)

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kFast = true;

using bf16 = c10::BFloat16;
using radixserve_flash::exp2v;
using radixserve_flash::pack_block;

struct Seq {
  int64_t q_start, q_len, kv_len, slot_off, pack_off;  // pack_off: this sequence's first packed key (KB-aligned)
};

// The products on AMX tiles instead (``extend_attention_tiles``), T: radixserve_amx::Amx or ::Emulated. Kt and Vt
// are already the B operands of TDPBF16PS: a tile of 16 keys' D/2 pairs is D/32 B tiles of 16 pairs (1 KB each,
// contiguous), and 16 consecutive pairs of keys of Vt, for 16 dimensions, one B tile at a stride of D * 4 bytes. Rows
// go 16 at a time (a task's rows rounded up to 16: one tile configuration), queries from `qa` (rows of D), weights
// from `pb` (rows of KB) as A tiles, scores and the output accumulators as C tiles 0-3.
struct Vector {};  // the vdpbf16ps products (flash_blocks.h)

template <class T, int DP>
void tile_scores(const uint16_t* qa, int64_t Rp, const uint32_t* kt, int nt, float* s) {
  constexpr int D = 2 * DP;
  for (int64_t r0 = 0; r0 < Rp; r0 += 16) {
    for (int t = 0; t < nt; ++t) T::zero(t);
    for (int k = 0; k < D / 32; ++k) {
      const int a = 4 + k % 2;
      T::load(a, qa + r0 * D + 32 * k, 2 * D);
      for (int t = 0; t < nt; ++t) {
        const int b = 6 + t % 2;
        T::load(b, kt + (t * DP + 16 * k) * 16, 64);
        T::dot(t, a, b);
      }
    }
    for (int t = 0; t < nt; ++t) T::store(t, s + r0 * KB + 16 * t, KB * 4);
  }
}

// o[r] = o[r] * alpha[r] + P[r] . V over the block's first nt tiles of keys, rounded up to pairs of tiles (32 keys):
// the keys of a half-used pair lie after every row's position, masked to weight 0.
template <class T, int ND>
void tile_values(const uint16_t* pb, const float* alpha, int64_t Rp, const uint32_t* vt, int nt, float* o) {
  constexpr int D = ND * 16;
  for (int64_t r = 0; r < Rp; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    float* row = o + r * D;
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(row + 16 * c), a));
  }
  const int pairs = (nt + 1) / 2;
  for (int64_t r0 = 0; r0 < Rp; r0 += 16)
    for (int c0 = 0; c0 < ND; c0 += 4) {
      const int nc = std::min(4, ND - c0);
      for (int j = 0; j < nc; ++j) T::load(j, o + r0 * D + 16 * (c0 + j), D * 4);
      for (int kp = 0; kp < pairs; ++kp) {
        const int a = 4 + kp % 2;
        T::load(a, pb + r0 * KB + 32 * kp, KB * 2);
        for (int j = 0; j < nc; ++j) {
          const int b = 6 + j % 2;
          T::load(b, vt + (16 * kp * ND + c0 + j) * 16, ND * 64);
          T::dot(j, a, b);
        }
      }
      for (int j = 0; j < nc; ++j) T::store(j, o + r0 * D + 16 * (c0 + j), D * 4);
    }
}

// Phase 2 for one task: rows r = i * GS + g (query position i of the block, head g0 + g of the KV head's group);
// P: Vector, or a tile type for the products on tiles.
template <int ND, class P>
void attend_block(const uint16_t* q, int64_t H, int64_t G, int64_t h, int64_t g0, int64_t GS, const Seq& sq,
                  int64_t i0, int64_t window, float scale, const uint32_t* kt, const uint32_t* vt, uint16_t* out) {
  constexpr int D = ND * 16, DP = D / 2;
  constexpr int MRS = 4;            // score rows per register block: 16 accumulators + 4 key registers
  constexpr int RMAX = QB * MAX_GS;
  const int64_t n_pos = std::min(QB, sq.q_len - i0);
  const int64_t R = n_pos * GS;
  constexpr bool TILES = !std::is_same_v<P, Vector>;
  // A multiple of MRS and of values_rows' 16 / ND rows (or of 16).
  const int64_t Rp = TILES ? (R + 15) / 16 * 16 : (R + 3) / 4 * 4;
  alignas(64) static thread_local float s[RMAX * KB];
  alignas(64) static thread_local uint16_t pb[RMAX * KB];
  alignas(64) static thread_local float o[RMAX * D];
  alignas(64) static thread_local uint32_t zero_q[D / 2];
  // Per row: the running max of its scores, the per-lane partial sums of its weights (one horizontal sum per row at
  // the end, not one per key block), the current block's max, rescale factor and max times log2_scale. The
  // per-row vectors are handled 16 rows at a time, so rows up to RMAX (a multiple of 16) all hold a value.
  alignas(64) float m_run[RMAX], l_run[RMAX * 16], rowmax[RMAX], alpha[RMAX], mc[RMAX];
  std::fill(m_run, m_run + RMAX, -std::numeric_limits<float>::infinity());
  std::fill(rowmax, rowmax + RMAX, -std::numeric_limits<float>::infinity());
  int64_t pos[RMAX];
  const uint32_t* qrows[RMAX];
  const int64_t first_pos = sq.kv_len - sq.q_len;
  for (int64_t r = 0; r < Rp; ++r) {
    if (r < R) {
      const int64_t i = i0 + r / GS, g = g0 + r % GS;
      qrows[r] = reinterpret_cast<const uint32_t*>(q + ((sq.q_start + i) * H + h * G + g) * D);
      pos[r] = first_pos + i;
    } else {
      qrows[r] = zero_q;
      pos[r] = first_pos + i0;
    }
    std::fill(l_run + r * 16, l_run + r * 16 + 16, 0.0f);
    std::memset(o + r * D, 0, D * sizeof(float));
  }
  alignas(64) static thread_local uint16_t qa[TILES ? RMAX * D : 1];  // the rows' queries, one after another
  if constexpr (TILES) {
    for (int64_t r = 0; r < Rp; ++r) std::memcpy(qa + r * D, qrows[r], D * sizeof(uint16_t));
    radixserve_amx::Shape shape{};
    for (int t = 0; t < 8; ++t) shape.rows[t] = 16, shape.colsb[t] = 64;
    P::configure(shape);
  }
  const int64_t last = first_pos + i0 + n_pos - 1;  // the block's last query position
  const int64_t kb_end = last / KB + 1;
  const int64_t kb_begin = window > 0 ? std::max<int64_t>(0, first_pos + i0 - window + 1) / KB : 0;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // Scores stay unscaled: scale > 0 commutes with the max, and e^(scale (s - m)) = 2^(c s - c m) with
  // c = scale log2 e, one fused multiply-subtract per 16 scores.
  const __m512 cv = _mm512_set1_ps(scale * 1.4426950408889634f);
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const uint32_t* ktb = kt + kb * KB * DP;
    const uint32_t* vtb = vt + kb * KB * D / 2;
    // Tiles of 16 keys wholly after the block's last query are neither scored nor summed (the mask drops them).
    const int nt = static_cast<int>(std::min<int64_t>(4, (last - kb * KB) / 16 + 1));
    if constexpr (TILES) {
      tile_scores<P, DP>(qa, Rp, ktb, nt, s);
    } else {
      radixserve_flash::scores_rows<DP, MRS>(qrows, Rp, ktb, nt, s);
    }
    // A block needs a mask where some key of it lies after a row's position or before its window.
    const bool full = (kb + 1) * KB - 1 <= first_pos + i0 && (window == 0 || kb * KB > last - window);
    for (int64_t r = 0; r < Rp; ++r) {
      float* sr = s + r * KB;
      __m512 v[4];
      for (int t = 0; t < 4; ++t) v[t] = _mm512_loadu_ps(sr + t * 16);
      if (!full) {
        for (int t = 0; t < 4; ++t) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kb * KB + t * 16)));
          __mmask16 ok = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos[r])));
          if (window > 0)
            ok &= _mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(pos[r] - window)));
          v[t] = _mm512_mask_mov_ps(neg_inf, ok, v[t]);
          _mm512_storeu_ps(sr + t * 16, v[t]);
        }
      }
      rowmax[r] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]), _mm512_max_ps(v[2], v[3])));
    }
    // The running maxima and their rescale factors, 16 rows at a time (rows from Rp on stay -inf: alpha 1).
    for (int64_t r = 0; r < Rp; r += 16) {
      const __m512 old = _mm512_loadu_ps(m_run + r);
      const __m512 mn = _mm512_max_ps(old, _mm512_loadu_ps(rowmax + r));
      const __mmask16 none = _mm512_cmp_ps_mask(mn, neg_inf, _CMP_EQ_OQ);  // nothing visible yet: alpha 1
      const __m512 a = exp2v(_mm512_mul_ps(_mm512_sub_ps(old, mn), cv));
      _mm512_storeu_ps(alpha + r, _mm512_mask_mov_ps(a, none, _mm512_set1_ps(1.0f)));
      _mm512_storeu_ps(m_run + r, mn);
      _mm512_storeu_ps(mc + r, _mm512_mul_ps(mn, cv));
    }
    for (int64_t r = 0; r < Rp; ++r) {
      uint16_t* pr = pb + r * KB;
      if (m_run[r] == -std::numeric_limits<float>::infinity()) {  // nothing visible yet: no weights
        std::memset(pr, 0, KB * sizeof(uint16_t));
        continue;
      }
      radixserve_flash::weights_row(s + r * KB, cv, mc[r], alpha[r], pr, l_run + r * 16);
    }
    if constexpr (TILES) {
      tile_values<P, ND>(pb, alpha, Rp, vtb, nt, o);
    } else {
      radixserve_flash::values_rows<ND>(pb, alpha, Rp, vtb, nt, o);
    }
  }
  if constexpr (TILES) P::release();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / GS, g = g0 + r % GS;
    bf16* dst = reinterpret_cast<bf16*>(out + ((sq.q_start + i) * H + h * G + g) * D);
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_loadu_ps(l_run + r * 16)));
    for (int c = 0; c < ND; ++c) radixserve_simd::store16(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), inv));
  }
}

template <int ND, class P>
void run(const torch::Tensor& q, const torch::Tensor& kv, const int64_t* slots, const std::vector<Seq>& seqs,
         int64_t packed_keys, int64_t window, float scale, torch::Tensor& out) {
  constexpr int64_t D = ND * 16;
  const int64_t H = q.size(1), Hkv = kv.size(1), N = kv.size(2), G = H / Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(kv.data_ptr());
  const uint16_t* vp = kp + Hkv * N * D;
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  // Packed keys and values: [Hkv, packed_keys, D] bfloat16 each (as words: packed_keys * D / 2 per head).
  // Not zeroed: pack_block writes every word, padding included.
  const size_t words = static_cast<size_t>(Hkv * packed_keys * D / 2);
  radixserve_flash::PackedWords kt_buf = radixserve_flash::packed_words(words);
  radixserve_flash::PackedWords vt_buf = radixserve_flash::packed_words(words);
  uint32_t *kt = kt_buf.get(), *vt = vt_buf.get();
  std::vector<std::array<int64_t, 3>> packs;  // (seq, head, key block)
  std::vector<std::array<int64_t, 4>> tasks;  // (seq, head, query block, first query head of the slice)
  for (int64_t b = 0; b < static_cast<int64_t>(seqs.size()); ++b) {
    const int64_t n_kb = (seqs[b].kv_len + KB - 1) / KB, n_qb = (seqs[b].q_len + QB - 1) / QB;
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t kb = 0; kb < n_kb; ++kb) packs.push_back({b, h, kb});
      // Query blocks from both ends in turn: causal blocks cost more the later they sit, and each thread starts on
      // a contiguous share of the tasks, so alternating keeps the shares even (stealing evens out the rest).
      for (int64_t lo = 0, hi = n_qb - 1; lo <= hi; ++lo, --hi) {
        for (int64_t g0 = 0; g0 < G; g0 += MAX_GS) {
          tasks.push_back({b, h, lo, g0});
          if (hi != lo) tasks.push_back({b, h, hi, g0});
        }
      }
    }
  }
  radixserve_balanced::balanced_for(static_cast<int64_t>(packs.size()), 1, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, h, kb] = packs[t];
      const Seq& sq = seqs[b];
      const int64_t base = (h * packed_keys + sq.pack_off + kb * KB) * D / 2;
      pack_block(kp + h * N * D, vp + h * N * D, slots + sq.slot_off, kb * KB, sq.kv_len, D, kt + base,
                 vt + base);
    }
  });
  radixserve_balanced::balanced_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, h, qb, g0] = tasks[t];
      const Seq& sq = seqs[b];
      const int64_t base = (h * packed_keys + sq.pack_off) * D / 2;
      attend_block<ND, P>(qp, H, G, h, g0, std::min(MAX_GS, G - g0), sq, qb * QB, window, scale, kt + base,
                          vt + base, op);
    }
  });
}

// run for head size D, the products by P (Vector, or a tile type).
template <class P>
void dispatch(int64_t D, const torch::Tensor& q, const torch::Tensor& kv, const int64_t* slots,
              const std::vector<Seq>& seqs, int64_t packed_keys, int64_t window, float scale, torch::Tensor& out) {
  switch (D) {
    case 64: run<4, P>(q, kv, slots, seqs, packed_keys, window, scale, out); break;
    case 96: run<6, P>(q, kv, slots, seqs, packed_keys, window, scale, out); break;
    case 128: run<8, P>(q, kv, slots, seqs, packed_keys, window, scale, out); break;
    default: run<16, P>(q, kv, slots, seqs, packed_keys, window, scale, out); break;
  }
}
#else
constexpr bool kFast = false;
#endif

}  // namespace

bool available() { return kFast; }

// How the products run: vdpbf16ps, AMX tiles, or tiles emulated in memory (tests).
enum class Products { kVector, kTiles, kEmulated };

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& slots,
                        const torch::Tensor& seqs, double scale, int64_t window, Products products) {
  TORCH_CHECK(kFast, "extend_attention: built without AVX-512 BF16");
  TORCH_CHECK(products != Products::kTiles || (radixserve_amx::AVAILABLE && radixserve_amx::enable()),
              "extend_attention: AMX tiles are not usable here");
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && slots.dim() == 1 && seqs.dim() == 2 && seqs.size(1) == 4,
              "extend_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && kv.scalar_type() == torch::kBFloat16, "extend_attention: bfloat16");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && seqs.scalar_type() == torch::kInt64, "extend_attention: int64");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && seqs.is_contiguous(),
              "extend_attention: contiguous inputs");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = kv.size(1), N = kv.size(2);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(3) == D && Hkv > 0 && H % Hkv == 0, "extend_attention: shapes disagree");
  TORCH_CHECK(D == 64 || D == 96 || D == 128 || D == 256, "extend_attention: head_dim 64, 96, 128 or 256");
  TORCH_CHECK(window >= 0, "extend_attention: window >= 0");
  auto out = torch::empty_like(q);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* info = seqs.data_ptr<int64_t>();
  std::vector<Seq> list;
  int64_t packed = 0;
  for (int64_t b = 0; b < seqs.size(0); ++b) {
    const int64_t qs = info[b * 4], ql = info[b * 4 + 1], kl = info[b * 4 + 2], so = info[b * 4 + 3];
    TORCH_CHECK(ql >= 0 && qs >= 0 && qs + ql <= T && ql <= kl && so >= 0 && so + kl <= slots.size(0),
                "extend_attention: sequence ", b, " out of range");
    bool ok = true;  // a bad slot must not read outside the pool
    for (int64_t j = 0; j < kl; ++j) ok &= sp[so + j] >= 0 && sp[so + j] < N;
    TORCH_CHECK(ok, "extend_attention: slot out of range");
    if (ql == 0) continue;
    list.push_back({qs, ql, kl, so, packed});
    packed += (kl + KB - 1) / KB * KB;
  }
  const float sc = static_cast<float>(scale);
  if (products == Products::kVector) {
    dispatch<Vector>(D, q, kv, sp, list, packed, window, sc, out);
  } else if (products == Products::kEmulated) {
    dispatch<radixserve_amx::Emulated>(D, q, kv, sp, list, packed, window, sc, out);
  } else {
#ifdef RADIXSERVE_AMX
    dispatch<radixserve_amx::Amx>(D, q, kv, sp, list, packed, window, sc, out);
#endif
  }
#endif
  return out;
}

torch::Tensor extend_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor seqs,
                               double scale, int64_t window) {
  return attention(q, kv, slots, seqs, scale, window, Products::kVector);
}

torch::Tensor extend_attention_tiles(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor seqs,
                                     double scale, int64_t window, bool emulated) {
  return attention(q, kv, slots, seqs, scale, window, emulated ? Products::kEmulated : Products::kTiles);
}

}  // namespace radixserve_extend_attention

void register_extend_attention(pybind11::module_& parent) {
  auto m = parent.def_submodule("extend_attention");
  m.def("available", &radixserve_extend_attention::available, "whether this build has the AVX-512 BF16 kernel");
  m.def("extend_attention", &radixserve_extend_attention::extend_attention,
        "causal prefill attention over pool slots (bfloat16, CPU with AVX-512 BF16)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("tiles_available") = radixserve_amx::AVAILABLE;
  m.def("extend_attention_tiles", &radixserve_extend_attention::extend_attention_tiles,
        "extend_attention with its products on AMX tiles (emulated: in memory, slowly; tests)", py::arg("q"),
        py::arg("kv"), py::arg("slots"), py::arg("seqs"), py::arg("scale"), py::arg("window"),
        py::arg("emulated") = false, py::call_guard<py::gil_scoped_release>());
}
