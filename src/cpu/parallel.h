#pragma once

// The CPU backend's one way to run work on several threads.

#include <pthread.h>

#include <atomic>

namespace moe_reroute::detail {

// Whether this process is a fork() child of one that had run a parallel
// region: GNU OpenMP's next region hangs there (the team's threads were not
// forked), so such a child runs every slice on its one thread.
inline std::atomic<bool> forked_after_parallel{false};

/// Runs body(t) for t in [0, num_threads), one thread each.
template <typename Body>
void run_threads(int num_threads, const Body& body) {
  // One thread runs here: libgomp's region costs a futex syscall even for a
  // team of one (an `if` clause keeps the region).
  if (num_threads == 1 || forked_after_parallel.load(std::memory_order_relaxed)) {
    for (int t = 0; t < num_threads; ++t) body(t);
    return;
  }
  // Registered by the first region: a child forked before it can use OpenMP.
  [[maybe_unused]] static const int registered =
      pthread_atfork(nullptr, nullptr, [] { forked_after_parallel.store(true); });
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
  for (int t = 0; t < num_threads; ++t) body(t);
}

}  // namespace moe_reroute::detail
