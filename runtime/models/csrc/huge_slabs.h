// Memory for packed weights (quantized and bfloat16): consecutive in 2 MB-aligned slabs advised for transparent
// huge pages.
//
// A one-row decode step streams every weight once, so it takes a TLB miss every 4 KB where a weight sits on 4 KB
// pages, and the hardware prefetchers stop at each 4 KB boundary. A weight allocated on its own (torch::empty:
// page-aligned at best) can use 2 MB pages only for the aligned 2 MB runs inside it, none at all for one smaller
// than 4 MB in the worst case: the 1B Llama's 2.4 MB o projections (Q4_K) were ~half on 4 KB pages. Weights here
// sit back to back in slabs whose every 2 MB page can be a huge one: a 2.4 MB Q4_K product at one row, 16 of them
// one after another from memory, took 90 us each instead of 109 (2-core AMD EPYC Zen 4, docs/benchmarks.md).
//
// Invariants: a slab is mapped (never moved) until its last tensor is freed and it is no longer the slab new
// tensors go to; the current slab, once no tensor is left in it, hands out from its start again; a tensor never
// spans two slabs; tensors start on a cache line (the packed layouts keep their loads within lines). Memory a slab
// never hands out is never touched, so it costs address space, not RAM; what a huge page can waste is the unused
// part of the one page at a slab's end. Where the kernel has no transparent huge pages (or refuses the advice) the
// slabs are ordinary pages and nothing else changes.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include <sys/mman.h>

namespace radixserve_huge_slabs {

constexpr int64_t HUGE = int64_t{2} << 20, SLAB = int64_t{64} << 20, LINE = 64;

struct Slab {
  uint8_t* base;
  int64_t size;
  int64_t used = 0;
  int64_t refs = 1;  // one per live tensor, plus one while it is the current slab
};

class Slabs {
 public:
  // An uninitialized uint8 tensor of `bytes` in the current slab, or in a new one when it does not fit.
  torch::Tensor empty(int64_t rows, int64_t cols) {
    const int64_t bytes = rows * cols;
    Slab* slab;
    uint8_t* p;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (current_ == nullptr || current_->used + bytes > current_->size) {
        Slab* fresh = map(std::max(SLAB, (bytes + HUGE - 1) / HUGE * HUGE));
        if (fresh == nullptr) return torch::empty({rows, cols}, torch::dtype(torch::kUInt8));
        Slab* old = current_;  // (no longer current when released: unmapped if no tensor is left in it)
        current_ = fresh;
        if (old != nullptr) release_locked(old);
      }
      slab = current_;
      p = slab->base + slab->used;
      slab->used = (slab->used + bytes + LINE - 1) / LINE * LINE;
      ++slab->refs;
    }
    return torch::from_blob(p, {rows, cols}, [this, slab](void*) { release(slab); },
                            torch::dtype(torch::kUInt8));
  }

 private:
  static Slab* map(int64_t size) {
    // Over-map by one huge page, then unmap the ends so that the slab starts on a 2 MB boundary.
    void* raw = mmap(nullptr, size + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw), aligned = (start + HUGE - 1) & ~uintptr_t(HUGE - 1);
    if (aligned > start) munmap(raw, aligned - start);
    const uintptr_t end = start + size + HUGE, used_end = aligned + size;
    if (end > used_end) munmap(reinterpret_cast<void*>(used_end), end - used_end);
#ifdef MADV_HUGEPAGE
    madvise(reinterpret_cast<void*>(aligned), size, MADV_HUGEPAGE);
#endif
    return new Slab{reinterpret_cast<uint8_t*>(aligned), size};
  }

  void release(Slab* slab) {
    std::lock_guard<std::mutex> lock(mu_);
    release_locked(slab);
  }

  void release_locked(Slab* slab) {
    // The current slab with no tensor left in it is handed out again from its start (the weights a start-up
    // measurement packed, then freed, leave no hole that the model's weights skip).
    if (--slab->refs == 1 && slab == current_) slab->used = 0;
    if (slab->refs > 0) return;
    munmap(slab->base, slab->size);
    delete slab;
  }

  std::mutex mu_;
  Slab* current_ = nullptr;
};

// The process's slabs (never destroyed: tensors may outlive static destruction at exit).
inline Slabs& slabs() {
  static Slabs* s = new Slabs();
  return *s;
}

}  // namespace radixserve_huge_slabs
