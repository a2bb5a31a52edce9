// Decode rows that share a cached prefix attend to it once per group (cascade attention), for decode_attention.cpp.
//
// Rows whose sequences start with the same prefix (the same radix-tree node, so the same pool slots) read the same
// keys. Attended row by row, each row reads the prefix again and multiplies it against its own G query heads: the
// keys come from cache after the first row, but the products run G queries per key load, in float32. Here a
// group's rows' queries, up to RMAX (rows times G heads) at once, run flash attention over the prefix together on
// vdpbf16ps, as prefill does: each block of KB keys is packed into the operand layouts (flash_blocks.h) in a
// buffer of the task's own, which stays in L1, and each packed block loaded into registers serves 4 query rows.
// The prefix is split into runs of keys (flash-decoding) where one group's few KV heads would not make enough tasks
// for every core; each task leaves, per (row, query head), its float32 output over its run and the
// log-sum-exp of its scaled scores, and the runs are merged exactly. decode_attention then attends each row's own
// keys after the prefix and merges that in too.
//
// Layouts: q [B, H, D] bfloat16; pool keys / values of one KV head [N, D] bfloat16; a group: its prefix length P,
// its rows, and the slots of its prefix (any member's first P slots).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "flash_blocks.h"

namespace radixserve_prefix_attention {

using radixserve_flash::KB;

struct Group {
  int64_t prefix;              // P: the shared prefix's length in keys
  const int64_t* slots;        // its P slots
  std::vector<int64_t> rows;   // the decode rows that share it
  int64_t runs = 1;            // the runs of keys its prefix is split into (plan_runs)
};

// A task: up to RMAX query rows (whole rows' G heads: at least one row) over a run of the prefix's keys.
constexpr int64_t RMAX = 64;
// Runs are at least this long (packing and merging stay a small share of a task), and a prefix is split into runs
// only as far as the tasks need to keep every core busy: one group of 16 rows of SmolLM2 (3 KV heads, so 3 tasks
// unsplit) over a 1,300-token prompt makes 9 tasks on 2 cores; a step of many groups or rows is not split at all.
constexpr int64_t MIN_RUN_KEYS = 8 * KB;
constexpr int64_t TASKS_PER_THREAD = 4;

// Members of a group per task: whole rows' G query heads, RMAX query rows at most (G <= 8: see supports).
inline int64_t members_per_task(int64_t G) { return std::max<int64_t>(1, RMAX / G); }

// Sets each group's runs for ``threads`` cores; returns the most runs of any group.
inline int64_t plan_runs(std::vector<Group>& groups, int64_t G, int64_t Hkv, int64_t threads) {
  int64_t unsplit = 0;  // tasks with every prefix in one run
  for (const Group& g : groups)
    unsplit += Hkv * ((static_cast<int64_t>(g.rows.size()) + members_per_task(G) - 1) / members_per_task(G));
  const int64_t want = (TASKS_PER_THREAD * threads + unsplit - 1) / std::max<int64_t>(1, unsplit);
  int64_t most = 1;
  for (Group& g : groups) {
    g.runs = std::max<int64_t>(1, std::min(want, (g.prefix + MIN_RUN_KEYS - 1) / MIN_RUN_KEYS));
    most = std::max(most, g.runs);
  }
  return most;
}

// What a task leaves per (grouped row, query head, run): its float32 output over the run, normalized, and its
// log-sum-exp. Rows are indexed by ``pos`` (a grouped row's place among them; B entries).
struct Partials {
  float* out;           // [runs, rows, H, D]
  float* lse;           // [runs, rows, H]
  const int64_t* pos;   // [B]
  int64_t rows, H, D;
  float* o(int64_t run, int64_t b, int64_t head) const { return out + ((run * rows + pos[b]) * H + head) * D; }
  float& l(int64_t run, int64_t b, int64_t head) const { return lse[(run * rows + pos[b]) * H + head]; }
};

#ifdef RADIXSERVE_FLASH
using radixserve_flash::exp2v;

// Rows r = k * G + g (member k of ``rows``, query head h * G + g) over keys [kb0, kb1) * KB of the group's P
// (``slots``; ``keys`` / ``values`` the KV head's rows of the pool), into run ``run`` of ``parts``.
template <int ND>
void attend_prefix(const uint16_t* q, int64_t H, int64_t G, int64_t h, const int64_t* rows, int64_t n_rows,
                   const uint16_t* keys, const uint16_t* values, const int64_t* slots, int64_t P, int64_t kb0,
                   int64_t kb1, float scale, const Partials& parts, int64_t run) {
  constexpr int D = ND * 16, DP = D / 2;
  constexpr int MRS = 4;  // score rows per register block (a multiple of values_rows' 16 / ND)
  constexpr int LINES = D * 2 / 64;  // cache lines of a key's (or a value's) row
  const int64_t R = n_rows * G;
  const int64_t Rp = (R + MRS - 1) / MRS * MRS;
  alignas(64) static thread_local float s[RMAX * KB];
  alignas(64) static thread_local uint16_t pb[RMAX * KB];
  alignas(64) static thread_local float o[RMAX * D];
  alignas(64) static thread_local uint32_t kt[KB * DP], vt[KB * D / 2];  // this block's keys and values, packed
  alignas(64) static const uint32_t zero_q[D / 2] = {};
  alignas(64) float m_run[RMAX], l_run[RMAX * 16], alpha[RMAX];
  const uint32_t* qrows[RMAX];
  for (int64_t r = 0; r < Rp; ++r) {
    qrows[r] = r < R ? reinterpret_cast<const uint32_t*>(q + (rows[r / G] * H + h * G + r % G) * D) : zero_q;
    m_run[r] = -std::numeric_limits<float>::infinity();
    std::fill(l_run + r * 16, l_run + r * 16 + 16, 0.0f);
    std::memset(o + r * D, 0, D * sizeof(float));
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const float c = scale * 1.4426950408889634f;  // e^(scale x) = 2^(c x)
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    // The next block's rows into L2 while this one is multiplied (the prefix is read from memory once a layer).
    for (int64_t j = (kb + 1) * KB; j < std::min((kb + 2) * KB, kb1 * KB) && j < P; ++j)
      for (int line = 0; line < LINES; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(keys + slots[j] * D) + 64 * line, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(values + slots[j] * D) + 64 * line, _MM_HINT_T1);
      }
    radixserve_flash::pack_block(keys, values, slots, kb * KB, P, D, kt, vt);
    const int64_t here = std::min<int64_t>(KB, P - kb * KB);  // keys of this block (the last may be partial)
    const int nt = static_cast<int>((here + 15) / 16);          // tiles of 16 keys that hold any
    radixserve_flash::scores_rows<DP, MRS>(qrows, Rp, kt, nt, s);
    const __m512i limit = _mm512_set1_epi32(static_cast<int>(here));
    for (int64_t r = 0; r < Rp; ++r) {
      float* sr = s + r * KB;
      __m512 mx = neg_inf;
      for (int t = 0; t < 4; ++t) {
        __m512 v = neg_inf;  // tiles past the block's keys were not scored
        if (t < nt) {
          const __mmask16 ok = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(t * 16)), limit);
          v = _mm512_mask_mov_ps(neg_inf, ok, _mm512_loadu_ps(sr + t * 16));
        }
        _mm512_storeu_ps(sr + t * 16, v);
        mx = _mm512_max_ps(mx, v);
      }
      // Every block holds at least one key, so the running max is finite from the first block on.
      const float m_new = std::max(m_run[r], _mm512_reduce_max_ps(mx));
      alpha[r] = m_run[r] == -std::numeric_limits<float>::infinity()
                     ? 1.0f
                     : _mm512_cvtss_f32(exp2v(_mm512_set1_ps((m_run[r] - m_new) * c)));
      m_run[r] = m_new;
      radixserve_flash::weights_row(sr, cv, m_new * c, alpha[r], pb + r * KB, l_run + r * 16);
    }
    radixserve_flash::values_rows<ND>(pb, alpha, Rp, vt, nt, o);
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = rows[r / G], head = h * G + r % G;
    const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(l_run + r * 16));
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    float* dst = parts.o(run, b, head);
    for (int k = 0; k < ND; ++k)
      _mm512_storeu_ps(dst + k * 16, _mm512_mul_ps(_mm512_loadu_ps(o + r * D + k * 16), inv));
    parts.l(run, b, head) = m_run[r] * scale + std::log(l);
  }
}

