// Decode attention straight from the KV pool, for float32 and bfloat16 on CPU.
//
// One query token per sequence attends to that sequence's keys and values, which sit at arbitrary slots of the
// pool. The PyTorch path gathers the keys into a padded copy, multiplies, and sums the values with embedding_bag:
// it writes and re-reads a copy of every key. This kernel reads each key and value row once, in place: decode
// attention is memory-bound, so that is most of its cost.
//
// Layouts (contiguous; q and kv both float32 or both bfloat16, slots and lens int64):
//   q      [B, H, D]            the decode rows' queries; query head i uses KV head i / (H / Hkv)
//   kv     [2, Hkv, N, D]       one layer of the pool: keys, then values, head-major
//   slots  [B, W] or [1, W]     each row's slots, first lens[b] valid (the rest is padding, never read); one row
//                               for all: the queries of one prefill chunk, each seeing a prefix of its keys
//   lens   [B]
//   groups [B, 2] (optional) per row: its group (an id below B) or -1, and the group's prefix length. Rows of a group
//                               start with the same slots (one radix-tree node): in bfloat16 with AVX-512 BF16 they
//                               attend that prefix together (prefix_attention.h, products on vdpbf16ps, weights
//                               rounded to bfloat16 as prefill does), then their own keys here, merged; elsewhere
//                               groups are ignored (the rows are whole either way).
// Returns out [B, H, D] in q's dtype (softmax-weighted values) and lse [B, H] float32 (log-sum-exp of the scaled
// scores), so a caller can merge this partial result with attention over other keys (cascade attention over a
// shared prefix). Whatever the storage dtype, every product and sum is float32 (bfloat16 is widened on load, which
// is exact); bfloat16 halves the bytes read, and decode attention is bound by them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../csrc/balanced.h"
#include "../../csrc/simd.h"
#include "prefix_attention.h"

