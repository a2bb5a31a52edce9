// Packing: ggml's row-major blocks repacked into quant_packed.cpp's 16-channel groups (the layouts are described
// there and in quant_packed_kquants.h), into memory from huge_slabs.h. Included by quant_packed.cpp inside its
// namespace, after the helpers and fill functions it uses; not a stand-alone header.
#pragma once

// A packed weight's memory, in the huge-page slabs of huge_slabs.h (decode streams every weight once a step: on 2
// MB pages the stream takes no TLB miss every 4 KB; all linear layers of the 1B Llama, Q4_K_M, one row, 2-core AMD
// EPYC: 29.3 ms a pass against 31.7 ms on 4 KB pages, when each weight was advised on its own). The packers write
// every byte of a group whose 16 channels exist, so only a padded last group (N not a multiple of 16) is zeroed
// here: its missing channels then have zero scales and quants. The pages are first touched by the packing threads.
torch::Tensor packed_groups(int64_t groups, int64_t row, int64_t N) {
  auto out = radixserve_huge_slabs::slabs().empty(groups, row);
  if (N % G != 0) std::memset(out.data_ptr<uint8_t>() + (groups - 1) * row, 0, row);
  return out;
}

// fn(g0, g1) over [0, n) channel groups on plain threads. Packing runs under the loader, which keeps one OpenMP
// thread (runtime/threads.py: an OpenMP team made there would outlive the load and slow the engine's); the
// repacking is pure memory shuffling, so it takes every core without OpenMP (1B Llama, Q4_K_M: see
// docs/benchmarks.md).
template <typename F>
void split_groups(int64_t n, F fn) {
  const int64_t cores = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t parts = std::min<int64_t>({cores, 8, (n + 63) / 64});  // a thread for 64 groups at least
  if (parts <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  const int64_t chunk = (n + parts - 1) / parts;
  std::vector<std::thread> threads;
  for (int64_t p = 1; p < parts; ++p) threads.emplace_back(fn, p * chunk, std::min(n, (p + 1) * chunk));
  fn(int64_t{0}, std::min(n, chunk));
  for (auto& t : threads) t.join();
}

// ggml rows of 256-weight super-blocks [N, K / 256 * in_bytes] -> groups [g0, g0 + ceil(N / 16)) of `out` (out_bytes
// per super-block and channel): fill(group row, channel c, super-block s, its ggml bytes) writes one channel's
// super-block.
template <typename F>
void pack_super(const torch::Tensor& w, int64_t K, int64_t bytes, F fill, torch::Tensor& out, int64_t g0) {
  const int64_t ns = K / 256, N = w.size(0), groups = (N + G - 1) / G;
  TORCH_CHECK(K % 256 == 0 && w.size(1) == ns * bytes, "quant_packed: K and K-quant block bytes disagree");
  TORCH_CHECK(out.size(1) == ns * G * bytes, "quant_packed: the output's rows do not fit this type and K");
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>() + g0 * out.size(1);
  split_groups(groups, [&](int64_t ga, int64_t gb) {
    for (int64_t g = ga; g < gb; ++g)
      for (int c = 0; c < G && g * G + c < N; ++c)
        for (int64_t s = 0; s < ns; ++s) fill(dst + g * out.size(1), c, s, src + ((g * G + c) * ns + s) * bytes);
  });
}

// Bytes of one packed group row of K inputs.
int64_t packed_row_bytes(int64_t type, int64_t K) {
  if (type == Q6_K) return K / 256 * G * Q6_K_BYTES;
  if (type == Q4_K) return K / 256 * G * Q4_K_BYTES;
  if (type == Q5_K) return K / 256 * G * Q5_K_BYTES;
  return K / QK * G * block_bytes(type);
}

void check_blocks(const torch::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(), "quant_packed: weight blocks");
  TORCH_CHECK(K % weight_block(type) == 0, "quant_packed: K is not a multiple of the type's block");
}

