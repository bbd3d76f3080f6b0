#pragma once

// Launch shapes of the CUDA kernels and what they are sized from, in plain
// C++ so that the CPU tests check them.

#include <cstddef>
#include <cstdint>

#include "layout.h"

namespace moe_reroute::cuda::detail {

/// What a call's launch depends on about its device, queried once per device.
struct DeviceLimits {
  int num_sms = 0;
  std::size_t smem_per_sm = 0;
  std::size_t reserved_smem_per_block = 0;
  int fused_occupancy[2] = {
      0, 0};  // resident blocks per SM without shared memory: int32, int64 counts
  int move_occupancy = 0;
  bool programmatic_launch = false;  // sm_90 and up
};

/// Bytes of dynamic shared memory the fused kernel's tables take.
std::size_t fused_smem_bytes(std::int64_t num_ranks, std::int64_t num_experts);

/// The fused kernel's dynamic shared memory at most: the smallest opt-in
/// limit of the architectures built (sm_86 and sm_89: 99 KiB) less its
/// static scan scratch.
inline constexpr std::size_t kMaxFusedSmemBytes = 101376 - 2 * kWarpSize * 8;

/// One launch (tables in shared memory) or two (tables in the workspace):
/// one whenever N x E <= kMaxFusedBlocks and E <= 640, or the tables fit.
bool use_fused(std::int64_t num_ranks, std::int64_t num_experts);

/// Resident blocks per SM with `dynamic_smem` bytes each, from the occupancy
/// API's figure without shared memory and the SM's shared memory.
int blocks_per_sm(int occupancy, std::size_t dynamic_smem, const DeviceLimits& limits);

/// Tiles of at least kTileBytes (a multiple of 16) so that rows x tiles fit in int32.
TileShape tile_shape(std::int64_t output_rows, std::int64_t row_bytes);

/// The grid: enough warps for every tile and threads for every small task
/// of the largest call these shapes allow, at most what is resident at once.
std::int64_t grid_size(const TileShape& tiles, std::int64_t output_rows, std::int64_t small_tasks,
                       int blocks_per_sm, int num_sms);

/// The widest access (16, 8, 4, 2 or 1 bytes) that every row of a [rows,
/// row_bytes] move between these two bases allows.
int word_width(const void* src, const void* dst, std::int64_t row_bytes);

/// How a call is launched.
struct LaunchPlan {
  bool fused = true;  // one launch; else the tables kernel, then the move kernel
  bool int64_counts = false;
  TileShape tiles;
  std::int64_t grid = 1;
  std::size_t smem_bytes = 0;  // dynamic, of the fused kernel
  bool programmatic = false;   // the move kernel may start during the tables kernel
  bool operator==(const LaunchPlan& other) const = default;
};

/// The launch of a call with counts [N, E], output_rows rows of row_bytes
/// token bytes and at most max_small_tasks small tasks, on a device with `limits`.
LaunchPlan plan_launch(std::int64_t num_ranks, std::int64_t num_experts, bool int64_counts,
                       std::int64_t output_rows, std::int64_t row_bytes,
                       std::int64_t max_small_tasks, const DeviceLimits& limits);

/// Bytes before the tables in the workspace of the two-kernel path: the
/// Totals the tables kernel leaves for the move kernel.
inline constexpr std::size_t kTotalsBytes = 32;

}  // namespace moe_reroute::cuda::detail
