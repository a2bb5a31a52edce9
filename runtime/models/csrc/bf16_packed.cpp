// y = x @ w^T (+ bias) for bfloat16 on CPU with AVX-512 BF16, over a weight packed once into pairs of K (the
// operand layout of vdpbf16ps), at any number of rows.
//
// Layout (``pack``): the weight's rows (output channels) in blocks of 16; a block is K/2 vectors of 64 bytes, vector
// p holding, for each of the block's 16 channels, its weights at k = 2p and 2p + 1 side by side. A weight given in
// parts (q, k, v) packs into one tensor, the parts' blocks one after another. The product then needs no horizontal
// sums: for each pair p, one 32-bit broadcast of x[i][2p : 2p + 2] times block vector p adds two products to each of
// 16 float32 lanes, one lane per output channel:
//   acc[i][b] (16 lanes) += vdpbf16ps(w[b][p], broadcast(x[i][2p], x[i][2p + 1]))  over p;
// tiles of MR rows by NB blocks keep MR x NB accumulators in registers (4x6, 6x4, 8x2, ...), the bias is added in
// float32 and the result rounded once. Against the dot-product kernel over the plain weight (bf16_linear.cpp),
// whose dot products end in a butterfly of 16 lanes and whose tiles of 16 rows read the block's rows as 16 streams,
// a block here is one stream and a tile is nothing but loads, broadcasts and vdpbf16ps: in a standalone loop 228-232
// GFLOP/s a core on the 2-core Zen 4 (its vdpbf16ps rate measured 230), against 143-190 for the dot-product tiles;
// bench/bf16_layer.py times whole layers. Sums are float32, in an order of their own: results differ from
// F.linear's in rounding only.
// A gate/up projection packed from [gate; up] also multiplies gated (``linear_silu_mul``): each tile takes gate blocks
// and the up blocks G further (G = N / 32) and writes silu(gate) * up, so an MLP's widest output is never written or
// read back (SmolLM2's prefill: 2,048 x 3,072 values a layer and chunk, and the silu_mul pass over them).
// Layouts: x [M, K] bfloat16 contiguous, K % 32 == 0; packed [N / 16, K * 16] bfloat16; bias [N] bfloat16 or empty.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "../../csrc/balanced.h"
#include "../../csrc/simd.h"
#include "huge_slabs.h"

namespace radixserve_bf16_packed {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

using radixserve_simd::bf16;

// Rows 0-15 of a block, 16 pairs each (64 bytes from w + r * K + k), transposed: out[p] holds pair p of each row.
inline void transpose16(const bf16* w, int64_t K, int64_t k, __m512i* out) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(w + i * K + k);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_i32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_i32x4(r[8 + i], r[12 + i], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    out[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    out[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xDD);
  }
}

// The next run of blocks (R ranges of memory: its gate and up blocks for a gated product), fetched into L2 a few
// 64-byte lines per step of the current run's tiles, so that streaming the weight overlaps the arithmetic.
template <int R>
struct Prefetch {
  const char* next[R] = {};
  const char* end[R] = {};
  int per_step = 0;
  inline void step() {
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < per_step && next[r] < end[r]; ++q, next[r] += 64) _mm_prefetch(next[r], _MM_HINT_T1);
  }
};

// A slice of K: its first pair, its pairs, and whether it is the first or the last of K (a whole K is both). A
// tile over a slice that is not the whole K keeps its float32 sums in `part` between slices.
struct Slice {
  int64_t p0, np;
  bool first, last;
};

