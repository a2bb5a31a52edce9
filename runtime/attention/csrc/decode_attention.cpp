// Decode attention straight from the KV pool, for float32 on CPU.
//
// One query token per sequence attends to that sequence's keys and values, which sit at arbitrary slots of the
// pool. The PyTorch path gathers the keys into a padded copy, multiplies, and sums the values with embedding_bag:
// it writes and re-reads a copy of every key. This kernel reads each key and value row once, in place: decode
// attention is memory-bound, so that is most of its cost.
//
// Layouts (all float32 / int64, contiguous):
//   q      [B, H, D]            the decode rows' queries; query head i uses KV head i / (H / Hkv)
//   kv     [2, Hkv, N, D]       one layer of the pool: keys, then values, head-major
//   slots  [B, W]               each row's slots, first lens[b] valid (the rest is padding, never read)
//   lens   [B]
// Returns out [B, H, D] (softmax-weighted values) and lse [B, H] (log-sum-exp of the scaled scores), so a caller
// can merge this partial result with attention over other keys (cascade attention over a shared prefix).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace radixserve_decode_attention {
namespace {

#ifdef __AVX512F__
// e^x for x <= 0 (scores minus their max): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor polynomial of
// degree 7 (truncation error < 1e-8, below float32 rounding), times 2^n by scalef (exact, underflows to 0).
inline __m512 exp_nonpositive(__m512 x) {
  // max returns its second operand when either is NaN: a NaN score stays NaN (and poisons the row, as in PyTorch).
  x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators in place: s[j] <- e^(s[j] - m); returns their sum.
inline float exp_and_sum(float* s, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mv));
    _mm512_mask_storeu_ps(s + j, k, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, e));
  }
  return _mm512_reduce_add_ps(acc);
}

// Rows are read in slot order, which is scattered: ask for the row PREFETCH slots ahead, every cache line of it,
// so that its DRAM latency overlaps the work on the rows before it.
constexpr int64_t PREFETCH = 16;

template <int ND>
inline void prefetch_row(const float* row) {
  for (int v = 0; v < ND; ++v) _mm_prefetch(reinterpret_cast<const char*>(row + v * 16), _MM_HINT_T0);
}

// One (row, KV head): G query heads of ND * 16 dims over L keys. Accumulators live in registers.
template <int ND, int G>
void attend_one(const float* q, const float* keys, const float* values, const int64_t* slots, int64_t L,
                float scale, float* scores, float* out, float* lse) {
  constexpr int64_t D = ND * 16;
  __m512 qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < ND; ++v) qv[g][v] = _mm512_mul_ps(_mm512_loadu_ps(q + g * D + v * 16), _mm512_set1_ps(scale));
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    if (j + PREFETCH < L) prefetch_row<ND>(keys + slots[j + PREFETCH] * D);
    const float* k = keys + slots[j] * D;
    __m512 kr[ND];
    for (int v = 0; v < ND; ++v) kr[v] = _mm512_loadu_ps(k + v * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kr[0]);
      for (int v = 1; v < ND; ++v) acc = _mm512_fmadd_ps(qv[g][v], kr[v], acc);
      const float s = _mm512_reduce_add_ps(acc);
      scores[g * L + j] = s;
      mx[g] = s > mx[g] ? s : mx[g];
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
    if (j + PREFETCH < L) prefetch_row<ND>(values + slots[j + PREFETCH] * D);
    const float* vrow = values + slots[j] * D;
    __m512 vr[ND];
    for (int v = 0; v < ND; ++v) vr[v] = _mm512_loadu_ps(vrow + v * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + j]);
      for (int v = 0; v < ND; ++v) acc[g][v] = _mm512_fmadd_ps(p, vr[v], acc[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < ND; ++v)
      _mm512_storeu_ps(out + g * D + v * 16, _mm512_mul_ps(acc[g][v], _mm512_set1_ps(inv[g])));
}

using Kernel = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, float, float*, float*,
                        float*);