namespace radixserve_decode_attention {
namespace {

using bf16 = c10::BFloat16;

#ifdef __AVX512F__
using radixserve_simd::load16;

// Softmax numerators in place: s[j] <- e^(s[j] - m); returns their sum.
inline float exp_and_sum(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = radixserve_simd::exp(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = radixserve_simd::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}

// Rows are read in slot order, which is scattered (a prompt's slots run together, but a decoded token's slot sits
// between the other rows' tokens of that step): each row is asked for twice ahead, every cache line of it, into
// L2 FAR rows ahead and into L1 NEAR rows ahead, so that DRAM latency (and the page walk of a row on another page)
// overlaps the work on the rows before it. 16 rows of SmolLM2's heads over 663 slots laid out as a served step's,
// 30 layers, 2 cores of the Zen 4: into L1 alone, 16 rows ahead, 11.1 ms; with 64 rows into L2 as well, 9.3 ms
// (contiguous slots: 9.7 -> 9.1 ms). The slot loads stay at the call sites: GCC 12 compiled a helper that read the
// slot and prefetched the row to nothing (check with objdump for prefetcht1 after changing these).
constexpr int64_t NEAR = 8, FAR = 64;

// Every cache line of a row, into L1 (prefetch_row) or L2 (prefetch_row_l2).
template <int ND, typename T>
inline void prefetch_row(const T* row) {
  constexpr int LINES = (ND * 16 * static_cast<int>(sizeof(T)) + 63) / 64;
  const char* p = reinterpret_cast<const char*>(row);
  for (int c = 0; c < LINES; ++c) _mm_prefetch(p + c * 64, _MM_HINT_T0);
}
template <int ND, typename T>
inline void prefetch_row_l2(const T* row) {
  constexpr int LINES = (ND * 16 * static_cast<int>(sizeof(T)) + 63) / 64;
  const char* p = reinterpret_cast<const char*>(row);
  for (int c = 0; c < LINES; ++c) _mm_prefetch(p + c * 64, _MM_HINT_T1);
}

// A (row, KV head) task's keys: its KV head's, at its slots after the group's prefix (if any). attend_one is given
// the next task's too (what its thread will likely read next): the last FAR rows of the keys' pass ask for the
// first values into L2, and the last FAR of the values' pass for the next task's first keys, so that a pass does
// not start on an empty pipeline (it would wait out DRAM latency on its first rows). 16 rows of 663
// slots, SmolLM2's heads, 30 layers, 2-core Zen 4: 7.55-8.78 -> 6.52-6.57 ms a step (37-38 GB/s, this machine's
// read bandwidth); one row of 4,000 slots as before (few passes).
template <typename T>
struct TaskKeys {
  const T* keys = nullptr;
  const int64_t* slots = nullptr;
  int64_t L = 0;
};

// One (row, KV head): G query heads of ND * 16 dims over L keys. Accumulators live in registers; ``out`` is
// float32 (the caller rounds it to the storage dtype).
template <int ND, int G, typename T>
void attend_one(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t L,
                float scale, float* scores, float* out, float* lse, const TaskKeys<T>& next) {
  constexpr int64_t D = ND * 16;
  __m512 qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < ND; ++v) qv[g][v] = _mm512_mul_ps(load16(q + g * D + v * 16), _mm512_set1_ps(scale));
  // Scores 16 keys at a time: each key's per-lane products stay in ``part``, and one butterfly (hsum16) sums 16
  // of them at once, instead of a horizontal reduction per (key, head).
  __m512 part[G][16];
  __m512 mxv[G];
  for (int g = 0; g < G; ++g) mxv[g] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= L; j += 16) {
    for (int jj = 0; jj < 16; ++jj) {
      if (j + jj + NEAR < L) prefetch_row<ND>(keys + slots[j + jj + NEAR] * D);
      if (j + jj + FAR < L) {
        prefetch_row_l2<ND>(keys + slots[j + jj + FAR] * D);
      } else if (j + jj + FAR - L < L) {
        prefetch_row_l2<ND>(values + slots[j + jj + FAR - L] * D);
      }
      const T* k = keys + slots[j + jj] * D;
      __m512 kr[ND];
      for (int v = 0; v < ND; ++v) kr[v] = load16(k + v * 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
        for (int v = 1; v < ND; ++v) acc = _mm512_fmadd_ps(qv[g][v], kr[v], acc);
        part[g][jj] = acc;
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sv = radixserve_simd::hsum16(part[g]);
      _mm512_storeu_ps(scores + g * L + j, sv);
      mxv[g] = _mm512_max_ps(mxv[g], sv);
    }
  }
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = _mm512_reduce_max_ps(mxv[g]);
  for (; j < L; ++j) {
    const T* k = keys + slots[j] * D;
    __m512 kr[ND];
    for (int v = 0; v < ND; ++v) kr[v] = load16(k + v * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
      for (int v = 1; v < ND; ++v) acc = _mm512_fmadd_ps(qv[g][v], kr[v], acc);
      const float sc = _mm512_reduce_add_ps(acc);
      scores[g * L + j] = sc;
      mx[g] = sc > mx[g] ? sc : mx[g];
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    const float sum = exp_and_sum(scores + g * L, L, mx[g]);
    inv[g] = 1.0f / sum;
    lse[g] = mx[g] + std::log(sum);
  }
  __m512 acc[G][ND];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < ND; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < L; ++j) {
    if (j + NEAR < L) prefetch_row<ND>(values + slots[j + NEAR] * D);
    if (j + FAR < L) {
      prefetch_row_l2<ND>(values + slots[j + FAR] * D);
    } else if (j + FAR - L < next.L) {
      prefetch_row_l2<ND>(next.keys + next.slots[j + FAR - L] * D);
    }
    const T* vrow = values + slots[j] * D;
    __m512 vr[ND];
    for (int v = 0; v < ND; ++v) vr[v] = load16(vrow + v * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + j]);
      for (int v = 0; v < ND; ++v) acc[g][v] = _mm512_fmadd_ps(p, vr[v], acc[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < ND; ++v)
      _mm512_storeu_ps(out + g * D + v * 16, _mm512_mul_ps(acc[g][v], _mm512_set1_ps(inv[g])));
}

template <typename T>
using Kernel = void (*)(const T*, const T*, const T*, const int64_t*, int64_t, float, float*, float*, float*,
                        const TaskKeys<T>&);

template <int ND, typename T>
Kernel<T> pick_g(int64_t G) {
  switch (G) {
    case 1: return attend_one<ND, 1, T>;
    case 2: return attend_one<ND, 2, T>;
    case 3: return attend_one<ND, 3, T>;
    case 4: return attend_one<ND, 4, T>;
    case 5: return attend_one<ND, 5, T>;
    case 6: return attend_one<ND, 6, T>;
    case 7: return attend_one<ND, 7, T>;
    case 8: return attend_one<ND, 8, T>;
    default: return nullptr;
  }
}

template <typename T>
Kernel<T> pick(int64_t D, int64_t G) {
  if (D == 64) return pick_g<4, T>(G);
  if (D == 128) return pick_g<8, T>(G);
  return nullptr;
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define RS_DECODE_AVX2 1
// CPUs with AVX2 and no AVX-512 (AMD Zen 2/3, older Intel): the generic loop's dot products are float reductions,
// which the compiler keeps scalar (one dependent add per dimension); here they run 8 lanes at a time.
using radixserve_simd::exp_nonpositive;
using radixserve_simd::hsum8;
using radixserve_simd::load8;

constexpr int64_t PREFETCH = 16;  // rows ahead, into L1

template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t c = 0; c < D * static_cast<int64_t>(sizeof(T)); c += 64) _mm_prefetch(p + c, _MM_HINT_T0);
}

// attend_generic's result for D % 8 == 0, with the AVX-512 kernel's order of operations: q scaled first, each
// key's products summed in 8 lanes. ``qf`` holds G * D floats of scratch.
template <typename T>
void attend_avx2(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t L, int64_t G,
                 int64_t D, float scale, float* scores, float* qf, float* out, float* lse) {
  for (int64_t i = 0; i < G * D; i += 8) _mm256_storeu_ps(qf + i, _mm256_mul_ps(load8(q + i), _mm256_set1_ps(scale)));
  std::vector<float> mx(static_cast<size_t>(G), -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < L; ++j) {
    if (j + PREFETCH < L) prefetch_row(keys + slots[j + PREFETCH] * D, D);
    const T* k = keys + slots[j] * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = qf + g * D;
      __m256 a0 = _mm256_mul_ps(load8(qg), load8(k)), a1 = _mm256_setzero_ps();
      int64_t d = 8;
      for (; d + 16 <= D; d += 16) {
        a1 = _mm256_fmadd_ps(load8(qg + d), load8(k + d), a1);
        a0 = _mm256_fmadd_ps(load8(qg + d + 8), load8(k + d + 8), a0);
      }
      if (d < D) a1 = _mm256_fmadd_ps(load8(qg + d), load8(k + d), a1);
      const float sc = hsum8(_mm256_add_ps(a0, a1));
      scores[g * L + j] = sc;
      mx[g] = sc > mx[g] ? sc : mx[g];
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * L;
    const __m256 mv = _mm256_set1_ps(mx[g]);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= L; j += 8) {
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
      _mm256_storeu_ps(sg + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    if (j < L) {
      alignas(32) float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t t = j; t < L; ++t) tail[t - j] = sg[t] - mx[g];
      alignas(32) float e[8];
      _mm256_store_ps(e, exp_nonpositive(_mm256_load_ps(tail)));
      for (int64_t t = j; t < L; ++t) {
        sg[t] = e[t - j];
        sum += e[t - j];
      }
    }
    lse[g] = mx[g] + std::log(sum);
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    // The weighted values, 64 dimensions (8 registers) at a time.
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      const int nv = static_cast<int>(std::min<int64_t>(64, D - d0) / 8);
      __m256 acc_v[8];
      for (int v = 0; v < 8; ++v) acc_v[v] = _mm256_setzero_ps();
      for (int64_t jj = 0; jj < L; ++jj) {
        if (g == 0 && d0 == 0 && jj + PREFETCH < L) prefetch_row(values + slots[jj + PREFETCH] * D, D);
        const T* vrow = values + slots[jj] * D + d0;
        const __m256 p = _mm256_set1_ps(sg[jj]);
        for (int v = 0; v < nv; ++v) acc_v[v] = _mm256_fmadd_ps(p, load8(vrow + 8 * v), acc_v[v]);
      }
      for (int v = 0; v < nv; ++v) _mm256_storeu_ps(out + g * D + d0 + 8 * v, _mm256_mul_ps(acc_v[v], inv));
    }
  }
}
#endif

// Any head size and group size, without SIMD intrinsics: the compiler vectorizes what it can.
template <typename T>
void attend_generic(const T* q, const T* keys, const T* values, const int64_t* slots, int64_t L,
                    int64_t G, int64_t D, float scale, float* scores, float* out, float* lse) {
  for (int64_t g = 0; g < G; ++g) {
    const T* qg = q + g * D;
    float* sg = scores + g * L;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      const T* k = keys + slots[j] * D;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += static_cast<float>(qg[d]) * static_cast<float>(k[d]);
      sg[j] = acc * scale;
      mx = sg[j] > mx ? sg[j] : mx;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < L; ++j) {
      sg[j] = std::exp(sg[j] - mx);
      sum += sg[j];
    }
    lse[g] = mx + std::log(sum);
    float* og = out + g * D;
    for (int64_t d = 0; d < D; ++d) og[d] = 0.0f;
    for (int64_t j = 0; j < L; ++j) {
      const T* v = values + slots[j] * D;
      const float p = sg[j] / sum;
      for (int64_t d = 0; d < D; ++d) og[d] += p * static_cast<float>(v[d]);
    }
  }
}