// Every group's prefix attention, run by run (``plan_runs`` set them), into ``parts``. q [B, H, D], kv [2, Hkv, N, D]
// bfloat16.
template <int ND>
void run(const torch::Tensor& q, const torch::Tensor& kv, const std::vector<Group>& groups, float scale,
         const Partials& parts) {
  constexpr int64_t D = ND * 16;
  const int64_t H = q.size(1), Hkv = kv.size(1), N = kv.size(2), G = H / Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(kv.data_ptr());
  const uint16_t* vp = kp + Hkv * N * D;
  std::vector<std::array<int64_t, 5>> tasks;  // (group, head, first member, members, run)
  const int64_t per_task = members_per_task(G);
  for (int64_t gi = 0; gi < static_cast<int64_t>(groups.size()); ++gi) {
    const int64_t members = static_cast<int64_t>(groups[gi].rows.size());
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t k0 = 0; k0 < members; k0 += per_task)
        for (int64_t r = 0; r < groups[gi].runs; ++r) tasks.push_back({gi, h, k0, std::min(per_task, members - k0), r});
  }
  radixserve_balanced::balanced_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end, int64_t) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [gi, h, k0, n, r] = tasks[t];
      const Group& g = groups[gi];
      // Run r of the group's blocks of keys (whole blocks, as even as they go).
      const int64_t blocks = (g.prefix + KB - 1) / KB, kb0 = r * blocks / g.runs, kb1 = (r + 1) * blocks / g.runs;
      attend_prefix<ND>(qp, H, G, h, g.rows.data() + k0, n, kp + h * N * D, vp + h * N * D, g.slots, g.prefix, kb0,
                        kb1, scale, parts, r);
    }
  });
}
#endif