// y[i][16 b + c] = x[i] . w_b[c] (+ bias) for MR rows of x (row stride K) and the NB blocks at w[0 .. NB), over the
// pairs of slice `s`; `part` (rows of 16 NB floats) holds the sums between slices. GATED: blocks [0, NB/2) are gate
// blocks and [NB/2, NB) the matching up blocks; y gets NB/2 blocks of silu(gate) * up, each product rounded to
// bfloat16 first, as a separate linear would store it, so the result is that of silu_mul over linear's to the bit.
template <int MR, int NB, bool GATED>
inline void tile(const bf16* x, int64_t K, const bf16* const* w, const Slice& s, bf16* y, int64_t ldy,
                 const float* const* bias, float* part, Prefetch<GATED ? 2 : 1>& pf) {
  // Two loops, not one with `s.first ? zero : load` per accumulator: GCC 12 built that select as a memset of the
  // array on the stack and a reload of every accumulator from it, on every tile (1.6% of a decode step's time).
  __m512 acc[MR * NB];
  if (s.first) {
#pragma GCC unroll 64
    for (int i = 0; i < MR * NB; ++i) acc[i] = _mm512_setzero_ps();
  } else {
#pragma GCC unroll 64
    for (int i = 0; i < MR * NB; ++i) acc[i] = _mm512_loadu_ps(part + (i / NB) * 16 * NB + 16 * (i % NB));
  }
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);
  for (int64_t p = s.p0; p < s.p0 + s.np; ++p) {
    pf.step();
    __m512bh wv[NB];
    for (int b = 0; b < NB; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w[b] + 32 * p);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xp[i * (K / 2) + p]);
      for (int b = 0; b < NB; ++b) acc[i * NB + b] = _mm512_dpbf16_ps(acc[i * NB + b], wv[b], xb);
    }
  }
  if (!s.last) {
    for (int i = 0; i < MR * NB; ++i) _mm512_storeu_ps(part + (i / NB) * 16 * NB + 16 * (i % NB), acc[i]);
    return;
  }
  for (int i = 0; i < MR * NB; ++i)
    if (bias[i % NB]) acc[i] = _mm512_add_ps(acc[i], _mm512_loadu_ps(bias[i % NB]));
  for (int i = 0; i < MR; ++i) {
    if constexpr (GATED) {
      for (int b = 0; b < NB / 2; ++b) {
        const __m512 g = radixserve_simd::round_as(acc[i * NB + b], y);
        const __m512 u = radixserve_simd::round_as(acc[i * NB + NB / 2 + b], y);
        radixserve_simd::store16(y + i * ldy + 16 * b, radixserve_simd::silu_mul(g, u));
      }
    } else {
      for (int b = 0; b < NB; ++b) radixserve_simd::store16(y + i * ldy + 16 * b, acc[i * NB + b]);
    }
  }
}

// Tile calls for M rows against a run of NB blocks (see rows).
inline int64_t tiles(int64_t M, int64_t NB) {
  if (NB == 6) return M / 4 + M % 4 / 2 + M % 2;
  if (NB == 4) return M / 6 + M % 6 / 4 + M % 6 % 4 / 2 + M % 2;
  return M / 8 + M % 8 / 4 + M % 4 / 2 + M % 2;
}

// Rows [0, M) of x against the NB blocks starting at block n (a run of NB consecutive blocks) over slice `s`, while
// the `ahead` blocks after them are prefetched (whole-K slices only). Runs of 6 blocks take tiles of 4 rows (24
// accumulators: 6 weight loads and 4 broadcasts a step for 24 products), runs of 4 (a thread's last blocks) tiles
// of 6, shorter ones tiles of 8. 4 x 6 against 6 x 4: 1.04-1.15x a layer of SmolLM2's and the 1B shapes at 1 to
// 2,048 rows (2-core Zen 4); a broadcast costs more than a weight load there (a register-only loop of vdpbf16ps runs
// at 230 GFLOP/s a core, 6 x 4 tiles at 208 over cached weights, 4 x 6 at 212; with the broadcast folded into the
// product as a {1to16} operand, 98). `part`: M rows of 16 NB floats, the sums between slices. GATED: n counts gate
// blocks, the run is NB/2 gate blocks from n and their up blocks from n + G (G = N / 32 gate blocks), y's rows hold
// N / 2.
template <int NB, bool GATED>
void rows(const bf16* x, int64_t M, int64_t K, const Slice& s, const bf16* packed, int64_t n, bf16* y, int64_t N,
          const float* bias, int64_t ahead, float* part) {
  constexpr int RUN = GATED ? NB / 2 : NB;  // blocks of each range in the run
  const int64_t G = N / 32;
  Prefetch<GATED ? 2 : 1> pf;
  for (int r = 0; r < (GATED ? 2 : 1); ++r) {
    pf.next[r] = reinterpret_cast<const char*>(packed + (n + RUN + r * G) * 16 * K);
    pf.end[r] = pf.next[r] + ahead * 16 * K * 2;
  }
  const int64_t lines = ahead * 16 * K * 2 / 64, steps = tiles(M, NB) * s.np;
  pf.per_step = static_cast<int>((lines + steps - 1) / steps);
  const bf16* w[NB];
  const float* bb[NB];
  for (int b = 0; b < NB; ++b) {
    const int64_t block = n + (GATED && b >= RUN ? b - RUN + G : b);
    w[b] = packed + block * 16 * K;
    bb[b] = bias ? bias + 16 * block : nullptr;
  }
  const int64_t ldy = GATED ? N / 2 : N;
  bf16* yn = y + 16 * n;
  const int64_t lp = 16 * NB;  // floats a row of `part`
  int64_t m = 0;
  if constexpr (NB == 6) {
    // (tiles of 4 rows below)
  } else if constexpr (NB == 4) {
    for (; m + 6 <= M; m += 6) tile<6, NB, GATED>(x + m * K, K, w, s, yn + m * ldy, ldy, bb, part + m * lp, pf);
  } else {
    for (; m + 8 <= M; m += 8) tile<8, NB, GATED>(x + m * K, K, w, s, yn + m * ldy, ldy, bb, part + m * lp, pf);
  }
  for (; m + 4 <= M; m += 4) tile<4, NB, GATED>(x + m * K, K, w, s, yn + m * ldy, ldy, bb, part + m * lp, pf);
  for (; m + 2 <= M; m += 2) tile<2, NB, GATED>(x + m * K, K, w, s, yn + m * ldy, ldy, bb, part + m * lp, pf);
  for (; m < M; ++m) tile<1, NB, GATED>(x + m * K, K, w, s, yn + m * ldy, ldy, bb, part + m * lp, pf);
}

}  // namespace