// Each row's result over its own keys merged with its group's over the shared prefix (prefix_attention.h): ``o``
// and ``l`` hold the row's G heads over its own keys (L of them; none: only the prefix counts) and become the merge.
inline void merge_prefix(float* o, float* l, const float* po, const float* pl, int64_t G, int64_t D, int64_t L) {
  for (int64_t g = 0; g < G; ++g) {
    if (L == 0) {
      std::copy(po + g * D, po + (g + 1) * D, o + g * D);
      l[g] = pl[g];
      continue;
    }
    const float m = std::max(l[g], pl[g]);
    const float a = std::exp(l[g] - m), b = std::exp(pl[g] - m), inv = 1.0f / (a + b);
    for (int64_t d = 0; d < D; ++d) o[g * D + d] = (a * o[g * D + d] + b * po[g * D + d]) * inv;
    l[g] = m + std::log(a + b);
  }
}

// ``start``: per row, the keys its group's prefix covers (read from there on and merged with the group's result over
// them in ``pre``, whose ``runs`` per row are merged first), or null: whole rows.
template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& slots, const torch::Tensor& lens,
         float sc, torch::Tensor& out, torch::Tensor& lse, const int64_t* start = nullptr,
         const radixserve_prefix_attention::Partials* pre = nullptr, const int64_t* runs = nullptr) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(1), N = kv.size(2), W = slots.size(0) == 1 ? 0 : slots.size(1);  // row stride
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + Hkv * N * D;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  float* lsep = lse.data_ptr<float>();
#ifdef __AVX512F__
  const Kernel<T> fast = pick<T>(D, G);