// Row-major blocks [N, K / 32 * bs] (or K-quant super-blocks) -> groups [g0, g0 + ceil(N / 16)) of `out`.
void pack_into(torch::Tensor& out, int64_t g0, const torch::Tensor& w, int64_t type, int64_t K) {
  check_blocks(w, type, K);
  TORCH_CHECK(g0 + (w.size(0) + G - 1) / G <= out.size(0), "quant_packed: the output has too few groups");
  if (type == Q6_K) return pack_super(w, K, Q6_K_BYTES, fill_q6, out, g0);
  if (type == Q4_K) return pack_super(w, K, Q4_K_BYTES, fill_kq<false>, out, g0);
  if (type == Q5_K) return pack_super(w, K, Q5_K_BYTES, fill_kq<true>, out, g0);
  const int64_t bs = block_bytes(type), hb = header_bytes(type), nb = K / QK, N = w.size(0);
  const int64_t groups = (N + G - 1) / G;
  TORCH_CHECK(w.size(1) == nb * bs && out.size(1) == nb * G * bs, "quant_packed: K and block bytes disagree");
  const uint8_t* src = w.data_ptr<uint8_t>();
  const int64_t row_stride = out.size(1);
  uint8_t* dst = out.data_ptr<uint8_t>() + g0 * row_stride;
  split_groups(groups, [&](int64_t ga, int64_t gb) {
    for (int64_t g = ga; g < gb; ++g) {
      const Row row(dst + g * row_stride, type, nb);
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* q = const_cast<uint8_t*>(row.quants(b));
        uint8_t* scales = const_cast<uint8_t*>(row.scales(b));
        uint8_t* offsets = has_offsets(type) ? const_cast<uint8_t*>(row.offsets(b)) : nullptr;
        for (int c = 0; c < G && g * G + c < N; ++c) {
          const uint8_t* blk = src + ((g * G + c) * nb + b) * bs;
          std::memcpy(scales + 2 * c, blk, 2);
          if (offsets != nullptr) std::memcpy(offsets + 2 * c, blk + 2, 2);
          const uint8_t* qs = blk + hb + (is_q5(type) ? 4 : 0);
          if (type == Q8_0) {  // 4 weights a word, each flipped to unsigned where the kernel wants it
            const uint32_t flip = Q8_STORED_OFFSET ? 0x80808080u : 0u;
            for (int j = 0; j < QK / 4; ++j) store_u32(q + 64 * j + 4 * c, load_u32(qs + 4 * j) ^ flip);
          } else {
            // ggml's qs[i] holds q[i] low and q[i + 16] high: the pairing of the packed bytes too.
            for (int j = 0; j < QK / 8; ++j) std::memcpy(q + 64 * j + 4 * c, qs + 4 * j, 4);
          }
          if (is_q5(type)) {  // ggml's qh: bit i of a little-endian word is q[i]'s fifth bit
            const uint32_t qh = load_u32(blk + hb);
            for (int p = 0; p < 4; ++p) {
              uint32_t bits = 0;
              for (int j = 0; j < 4; ++j)
                bits |= ((qh >> (4 * j + p)) & 1u) << (2 * j) | ((qh >> (16 + 4 * j + p)) & 1u) << (2 * j + 1);
              q[256 + 4 * c + p] = static_cast<uint8_t>(bits);
            }
          }
        }
      }
    }
  });
}

torch::Tensor pack(torch::Tensor w, int64_t type, int64_t K) {
  check_blocks(w, type, K);
  auto out = packed_groups((w.size(0) + G - 1) / G, packed_row_bytes(type, K), w.size(0));  // padding: zero scales
  pack_into(out, 0, w, type, K);
  return out;
}

// The parts' rows one after another (a merged projection), packed into one weight without concatenating the
// blocks first: each part fills its own groups, so every part but the last must have a multiple of 16 rows.
torch::Tensor pack_parts(const std::vector<torch::Tensor>& parts, int64_t type, int64_t K) {
  TORCH_CHECK(!parts.empty(), "quant_packed: no parts");
  int64_t groups = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    check_blocks(parts[i], type, K);
    TORCH_CHECK(i + 1 == parts.size() || parts[i].size(0) % G == 0,
                "quant_packed: every part but the last needs a multiple of 16 rows");
    groups += (parts[i].size(0) + G - 1) / G;
  }
  auto out = packed_groups(groups, packed_row_bytes(type, K), parts.back().size(0));
  int64_t g0 = 0;
  for (const auto& part : parts) {
    pack_into(out, g0, part, type, K);
    g0 += (part.size(0) + G - 1) / G;
  }
  return out;
}
