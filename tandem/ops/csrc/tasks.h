// Work shared out to torch's OpenMP threads so that a thread that loses its core for a while
// does not hold up the others.
#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem {

// One thread's share of the chunks, [first, end) of those not yet claimed, in one word so that
// its owner (from the front) and a thief (from the back) claim each chunk once; a line each, so
// that claims on two shares never contend.
struct alignas(64) Share {
  std::atomic<uint64_t> range{0};  // first in the low 32 bits, end in the high ones

  void set(int64_t first, int64_t end) {
    range.store(static_cast<uint64_t>(end) << 32 | static_cast<uint64_t>(first));
  }
  // The first unclaimed chunk (`from_back` false) or the last one, now claimed; -1 if none.
  int64_t claim(bool from_back) {
    uint64_t r = range.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t first = r & 0xffffffffu, end = r >> 32;
      if (first >= end) return -1;
      const uint64_t rest = from_back ? (end - 1) << 32 | first : end << 32 | (first + 1);
      if (range.compare_exchange_weak(r, rest, std::memory_order_relaxed))
        return static_cast<int64_t>(from_back ? end - 1 : first);
    }
  }
};

// Calls f(begin, end) over [0, n) in chunks of up to `grain` items, each chunk exactly once, on
// torch's threads. Each thread walks its own contiguous share from the front (one stream
// through memory, as a static split gives), then takes chunks from the back of the others'
// shares, where their owners would come last. Why: on a CPU the host's thread, the front end
// and the client share the cores the step computes on, and a static split waits at its end for
// a thread that lost its core for a moment; here the threads still running take over that
// thread's unclaimed chunks. Which thread computes a chunk never changes its arithmetic.
template <typename F>
void parallel_chunks(int64_t n, int64_t grain, const F& f) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t chunks = (n + grain - 1) / grain;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  auto chunk = [&](int64_t c) { f(c * grain, std::min(n, (c + 1) * grain)); };
  if (threads <= 1 || omp_in_parallel()) {
    for (int64_t c = 0; c < chunks; ++c) chunk(c);
    return;
  }
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t)
    shares[t].set(chunks * t / threads, chunks * (t + 1) / threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t me = omp_get_thread_num();
    for (int64_t i = 0; i < threads; ++i) {
      Share& share = shares[(me + i) % threads];
      for (int64_t c; (c = share.claim(/*from_back=*/i > 0)) >= 0;) chunk(c);
    }
  }
}

}  // namespace tandem