#endif
  // Rows differ in length, so (row, head) tasks differ in cost: a thread done early takes tasks from another's share.
  radixserve_balanced::balanced_for(B * Hkv, 1, [&](int64_t begin, int64_t end, int64_t) {
    // A thread's buffers outlive its claims (a claim is often one task).
    thread_local std::vector<float> scores, acc;
    acc.resize(static_cast<size_t>(G * D));
#ifdef RS_DECODE_AVX2
    thread_local std::vector<float> qf;
    qf.resize(static_cast<size_t>(G * D));
#endif
    auto prefix = [&](int64_t row) { return start != nullptr ? start[row] : int64_t{0}; };  // attended with the group
    auto keys_of = [&](int64_t t) {
      const int64_t row = t / Hkv;
      return TaskKeys<T>{kp + (t % Hkv) * N * D, sp + row * W + prefix(row), lp[row] - prefix(row)};
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, P = prefix(b);
      const TaskKeys<T> own = keys_of(task);
      const TaskKeys<T> next = task + 1 < B * Hkv ? keys_of(task + 1) : TaskKeys<T>{};  // (most often this thread's)
      const int64_t L = own.L;
      const T* qb = qp + (b * H + h * G) * D;
      T* ob = op + (b * H + h * G) * D;
      float* lb = lsep + b * H + h * G;
      if (L == 0 && P == 0) {
        for (int64_t i = 0; i < G * D; ++i) ob[i] = T(0.0f);
        for (int64_t g = 0; g < G; ++g) lb[g] = -std::numeric_limits<float>::infinity();
        continue;
      }
      scores.resize(static_cast<size_t>(G * L));
      const T* keys = own.keys;
      const T* values = vp + h * N * D;
      const int64_t* row_slots = own.slots;
      // float32 output is written in place; a narrower one goes through the float32 buffer, rounded once.
      float* ofl = std::is_same_v<T, float> ? reinterpret_cast<float*>(ob) : acc.data();
      if (L > 0) {
#ifdef __AVX512F__
        if (fast != nullptr) {
          fast(qb, keys, values, row_slots, L, sc, scores.data(), ofl, lb, next);
        } else
#endif
#ifdef RS_DECODE_AVX2
        if (D % 8 == 0) {
          attend_avx2<T>(qb, keys, values, row_slots, L, G, D, sc, scores.data(), qf.data(), ofl, lb);
        } else
#endif
        {
          attend_generic<T>(qb, keys, values, row_slots, L, G, D, sc, scores.data(), ofl, lb);
        }
      }
      if (P > 0) {
        radixserve_prefix_attention::merge_runs(*pre, b, h * G, G, runs[b]);
        merge_prefix(ofl, lb, pre->o(0, b, h * G), &pre->l(0, b, h * G), G, D, L);
      }
      if constexpr (!std::is_same_v<T, float>) {
        for (int64_t i = 0; i < G * D; ++i) ob[i] = T(ofl[i]);
      }
    }
  });
}

}  // namespace

