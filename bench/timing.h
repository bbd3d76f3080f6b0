#pragma once

// What the CPU benchmarks share: timing in interleaved rounds, the plain
// copy they are measured against, and the machine's facts beside a table.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "moe_reroute/reroute.h"

namespace moe_reroute::bench {

using Clock = std::chrono::steady_clock;
using Contenders = std::vector<std::function<void()>>;

inline double seconds(const std::function<void()>& body) {
  const Clock::time_point start = Clock::now();
  body();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

inline double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

// Median seconds of each contender over `repeat` rounds. Each round times every
// contender once, so drift hits them alike; each timed call follows an untimed
// one of the same contender, so each finds the caches as its own previous call
// left them, not as a rival's did. The order rotates from round to round: in a
// fixed order the contender after the 1-thread gather measured 9 us slower at
// decode size (14%, on the Zen 3 VM), whichever it was.
inline std::vector<double> interleaved_medians(const Contenders& contenders, int repeat) {
  const std::size_t n = contenders.size();
  std::vector<std::vector<double>> times(n);
  for (int r = 0; r < repeat; ++r) {
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t c = (i + static_cast<std::size_t>(r)) % n;
      contenders[c]();
      times[c].push_back(seconds(contenders[c]));
    }
  }
  std::vector<double> medians;
  for (const auto& t : times) medians.push_back(median(t));
  return medians;
}

// Runs body(t) for every t in [0, num_threads), one OpenMP thread each, as
// the operator runs its plan: one thread runs inline, with no parallel region.
inline void for_each_thread(int num_threads, const std::function<void(int)>& body) {
  // libgomp's region costs a futex syscall even for a team of one.
  if (num_threads <= 1) {
    body(0);
    return;
  }
#pragma omp parallel for num_threads(num_threads) schedule(static, 1)
  for (int t = 0; t < num_threads; ++t) body(t);
}

// Runs body(begin, end) on `num_threads` threads over equal contiguous slices
// of [0, bytes), one each.
template <typename Body>
void for_each_slice(std::size_t bytes, int num_threads, const Body& body) {
  const std::size_t threads = static_cast<std::size_t>(std::max(1, num_threads));
  for_each_thread(num_threads, [&](int thread) {
    const auto t = static_cast<std::size_t>(thread);
    body(bytes / threads * t + std::min(t, bytes % threads),
         bytes / threads * (t + 1) + std::min(t + 1, bytes % threads));
  });
}

// The physical limit the operator is measured against: a plain copy of the
// same bytes with the same threads, one contiguous slice each.
inline void parallel_copy(void* dst, const void* src, std::size_t bytes, int num_threads) {
  for_each_slice(bytes, num_threads, [&](std::size_t begin, std::size_t end) {
    std::memcpy(static_cast<std::byte*>(dst) + begin, static_cast<const std::byte*>(src) + begin,
                end - begin);
  });
}

inline double load_average() {
  double load = 0.0;
  return getloadavg(&load, 1) == 1 ? load : 0.0;
}

// The processor's name from /proc/cpuinfo ("model name"), or "an unnamed CPU":
// the same VM image runs on different hosts, and the tables depend on it.
inline std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  const std::string key = "model name";
  for (std::string line; std::getline(cpuinfo, line);) {
    const std::size_t colon = line.find(':');
    if (line.starts_with(key) && colon != std::string::npos && colon + 2 <= line.size()) {
      return line.substr(colon + 2);
    }
  }
  return "an unnamed CPU";
}

// The load beside the machine's name: other processes on the cores stall
// every fork and join of a threaded call.
inline void print_load(double start_load) {
  const int threads = hardware_threads();
  std::printf("\nload average %.2f at the start, %.2f at the end, on %d hardware threads of %s%s\n",
              start_load, load_average(), threads, cpu_model().c_str(),
              start_load > 0.5 * threads
                  ? ": other processes shared the cores, the times are not trustworthy"
                  : "");
}

}  // namespace moe_reroute::bench