constexpr bool AVAILABLE = true;

// On `threads` threads of its own (std::thread, not OpenMP: the loader calls it, and another OpenMP team beside the
// engine thread's would slow every decode step; see runtime/threads.py's one_intra_op_thread).
torch::Tensor pack(std::vector<torch::Tensor> parts, int64_t threads) {
  TORCH_CHECK(!parts.empty(), "bf16_packed: no weight");
  const int64_t K = parts[0].size(1);
  int64_t blocks = 0;
  for (const auto& w : parts) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.size(1) == K && w.is_contiguous() &&
                    w.size(0) % 16 == 0 && K % 32 == 0,
                "bf16_packed: each weight part [N_i, K] bfloat16, contiguous, N_i % 16 == 0, K % 32 == 0");
    blocks += w.size(0) / 16;
  }
  // In the huge-page slabs (huge_slabs.h): a decode step streams every weight once. 30 layers of SmolLM2's shapes
  // streamed from memory, 2-core Zen 4: 1.00-1.03x against copies in torch's heap (bench/bf16_layer.py), 1.06x at
  // one row and 1.15x at 16 against one mapping of 4 KB pages.
  auto out = radixserve_huge_slabs::slabs().empty(blocks, K * 32).view(torch::kBFloat16);
  std::vector<const bf16*> src;
  for (const auto& w : parts)
    for (int64_t r = 0; r < w.size(0); r += 16) src.push_back(w.data_ptr<bf16>() + r * K);
  bf16* dst = out.data_ptr<bf16>();
  auto work = [&](int64_t begin, int64_t end) {
    __m512i v[16];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t k = 0; k < K; k += 32) {
        transpose16(src[b], K, k, v);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + b * 16 * K + (k + 2 * p) * 16, v[p]);
      }
  };
  const int64_t n = std::max<int64_t>(1, std::min(threads, blocks));
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < n; ++i) pool.emplace_back(work, blocks * i / n, blocks * (i + 1) / n);
  work(0, blocks / n);
  for (auto& t : pool) t.join();
  return out;
}