// Whether groups of rows that share a prefix are attended together for this dtype and these heads (else callers
// pass whole rows and no groups).
bool groups_supported(const torch::Tensor& q, const torch::Tensor& kv) {
  return q.dim() == 3 && kv.dim() == 4 && q.scalar_type() == torch::kBFloat16 && kv.size(1) > 0 &&
         q.size(1) % kv.size(1) == 0 && radixserve_prefix_attention::supports(q.size(2), q.size(1) / kv.size(1));
}

// ``groups`` [B, 2] int64, per row: (its group, an id below B, or -1; the length of the group's prefix), the prefix
// being the first keys of every member's slot row (the same slots: one radix-tree node). Checked: a group's members
// agree on the length, which lies within each member's keys.
std::vector<radixserve_prefix_attention::Group> parse_groups(const torch::Tensor& groups, const int64_t* sp,
                                                             const int64_t* lp, int64_t B, int64_t W) {
  TORCH_CHECK(groups.dim() == 2 && groups.size(0) == B && groups.size(1) == 2 &&
                  groups.scalar_type() == torch::kInt64 && groups.is_contiguous(),
              "decode_attention: groups [B, 2] int64 (group or -1, prefix length)");
  const int64_t* gp = groups.data_ptr<int64_t>();
  std::vector<int64_t> index(static_cast<size_t>(B), -1);  // group id -> its place in the list
  std::vector<radixserve_prefix_attention::Group> list;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t id = gp[2 * b], P = gp[2 * b + 1];
    if (id < 0) continue;
    TORCH_CHECK(id < B && P > 0 && P <= lp[b], "decode_attention: row ", b, "'s group or prefix out of range");
    if (index[id] < 0) {
      index[id] = static_cast<int64_t>(list.size());
      list.push_back({P, sp + b * W, {}});
    }
    auto& g = list[index[id]];
    TORCH_CHECK(g.prefix == P, "decode_attention: rows of group ", id, " disagree on its prefix length");
    g.rows.push_back(b);
  }
  return list;
}

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor lens,
                                            double scale, std::optional<torch::Tensor> groups) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && slots.dim() == 2 && lens.dim() == 1, "decode_attention: bad ranks");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && kv.scalar_type() == dtype,
              "decode_attention: q and kv both float32 or both bfloat16");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64, "decode_attention: int64");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && lens.is_contiguous(),
              "decode_attention: contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(1), N = kv.size(2), W = slots.size(1);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(3) == D && Hkv > 0 && H % Hkv == 0, "decode_attention: shapes disagree");
  TORCH_CHECK((slots.size(0) == B || slots.size(0) == 1) && lens.size(0) == B,
              "decode_attention: a slot row per query (or one for all) and a length per query");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const bool shared = slots.size(0) == 1;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= W, "decode_attention: length out of range");
    longest = std::max(longest, lp[b]);
  }
  for (int64_t b = 0; b < (shared ? 1 : B); ++b) {  // a shared row is checked once, as far as any query reads
    bool ok = true;
    for (int64_t j = 0; j < (shared ? longest : lp[b]); ++j) ok &= sp[b * W + j] >= 0 && sp[b * W + j] < N;
    TORCH_CHECK(ok, "decode_attention: slot out of range");  // a bad slot must not read outside the pool
  }
  auto out = torch::empty({B, H, D}, q.options());
  auto lse = torch::empty({B, H}, q.options().dtype(torch::kFloat32));
  const float sc = static_cast<float>(scale);
  // The rows are whole either way: groups the prefix kernel cannot take (float32, other heads) are only ignored.
  if (groups.has_value() && groups_supported(q, kv) && !shared) {
    std::vector<radixserve_prefix_attention::Group> list = parse_groups(*groups, sp, lp, B, W);
    const int64_t most = radixserve_prefix_attention::plan_runs(list, H / Hkv, Hkv, at::get_num_threads());
    const auto rows = static_cast<size_t>(B);
    std::vector<int64_t> start(rows, 0), runs(rows, 0), pos(rows, -1);  // per row
    int64_t grouped = 0;
    for (const auto& g : list) {
      for (int64_t b : g.rows) {
        start[b] = g.prefix;
        runs[b] = g.runs;
        pos[b] = grouped++;
      }
    }
    // Kept between calls (a step calls once a layer): only grouped rows' entries are written and read.
    thread_local std::vector<float> pre_out, pre_lse;
    pre_out.resize(std::max(pre_out.size(), static_cast<size_t>(most * grouped * H * D)));
    pre_lse.resize(std::max(pre_lse.size(), static_cast<size_t>(most * grouped * H)));
    const radixserve_prefix_attention::Partials pre{pre_out.data(), pre_lse.data(), pos.data(), grouped, H, D};
    radixserve_prefix_attention::dispatch(q, kv, list, sc, pre);
    run<bf16>(q, kv, slots, lens, sc, out, lse, start.data(), &pre, runs.data());
  } else if (dtype == torch::kFloat32) {
    run<float>(q, kv, slots, lens, sc, out, lse);
  } else {
    run<bf16>(q, kv, slots, lens, sc, out, lse);
  }
  return {out, lse};
}

}  // namespace radixserve_decode_attention

void register_decode_attention(pybind11::module_& parent) {
  auto m = parent.def_submodule("decode_attention");
  // Released like torch's own ops release it, so Python threads (the server's event loop) run meanwhile.
  m.def("decode_attention", &radixserve_decode_attention::decode_attention,
        "decode attention over pool slots (float32 or bfloat16, CPU); groups: rows that share a prefix, attended "
        "over it together",
        py::arg("q"), py::arg("kv"), py::arg("slots"), py::arg("lens"), py::arg("scale"),
        py::arg("groups") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("groups_supported", &radixserve_decode_attention::groups_supported,
        "whether rows that share a prefix can be attended together for these q and kv");
}
