// Linear layers over GGUF-style block-quantized weights, float32 activations, on CPU.
//
// A decode step reads every weight once; with weights kept in their 4- or 8-bit blocks it reads 4-6x fewer bytes
// than in float32, and decode on a CPU is bound by those bytes. Weight row n (one output channel) is K / 32 blocks
// of 32 weights, each block `bs` bytes (ggml's layouts, little-endian):
//   Q8_0 (34 B): fp16 d, int8 q[32]               w = d * q
//   Q4_0 (18 B): fp16 d, uint8 qs[16]             w = d * (q - 8)
//   Q4_1 (20 B): fp16 d, fp16 m, uint8 qs[16]     w = d * q + m
// where for 4-bit blocks q[i] = qs[i] & 15 and q[i + 16] = qs[i] >> 4.
//
// linear(x [M, K], w [N, K / 32 * bs], type) ~= x @ dequant(w)^T, as llama.cpp computes it: each row of x is
// quantized per block of 32 to int8 with a float scale (dx = max|x| / 127, qx = round(x / dx)), and each weight
// block's dot product with it is an integer sum (AVX2's maddubs), scaled once by dw * dx; Q4_1's offset adds
// m * dx * sum(qx), the sum of the *rounded* activations: then the result is exactly dequant(w) . (dx * qx), whose
// error is the activations' rounding times the weights themselves. (With the exact float sum instead, that
// rounding is multiplied by w - m, all of one sign and up to twice as large: 3.5x the error on random weights.) The integer
// products cost a third of unpacking weights to float32, and the activations' rounding (0.4% of a block's largest
// value at most) is far below the weights'. dequantize(w) gives the
// float32 matrix (for large M, where a float32 GEMM library is faster) and rows(w, ids) a few of its rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../../csrc/simd.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define RS_AVX2 1
#endif

namespace radixserve_quant_linear {
namespace {

constexpr int64_t QK = 32;
enum QType : int64_t { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3 };

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q8_0: return 34;
    case Q4_0: return 18;
    case Q4_1: return 20;
    default: TORCH_CHECK(false, "quant_linear: unsupported block type ", type);
  }
}

inline float fp16_to_float(uint16_t h) {
  // IEEE half -> float without F16C (the scalar path): sign, exponent, mantissa; subnormals and inf/nan kept.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400) == 0) { mant <<= 1; --exp; }
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The 32 weights of one block as float32, scalar (reference and fallback).
inline void unpack_block(const uint8_t* b, int64_t type, float* out) {
  const float d = fp16_to_float(load_u16(b));
  if (type == Q8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int i = 0; i < QK; ++i) out[i] = d * q[i];
    return;
  }
  const float m = type == Q4_1 ? fp16_to_float(load_u16(b + 2)) : -8.0f * d;
  const uint8_t* qs = b + (type == Q4_1 ? 4 : 2);
  for (int i = 0; i < QK / 2; ++i) {
    out[i] = d * (qs[i] & 15) + m;
    out[i + QK / 2] = d * (qs[i] >> 4) + m;
  }
}

// Activations quantized per block of 32 (shared with quant_packed.cpp): int8 values, their scale dx, the sum of
// the rounded block as an integer and as dx * sum (Q4_1's offset meets it), and the sum of its first 16 (Q6_K's
// sub-blocks are 16 wide).
struct QuantRows {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d, sum;   // [M, nb]
  std::vector<int32_t> qsum, half;  // [M, nb]
};

// x (float32 or bfloat16) rounded per block of 32: dx = max|x| / 127, q = nearest-even(x * (1 / dx)) (the
// vector conversion's default rounding is nearbyint's, so both paths give the same bytes).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, QuantRows& out) {
  const int64_t nb = K / QK;
  out.q.resize(M * K);
  out.d.resize(M * nb);
  out.sum.resize(M * nb);
  out.qsum.resize(M * nb);
  out.half.resize(M * nb);
  at::parallel_for(0, M * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const T* xb = x + i * QK;
#ifdef __AVX512F__
      using radixserve_simd::load16;
      const __m512 v0 = load16(xb), v1 = load16(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float d = amax / 127.0f;
      const __m512 id = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + i * QK), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + i * QK + 16), _mm512_cvtsepi32_epi8(q1));
      const int32_t half = _mm512_reduce_add_epi32(q0);
      const int32_t qsum = half + _mm512_reduce_add_epi32(q1);