template <int ND>
Kernel pick_g(int64_t G) {
  switch (G) {
    case 1: return attend_one<ND, 1>;
    case 2: return attend_one<ND, 2>;
    case 3: return attend_one<ND, 3>;
    case 4: return attend_one<ND, 4>;
    case 5: return attend_one<ND, 5>;
    case 6: return attend_one<ND, 6>;
    case 7: return attend_one<ND, 7>;
    case 8: return attend_one<ND, 8>;
    default: return nullptr;
  }
}

Kernel pick(int64_t D, int64_t G) {
  if (D == 64) return pick_g<4>(G);
  if (D == 128) return pick_g<8>(G);
  return nullptr;
}
#endif

// Any head size and group size, without SIMD intrinsics: the compiler vectorizes what it can.
void attend_generic(const float* q, const float* keys, const float* values, const int64_t* slots, int64_t L,
                    int64_t G, int64_t D, float scale, float* scores, float* out, float* lse) {
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* sg = scores + g * L;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < L; ++j) {
      const float* k = keys + slots[j] * D;
      float acc = 0.0f;
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * k[d];
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
      const float* v = values + slots[j] * D;
      const float p = sg[j] / sum;
      for (int64_t d = 0; d < D; ++d) og[d] += p * v[d];
    }
  }
}

}  // namespace

std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor kv, torch::Tensor slots, torch::Tensor lens,
                                            double scale) {
  TORCH_CHECK(q.dim() == 3 && kv.dim() == 4 && slots.dim() == 2 && lens.dim() == 1, "decode_attention: bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && kv.scalar_type() == torch::kFloat32, "decode_attention: float32");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64, "decode_attention: int64");
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && slots.is_contiguous() && lens.is_contiguous(),
              "decode_attention: contiguous inputs");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Hkv = kv.size(1), N = kv.size(2), W = slots.size(1);
  TORCH_CHECK(kv.size(0) == 2 && kv.size(3) == D && Hkv > 0 && H % Hkv == 0, "decode_attention: shapes disagree");
  TORCH_CHECK(slots.size(0) == B && lens.size(0) == B, "decode_attention: one slot row and length per query");
  const int64_t G = H / Hkv;
  auto out = torch::empty({B, H, D}, q.options());
  auto lse = torch::empty({B, H}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = kv.data_ptr<float>();
  const float* vp = kp + Hkv * N * D;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= W, "decode_attention: length out of range");
    bool ok = true;
    for (int64_t j = 0; j < lp[b]; ++j) ok &= sp[b * W + j] >= 0 && sp[b * W + j] < N;
    TORCH_CHECK(ok, "decode_attention: slot out of range");  // a bad slot must not read outside the pool
  }
  float* op = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
#ifdef __AVX512F__
  const Kernel fast = pick(D, G);
#endif
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lp[b];
      const float* qb = qp + (b * H + h * G) * D;
      float* ob = op + (b * H + h * G) * D;
      float* lb = lsep + b * H + h * G;
      if (L == 0) {
        for (int64_t i = 0; i < G * D; ++i) ob[i] = 0.0f;
        for (int64_t g = 0; g < G; ++g) lb[g] = -std::numeric_limits<float>::infinity();
        continue;
      }
      scores.resize(static_cast<size_t>(G * L));
      const float* keys = kp + h * N * D;
      const float* values = vp + h * N * D;
#ifdef __AVX512F__
      if (fast != nullptr) {
        fast(qb, keys, values, sp + b * W, L, sc, scores.data(), ob, lb);
        continue;
      }
#endif
      attend_generic(qb, keys, values, sp + b * W, L, G, D, sc, scores.data(), ob, lb);
    }
  });
  return {out, lse};
}

}  // namespace radixserve_decode_attention

void register_decode_attention(pybind11::module_& parent) {
  auto m = parent.def_submodule("decode_attention");
  // Released like torch's own ops release it, so Python threads (the server's event loop) run meanwhile.
  m.def("decode_attention", &radixserve_decode_attention::decode_attention, "decode attention over pool slots (float32, CPU)",
        py::call_guard<py::gil_scoped_release>());
}