namespace {

// linear (gated false) and linear_silu_mul (gated true): see their registrations.
torch::Tensor product(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias, bool gated) {
  radixserve_bf16_tiles::check_operands(x, packed, gated, "bf16_packed");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = 16 * blocks;
  if (M >= radixserve_bf16_tiles::from_rows()) return radixserve_bf16_tiles::packed_product(x, packed, bias, gated);
  const std::vector<float> bias_f = radixserve_bf16_linear::bias_floats(bias, N, "bf16_packed");
  const bool has_bias = !bias_f.empty();
  // Gated: the work is the gate blocks; each comes with its up block, G blocks further.
  const int64_t units = gated ? blocks / 2 : blocks, ldy = gated ? N / 2 : N;
  auto y = torch::empty({M, ldy}, x.options());
  if (M == 0) return y;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const float* bp = has_bias ? bias_f.data() : nullptr;
  // Rows go in chunks of at most ~2 MB of x (in L3) while the blocks pass over it, and above 64 rows K in slices of
  // 2,048 (a run of 6 blocks' slice, 384 KB, stays in L2 for the chunk's tiles; the sums wait in float32 between
  // slices). The work is every (chunk, block) pair, chunk by chunk, the chunks equal; each thread starts on a
  // contiguous share of it (the same number of blocks: at one row, the same bytes to stream), claims it a run at a
  // time and takes runs from another's share when its own is done (balanced.h), and multiplies its
  // blocks of a chunk in runs of 6 (gated: 3 gate blocks and their 3 up blocks). (Chunks of 256 KB of x and whole
  // K ran the 1B shape's 256 rows at 0.9x oneDNN: a chunk of 16 rows for K = 8,192 re-read the weights from memory
  // 16 times.)
  const int64_t most = std::max<int64_t>(6, (int64_t{2} << 20) / (2 * K)), chunks = (M + most - 1) / most;
  const int64_t chunk = (M + chunks - 1) / chunks;
  const int64_t kc = M > 64 && K > 2048 ? 2048 : K, slices = (K + kc - 1) / kc;
  // Prefetching the next run pays from 4 to 64 rows (1.1-1.3x, 30 layers of SmolLM2's shapes, 2 threads); at 1-3
  // rows the hardware's stream prefetch does better alone (0.94x with it), and above 64 the blocks are read from
  // L2 by many tiles anyway (0.97x at 512 rows).
  const bool prefetch = M >= 4 && M <= 64;
  const int64_t run = gated ? 3 : 6;  // units of a full run (gated: a unit is a gate block with its up block)
  radixserve_balanced::balanced_for(chunks * units, run, [&](int64_t begin, int64_t end, int64_t limit) {
    // The sums between slices: a thread's buffer outlives its claims (a claim is one run; up to ~0.5 MB each).
    thread_local std::vector<float> part;
    const size_t need = static_cast<size_t>(chunk * 16 * 6);  // a chunk's rows of a full run's 6 blocks
    if (slices > 1 && part.size() < need) part.resize(need);
    for (int64_t t = begin; t < end;) {
      const int64_t c = t / units, b0 = t % units, b1 = std::min(units, b0 + end - t);
      const int64_t m0 = c * chunk, mc = std::min(chunk, M - m0);
      const bf16* xc = xp + m0 * K;
      bf16* yc = yp + m0 * ldy;
      const int64_t more = std::min(units, b0 + limit - t);  // this thread's likely next claims, in this chunk
      for (int64_t n = b0; n < b1;) {
        const int64_t left = b1 - n, nb = left >= run ? run : (left >= 4 && !gated ? 4 : (left >= 2 ? 2 : 1));
        const int64_t ahead = prefetch && slices == 1 ? std::min<int64_t>(run, more - n - nb) : 0;  // next run
        for (int64_t sl = 0; sl < slices; ++sl) {
          const Slice s{sl * kc / 2, std::min(kc, K - sl * kc) / 2, sl == 0, sl == slices - 1};
          float* pp = part.data();
          if (gated) {
            if (nb == 3) {
              rows<6, true>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
            } else if (nb == 2) {
              rows<4, true>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
            } else {
              rows<2, true>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
            }
          } else if (nb == 6) {
            rows<6, false>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
          } else if (nb == 4) {
            rows<4, false>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
          } else if (nb == 2) {
            rows<2, false>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
          } else {
            rows<1, false>(xc, mc, K, s, wp, n, yc, N, bp, ahead, pp);
          }
        }
        n += nb;
      }
      t += b1 - b0;
    }
  });
  return y;
}

}  // namespace

