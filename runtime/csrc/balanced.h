// Work split over the intra-op threads that survives a thread losing its core for a while.
//
// at::parallel_for hands each thread one contiguous share and waits for the slowest. On a machine whose cores are
// shared with the HTTP front end, the detokenizer and the clients (two cores here), a thread that is preempted for
// a few milliseconds holds the whole step: the others finish their shares and wait at the barrier, so a front end
// busy 5% of the machine costs a static split ~10% (a 2,048-row gate/up product on two cores, a busy loop taking
// 1 ms of every 8 on one of them: +13%). balanced_for keeps the static split's order and locality (each thread
// starts on its own contiguous share, front to back) and lets a thread that runs out take items from the back of
// another's share, so a late thread's work moves to the threads that are running. Uneven items (decode rows of
// different lengths, causal query blocks) balance the same way.
//
// Invariants: every item in [0, n) is claimed exactly once, by one thread, in claims of at most `step` items that
// stay inside one share; a share is claimed from its front by its owner and from its back by the others, through one
// 64-bit compare-and-swap of the (front, back) pair, so the two ends never overlap. Items run in the order their
// owner would have run them unless stolen.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace radixserve_balanced {

struct alignas(64) Share {
  std::atomic<uint64_t> ends{0};  // front in the low 32 bits, back in the high 32 bits
};

inline uint64_t pack_ends(uint64_t front, uint64_t back) { return front | (back << 32); }

// Claims up to `step` items of `share`: from the front (its owner) or from the back (another thread). Returns false
// when the share is empty; otherwise [begin, end) is this caller's.
inline bool claim(Share& share, int64_t step, bool front, int64_t& begin, int64_t& end) {
  uint64_t cur = share.ends.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t f = static_cast<int64_t>(cur & 0xffffffffu), b = static_cast<int64_t>(cur >> 32);
    if (f >= b) return false;
    const uint64_t next = front ? pack_ends(std::min(b, f + step), b) : pack_ends(f, std::max(f, b - step));
    if (share.ends.compare_exchange_weak(cur, next, std::memory_order_acq_rel, std::memory_order_relaxed)) {
      begin = front ? f : std::max(f, b - step);
      end = front ? std::min(b, f + step) : b;
      return true;
    }
  }
}

// Runs body(begin, end, limit) over [0, n) in claims of at most `step` items; `limit` is where the claiming
// thread's own run of items ends (its share's end for the owner, `end` for a stolen claim), so a body may prefetch
// the items after `end` up to `limit`, which it will most likely take next. With one thread (or n <= step) the
// body runs once, over everything, on the caller's thread.
template <class Body>
void balanced_for(int64_t n, int64_t step, const Body& body) {
  if (n <= 0) return;
  step = std::max<int64_t>(1, step);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + step - 1) / step);
  if (threads <= 1 || at::in_parallel_region()) {
    body(0, n, n);
    return;
  }
  TORCH_CHECK(n < (int64_t{1} << 31), "balanced_for: too many items");
  std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t i = 0; i < threads; ++i) shares[i].ends.store(pack_ends(n * i / threads, n * (i + 1) / threads));
  // One index per thread of the team (parallel_for may give a thread several when the team is smaller).
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    int64_t begin = 0, end = 0;
    for (int64_t me = first; me < last; ++me) {
      const int64_t own_end = n * (me + 1) / threads;
      while (claim(shares[me], step, true, begin, end)) body(begin, end, own_end);
    }
    for (int64_t k = 1; k < threads; ++k) {
      Share& other = shares[(last - 1 + k) % threads];
      while (claim(other, step, false, begin, end)) body(begin, end, end);
    }
  });
}

}  // namespace radixserve_balanced
