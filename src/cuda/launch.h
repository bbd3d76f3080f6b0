#pragma once

// Launch shapes and the row addressing of the CUDA kernels, in plain C++ so
// that the CPU tests run the same code the device runs.

#include <cstddef>
#include <cstdint>

#include "moe_reroute/reroute.h"

#if defined(__CUDACC__)
#define MOE_REROUTE_HD __host__ __device__
#else
#define MOE_REROUTE_HD
#endif

namespace moe_reroute::cuda::detail {

inline constexpr int kOffsetsThreads = 1024;
inline constexpr int kMoveThreads = 256;
inline constexpr int kWarpSize = 32;
inline constexpr int kMoveUnroll = 4;
// One warp task moves at most this much of a token row: every lane keeps
// kMoveUnroll 16-byte loads in flight.
inline constexpr std::int64_t kSegmentBytes = kWarpSize * 16 * kMoveUnroll;
// Resident 256-thread blocks per SM (2048 threads) times the waves the
// grid-stride loop may cover before more blocks stop helping.
inline constexpr std::int64_t kMoveBlocksPerSm = 8 * 4;

/// a + b, saturated at cap (a, b in [0, cap]): associative, so a scan with it
/// is exact while partial sums stay below cap and never overflows otherwise.
MOE_REROUTE_HD inline std::int64_t saturating_add(std::int64_t a, std::int64_t b,
                                                  std::int64_t cap) {
  return a + b < cap ? a + b : cap;
}

/// Where every block (r, e) starts, for the side being written (out_begin)
/// and the side being read (in_begin); both tables are [N * E] with block
/// (r, e) at r * E + e. Blocks are grouped in output order: `num_outer`
/// groups at `outer_stride`, each of `num_inner` blocks at `inner_stride`.
struct BlockTables {
  const std::int64_t* out_begin = nullptr;
  const std::int64_t* in_begin = nullptr;
  std::int64_t num_outer = 0;
  std::int64_t outer_stride = 0;
  std::int64_t num_inner = 0;
  std::int64_t inner_stride = 0;
};

/// Forward: writes expert order (experts outer, ranks inner) reading rank
/// order; inverse: the other way round. rank_begin is the row-major exclusive
/// scan of the counts, expert_begin the column-major one.
BlockTables block_tables(Direction direction, const std::int64_t* rank_begin,
                         const std::int64_t* expert_begin, std::int64_t num_ranks,
                         std::int64_t num_experts);

/// The largest k in [0, count) with table[k * stride] <= row; table[0] <= row
/// and the keys are non-decreasing.
MOE_REROUTE_HD inline std::int64_t last_at_or_below(const std::int64_t* table, std::int64_t count,
                                                    std::int64_t stride, std::int64_t row) {
  std::int64_t lo = 0;
  std::int64_t hi = count - 1;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo + 1) / 2;
    if (table[mid * stride] <= row) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

/// The input row that output row `row` comes from (0 <= row < A, valid counts).
/// The last block at or below `row` in output order holds it, so zero-count
/// blocks, which share their begin with the next block, are skipped.
MOE_REROUTE_HD inline std::int64_t source_row(const BlockTables& tables, std::int64_t row) {
  const std::int64_t outer =
      last_at_or_below(tables.out_begin, tables.num_outer, tables.outer_stride, row);
  const std::int64_t* group = tables.out_begin + outer * tables.outer_stride;
  const std::int64_t inner = last_at_or_below(group, tables.num_inner, tables.inner_stride, row);
  const std::int64_t block = outer * tables.outer_stride + inner * tables.inner_stride;
  return tables.in_begin[block] + (row - tables.out_begin[block]);
}

/// How one warp copies n bytes from src to dst: `head` single bytes up to a
/// dst address aligned to `width`, then `words` accesses of `width` bytes
/// (src is aligned too: width is the widest power of two <= 16 that divides
/// dst - src), then `tail` single bytes.
struct RangeSplit {
  int width = 1;
  std::int64_t head = 0;
  std::int64_t words = 0;
  std::int64_t tail = 0;
};

MOE_REROUTE_HD inline RangeSplit split_range(std::uintptr_t dst, std::uintptr_t src,
                                             std::int64_t n) {
  const std::uintptr_t differ = dst ^ src;
  RangeSplit split;
  split.width = (differ & 15) == 0 ? 16 : (differ & 7) == 0 ? 8 : (differ & 3) == 0 ? 4
                : (differ & 1) == 0 ? 2 : 1;
  const auto mask = static_cast<std::uintptr_t>(split.width - 1);
  const auto to_aligned = static_cast<std::int64_t>((split.width - (dst & mask)) & mask);
  split.head = to_aligned < n ? to_aligned : n;
  split.words = (n - split.head) / split.width;
  split.tail = n - split.head - split.words * split.width;
  return split;
}

/// The move kernel's grid: one warp task per (row, segment of kSegmentBytes of
/// the token row); a task's segment 0 also moves the scale and weight rows and
/// the index entry. grid is 0 when there is nothing to move.
struct MoveLaunch {
  std::int64_t segments_per_row = 0;
  std::int64_t num_tasks = 0;
  std::int64_t grid = 0;
  int block = kMoveThreads;
  bool operator==(const MoveLaunch& other) const = default;
};

/// num_rows x token_row_bytes must fit in int64 (infer_reroute checks it).
MoveLaunch move_launch(std::int64_t num_rows, std::int64_t token_row_bytes, int num_sms);

}  // namespace moe_reroute::cuda::detail