// Rows `ids` of a packed weight, as the plain weight holds them: the lookups of an embedding whose tied head is
// packed. Row r is lane r % 16 of block r / 16, one 32-bit pair every 64 bytes.
torch::Tensor rows(torch::Tensor packed, torch::Tensor ids) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % 32 == 0,
              "bf16_packed: packed [N / 16, 16 K] bfloat16 (pack's)");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "bf16_packed: ids int64");
  const int64_t K = packed.size(1) / 16, N = packed.size(0) * 16;
  auto flat = ids.contiguous().view(-1);
  const int64_t T = flat.size(0);
  const int64_t* ip = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "index ", ip[t], " is out of range for ", N, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  auto out = torch::empty(shape, packed.options());
  const int32_t* src = reinterpret_cast<const int32_t*>(packed.data_ptr<bf16>());
  int32_t* dst = reinterpret_cast<int32_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int32_t* row = src + (ip[t] / 16) * 8 * K + ip[t] % 16;
      for (int64_t p = 0; p < K / 2; ++p) dst[t * (K / 2) + p] = row[16 * p];
    }
  });
  return out;
}

// The plain weight [N, K] of a packed one (a run of whole blocks of it): pack's transpose undone, since the 16 x 16
// transpose of 32-bit pairs is its own inverse. For the products that go to oneDNN's GEMM instead of this kernel
// (bf16_kernels: with AMX, steps of many rows).
torch::Tensor unpack(torch::Tensor packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 2 && packed.is_contiguous() &&
                  packed.size(1) % 512 == 0,
              "bf16_packed: packed [N / 16, 16 K] bfloat16 (pack's)");
  const int64_t K = packed.size(1) / 16, blocks = packed.size(0);
  auto out = torch::empty({blocks * 16, K}, packed.options());
  const bf16* src = packed.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    __m512i v[16];
    for (int64_t b = begin; b < end; ++b)
      for (int64_t k = 0; k < K; k += 32) {
        transpose16(src + b * 16 * K + k * 16, 32, 0, v);  // pairs k / 2 ... k / 2 + 15, 32 values apart
        for (int r = 0; r < 16; ++r) _mm512_storeu_si512(dst + (b * 16 + r) * K + k, v[r]);
      }
  });
  return out;
}

#else
constexpr bool AVAILABLE = false;

torch::Tensor unpack(torch::Tensor) {
  TORCH_CHECK(false, "bf16_packed: built without AVX-512 BF16");
  return {};
}

torch::Tensor rows(torch::Tensor, torch::Tensor) {
  TORCH_CHECK(false, "bf16_packed: built without AVX-512 BF16");
  return {};
}

torch::Tensor pack(std::vector<torch::Tensor>, int64_t) {
  TORCH_CHECK(false, "bf16_packed: built without AVX-512 BF16");
  return {};
}

namespace {
torch::Tensor product(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, bool) {
  TORCH_CHECK(false, "bf16_packed: built without AVX-512 BF16");
  return {};
}
}  // namespace
#endif

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return product(x, packed, bias, false);
}

torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  return product(x, packed, bias, true);
}

}  // namespace radixserve_bf16_packed

void register_bf16_packed(pybind11::module_& parent) {
  auto m = parent.def_submodule("bf16_packed");
  m.attr("available") = radixserve_bf16_packed::AVAILABLE;
  m.def("pack", &radixserve_bf16_packed::pack, "bfloat16 weight parts [N_i, K] packed in pairs of K for linear",
        py::arg("parts"), py::arg("threads") = 1, py::call_guard<py::gil_scoped_release>());
  m.def("rows", &radixserve_bf16_packed::rows, "rows of a packed weight, as the plain weight holds them",
        py::call_guard<py::gil_scoped_release>());
  m.def("unpack", &radixserve_bf16_packed::unpack, "the plain weight [N, K] of a packed one (its blocks)",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &radixserve_bf16_packed::linear, "bfloat16 x @ w^T (+ bias) over pack's layout (AVX-512 BF16)",
        py::call_guard<py::gil_scoped_release>());
  // A gate/up projection packed from [gate; up] (as many rows each): silu(x @ gate^T) * (x @ up^T), [M, N / 2],
  // what fused_ops.silu_mul gives over linear's output, to the bit, without writing or reading that output.
  m.def("linear_silu_mul", &radixserve_bf16_packed::linear_silu_mul,
        "bfloat16 silu(x @ gate^T) * (x @ up^T) over pack's layout of [gate; up] (AVX-512 BF16)",
        py::call_guard<py::gil_scoped_release>());
}
