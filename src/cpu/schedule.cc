// The CPU backend's schedule of a plan: which rows each thread moves, in
// which chunks, and whether the stores go around the cache.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../plan_builder.h"

namespace moe_reroute {
namespace detail {
namespace {

// Below this many bytes per thread, starting another thread costs more than it
// saves; a larger threshold left calls of a few hundred KB on one thread.
constexpr std::int64_t kMinBytesPerThread = 64 * 1024;

}  // namespace

// The chunks: every run of rows in the order its destination rows are
// written (the forward's pad rows after each expert's blocks), cut into one
// contiguous destination row range per thread. Every row costs the same
// bytes, so equal row ranges are equal byte shares however skewed the counts.
// Flattened: GCC 12 otherwise calls out for each chunk's push_back, a large
// share of a small plan's time.
[[gnu::flatten]] void PlanBuilder::schedule(Plan& plan, int num_threads) {
  const bool forward = plan.direction_ == Direction::kForward;
  const std::int64_t rows = plan.num_written_rows();
  const std::int64_t total_bytes = rows * plan.bytes_per_row();
  plan.streaming_stores_ = 2 * total_bytes > last_level_cache_bytes();
  const std::int64_t requested = num_threads > 0 ? num_threads : hardware_threads();
  const std::int64_t useful = std::max<std::int64_t>(1, total_bytes / kMinBytesPerThread);
  const std::int64_t threads =
      std::max<std::int64_t>(1, std::min({requested, useful, std::max<std::int64_t>(rows, 1)}));
  const auto end_row = [rows, threads](std::int64_t t) {
    return rows / threads * (t + 1) + std::min<std::int64_t>(t + 1, rows % threads);
  };

  std::vector<Chunk>& chunks = plan.chunks_;
  std::vector<std::int64_t>& thread_begin = plan.thread_begin_;
  chunks.clear();
  chunks.reserve(plan.counts_.size() * (forward ? 2 : 1) + static_cast<std::size_t>(threads));
  thread_begin.reserve(static_cast<std::size_t>(threads) + 1);
  thread_begin.assign(1, 0);
  std::int64_t cut = end_row(0);  // the row the current thread's range ends before
  // The rare case of emit: a run that crosses `cut` is cut there, and the
  // next thread's range begins.
  const auto cross = [&](std::int64_t& src_row, std::int64_t& dst_row, std::int64_t& num_rows) {
    while (dst_row + num_rows > cut) {
      const std::int64_t run = cut - dst_row;
      if (run > 0) chunks.push_back({src_row, dst_row, run});
      if (src_row != kPadRows) src_row += run;
      dst_row = cut;
      num_rows -= run;
      thread_begin.push_back(static_cast<std::int64_t>(chunks.size()));
      cut = end_row(static_cast<std::int64_t>(thread_begin.size()) - 1);
    }
  };
  const auto emit = [&](std::int64_t src_row, std::int64_t dst_row, std::int64_t num_rows) {
    if (dst_row + num_rows > cut) cross(src_row, dst_row, num_rows);
    if (num_rows > 0) chunks.push_back({src_row, dst_row, num_rows});
  };
  // Locals, not members: the chunk stores would make the compiler reload these.
  const std::int64_t* counts = plan.counts_.data();
  const std::int64_t* src_offset = plan.src_offset_.data();
  const std::int64_t* dst_offset = plan.dst_offset_.data();
  const std::int64_t num_ranks = plan.num_ranks_;
  const std::int64_t num_experts = plan.num_experts_;
  if (forward) {
    for (std::int64_t e = 0; e < num_experts; ++e) {
      for (std::int64_t b = e; b < num_ranks * num_experts; b += num_experts) {
        emit(src_offset[b], dst_offset[b], counts[b]);
      }
      const std::int64_t last = (num_ranks - 1) * num_experts + e;
      const std::int64_t end = dst_offset[last] + counts[last];
      const std::int64_t segment_end =
          e + 1 < num_experts ? dst_offset[e + 1] : plan.num_padded_rows_;
      emit(kPadRows, end, segment_end - end);
    }
  } else {
    for (std::size_t b = 0; b < plan.counts_.size(); ++b) {
      emit(dst_offset[b], src_offset[b], counts[b]);
    }
  }
  // No rows: the one thread has no chunks.
  thread_begin.resize(static_cast<std::size_t>(threads) + 1,
                      static_cast<std::int64_t>(chunks.size()));
}

}  // namespace detail

int hardware_threads() { return std::max(1, omp_get_max_threads()); }

}  // namespace moe_reroute