#elif defined(RS_AVX2)
      __m256 v[4];
      for (int k = 0; k < 4; ++k) v[k] = radixserve_simd::load8(xb + 8 * k);
      const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 m = _mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask));
      m = _mm256_max_ps(m, _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 127.0f;
      const __m256 id = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];  // nearest-even, as nearbyint (the default rounding mode)
      for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], id));
      // int32 -> int8 with saturation; the packs interleave 128-bit lanes, the permutation restores the order.
      const __m256i b16 = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * QK),
                          _mm256_permutevar8x32_epi32(b16, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const int32_t half = radixserve_simd::hsum8(_mm256_add_epi32(q[0], q[1]));
      const int32_t qsum = half + radixserve_simd::hsum8(_mm256_add_epi32(q[2], q[3]));
#else
      float amax = 0.0f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(static_cast<float>(xb[j])));
      const float d = amax / 127.0f;
      const float id = d > 0.0f ? 1.0f / d : 0.0f;
      int32_t qsum = 0, half = 0;
      for (int j = 0; j < QK; ++j) {
        const int8_t v = static_cast<int8_t>(std::nearbyint(static_cast<float>(xb[j]) * id));
        out.q[i * QK + j] = v;
        qsum += v;
        if (j == QK / 2 - 1) half = qsum;
      }
#endif
      out.d[i] = d;
      out.qsum[i] = qsum;
      out.half[i] = half;
      out.sum[i] = d * static_cast<float>(qsum);
    }
  });
}

#ifdef RS_AVX2
// A weight block as maddubs wants it: `u` unsigned bytes (|w| for signed levels, Q4_1's q as they are) and, for
// signed levels, the signs to give x; the block's scale d and Q4_1's offset m.
template <int64_t TYPE>
struct WBlock {
  __m256i u, sign;
  float d, m;
};

template <int64_t TYPE>
inline WBlock<TYPE> load_wblock(const uint8_t* b) {
  WBlock<TYPE> w;
  w.d = _cvtsh_ss(load_u16(b));
  w.m = 0.0f;
  if constexpr (TYPE == Q8_0) {
    w.sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
  } else {
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (TYPE == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(15);
    w.sign = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), _mm_and_si128(qs, mask));
    if constexpr (TYPE == Q4_1) {
      w.m = _cvtsh_ss(load_u16(b + 2));
      w.u = w.sign;  // q >= 0: no signs to move
      return w;
    } else {
      w.sign = _mm256_sub_epi8(w.sign, _mm256_set1_epi8(8));  // Q4_0: q - 8, in [-8, 7]
    }
  }
  w.u = _mm256_sign_epi8(w.sign, w.sign);  // |levels|
  return w;
}

// The block's dot product with qx as 8 int32 lanes, converted to float (their sum is the integer dot product).
template <int64_t TYPE>
inline __m256 block_dot(const WBlock<TYPE>& w, const int8_t* qx) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx));
  if constexpr (TYPE != Q4_1) x = _mm256_sign_epi8(x, w.sign);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w.u, x), _mm256_set1_epi16(1)));
}

// Output channels [n0, n1) for MR rows of x at a time; blocks in pairs, so each row keeps two independent FMA
// chains in registers (fixed indices: an array indexed at run time would live in memory).
template <int64_t TYPE, int MR>
void int_rows(const QuantRows& xq, int64_t m0, int64_t K, const uint8_t* w, int64_t bs, int64_t N, int64_t n0,
              int64_t n1, float* y) {
  const int64_t nb = K / QK;
  const int8_t* qx[MR];
  const float* dx[MR];
  const float* sx[MR];
  for (int r = 0; r < MR; ++r) {
    qx[r] = xq.q.data() + (m0 + r) * K;
    dx[r] = xq.d.data() + (m0 + r) * nb;
    sx[r] = xq.sum.data() + (m0 + r) * nb;
  }
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * nb * bs;
    __m256 a0[MR], a1[MR];
    float off[MR];
    for (int r = 0; r < MR; ++r) {
      a0[r] = a1[r] = _mm256_setzero_ps();
      off[r] = 0.0f;
    }
    int64_t blk = 0;
    for (; blk + 2 <= nb; blk += 2) {
      const WBlock<TYPE> w0 = load_wblock<TYPE>(row + blk * bs), w1 = load_wblock<TYPE>(row + (blk + 1) * bs);
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm256_fmadd_ps(block_dot(w0, qx[r] + blk * QK), _mm256_set1_ps(w0.d * dx[r][blk]), a0[r]);
        a1[r] = _mm256_fmadd_ps(block_dot(w1, qx[r] + (blk + 1) * QK), _mm256_set1_ps(w1.d * dx[r][blk + 1]), a1[r]);
        if constexpr (TYPE == Q4_1) off[r] += w0.m * sx[r][blk] + w1.m * sx[r][blk + 1];
      }
    }
    if (blk < nb) {
      const WBlock<TYPE> w0 = load_wblock<TYPE>(row + blk * bs);
      for (int r = 0; r < MR; ++r) {
        a0[r] = _mm256_fmadd_ps(block_dot(w0, qx[r] + blk * QK), _mm256_set1_ps(w0.d * dx[r][blk]), a0[r]);
        if constexpr (TYPE == Q4_1) off[r] += w0.m * sx[r][blk];
      }
    }
    for (int r = 0; r < MR; ++r) y[(m0 + r) * N + n] = radixserve_simd::hsum8(_mm256_add_ps(a0[r], a1[r])) + off[r];
  }
}