// Run 0 of ``parts`` becomes the merge of row b's ``runs`` runs, for its G query heads from ``head``.
inline void merge_runs(const Partials& parts, int64_t b, int64_t head, int64_t G, int64_t runs) {
  for (int64_t g = head; g < head + G; ++g) {
    float* o = parts.o(0, b, g);
    float& l = parts.l(0, b, g);
    for (int64_t r = 1; r < runs; ++r) {
      const float lr = parts.l(r, b, g), m = std::max(l, lr);
      const float x = std::exp(l - m), y = std::exp(lr - m), inv = 1.0f / (x + y);
      const float* other = parts.o(r, b, g);
      for (int64_t d = 0; d < parts.D; ++d) o[d] = (x * o[d] + y * other[d]) * inv;
      l = m + std::log(x + y);
    }
  }
}

// Whether this build attends shared prefixes of head size D together (else decode_attention reads whole rows).
inline bool supports(int64_t D, int64_t G) {
#ifdef RADIXSERVE_FLASH
  return (D == 64 || D == 96 || D == 128 || D == 256) && G >= 1 && G <= 8;
#else
  (void)D;
  (void)G;
  return false;
#endif
}

// run for head size D.
inline void dispatch(const torch::Tensor& q, const torch::Tensor& kv, const std::vector<Group>& groups, float scale,
                     const Partials& parts) {
#ifdef RADIXSERVE_FLASH
  switch (q.size(2)) {
    case 64: run<4>(q, kv, groups, scale, parts); break;
    case 96: run<6>(q, kv, groups, scale, parts); break;
    case 128: run<8>(q, kv, groups, scale, parts); break;
    default: run<16>(q, kv, groups, scale, parts); break;
  }
#else
  (void)q, (void)kv, (void)groups, (void)scale, (void)parts;
#endif
}

}  // namespace radixserve_prefix_attention