template <int64_t TYPE>
void int_all(const QuantRows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t bs, int64_t N, int64_t n0,
             int64_t n1, float* y) {
  // Rows in groups of 4, the rest in one group of 3 or 2: each group reads the weights once (a speculative
  // verification of 1-3 drafts, or 2-3 users decoding, is 2-4 rows).
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) int_rows<TYPE, 4>(xq, m0, K, w, bs, N, n0, n1, y);
  if (M - m0 == 3) int_rows<TYPE, 3>(xq, m0, K, w, bs, N, n0, n1, y);
  if (M - m0 == 2) int_rows<TYPE, 2>(xq, m0, K, w, bs, N, n0, n1, y);
  if (M - m0 == 1) int_rows<TYPE, 1>(xq, m0, K, w, bs, N, n0, n1, y);
}

void int_dispatch(const QuantRows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t bs, int64_t N,
                  int64_t n0, int64_t n1, float* y) {
  switch (type) {
    case Q8_0: int_all<Q8_0>(xq, M, K, w, bs, N, n0, n1, y); break;
    case Q4_0: int_all<Q4_0>(xq, M, K, w, bs, N, n0, n1, y); break;
    default: int_all<Q4_1>(xq, M, K, w, bs, N, n0, n1, y); break;
  }
}
#endif

// The same arithmetic as the AVX2 path, one weight at a time (machines without AVX2).
void rows_scalar(const QuantRows& xq, int64_t M, int64_t K, const uint8_t* w, int64_t type, int64_t bs, int64_t N,
                 int64_t n0, int64_t n1, float* y) {
  const int64_t nb = K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float acc = 0.0f;
      for (int64_t blk = 0; blk < nb; ++blk) {
        const uint8_t* b = w + (n * nb + blk) * bs;
        const float d = fp16_to_float(load_u16(b));
        const int64_t i = m * nb + blk;
        const int8_t* qx = xq.q.data() + i * QK;
        int32_t dot = 0;
        float off = 0.0f;
        if (type == Q8_0) {
          const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
          for (int j = 0; j < QK; ++j) dot += q[j] * qx[j];
        } else {
          const uint8_t* qs = b + (type == Q4_1 ? 4 : 2);
          const int bias = type == Q4_1 ? 0 : 8;
          for (int j = 0; j < QK / 2; ++j) {
            dot += ((qs[j] & 15) - bias) * qx[j] + ((qs[j] >> 4) - bias) * qx[j + QK / 2];
          }
          if (type == Q4_1) off = fp16_to_float(load_u16(b + 2)) * xq.sum[i];
        }
        acc += static_cast<float>(dot) * (d * xq.d[i]) + off;
      }
      y[m * N + n] = acc;
    }
  }
}

void check(const torch::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_linear: weight blocks");
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * block_bytes(type), "quant_linear: K and block bytes disagree");
}

}  // namespace

torch::Tensor linear(torch::Tensor x, torch::Tensor w, int64_t type, int64_t K) {
  check(w, type, K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == torch::kFloat32, "quant_linear: x [M, K] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), N = w.size(0), bs = block_bytes(type);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  QuantRows xq;
  quantize_rows(xp, M, K, xq);
  // Output channels are independent: threads take contiguous ranges of them (each reads its rows of w once).
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
#ifdef RS_AVX2
    int_dispatch(xq, M, K, wp, type, bs, N, n0, n1, yp);
#else
    rows_scalar(xq, M, K, wp, type, bs, N, n0, n1, yp);
#endif
  });
  return y;
}

torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K) {
  check(w, type, K);
  const int64_t N = w.size(0), nb = K / QK, bs = block_bytes(type);
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N * nb, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) unpack_block(wp + b * bs, type, op + b * QK);
  });
  return out;
}

torch::Tensor rows(torch::Tensor w, torch::Tensor ids, int64_t type, int64_t K) {
  check(w, type, K);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64, "quant_linear: ids [T] int64");
  ids = ids.contiguous();
  const int64_t T = ids.size(0), N = w.size(0), nb = K / QK, bs = block_bytes(type);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "quant_linear: row id out of range");
  auto out = torch::empty({T, K}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) unpack_block(wp + (ip[t] * nb + b) * bs, type, op + t * K + b * QK);
  });
  return out;
}

}  // namespace radixserve_quant_linear

void register_quant_linear(pybind11::module_& parent) {
  auto m = parent.def_submodule("quant_linear");
  m.def("linear", &radixserve_quant_linear::linear, "x @ dequant(w)^T for block-quantized w", py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &radixserve_quant_linear::dequantize, "float32 matrix of block-quantized w", py::call_guard<py::gil_scoped_release>());
  m.def("rows", &radixserve_quant_linear::rows, "float32 rows ids of block-quantized w", py::call_guard<py::gil_scoped_release>());
}
