#include "launch.h"

#include <algorithm>
#include <string>

#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda {

std::size_t required_workspace_bytes(std::int64_t num_ranks, std::int64_t num_experts) {
  return detail::workspace_bytes(num_ranks, num_experts, detail::Path::kAuto);
}

std::string status_message(std::int32_t status) {
  std::string message;
  if (status & kStatusNegativeCount) {
    message = "expert_token_num_per_rank: some count is negative";
  }
  if (status & kStatusCountSumMismatch) {
    message += message.empty() ? "expert_token_num_per_rank: " : "; ";
    message += "the counts do not sum to the number of rows of tokens";
  }
  const auto add = [&message](const char* text) {
    message += message.empty() ? "" : "; ";
    message += text;
  };
  if (status & kStatusExpertIdOutOfRange) add("expert_idx: some id is outside [0, expert_num)");
  if (status & kStatusRowIndexOutOfRange) {
    add("expanded_row_idx: some row is below -1, -1 with drop_pad_mode 0 or 2, or not below "
        "E * C with drop_pad_mode 1 or 3");
  }
  if (status & kStatusBiasRowOutOfRange) add("expert_idx: some id is not a row of bias");
  constexpr std::int32_t kKnown = kStatusNegativeCount | kStatusCountSumMismatch |
                                  kStatusExpertIdOutOfRange | kStatusRowIndexOutOfRange |
                                  kStatusBiasRowOutOfRange;
  if (status & ~kKnown) add(("status: unknown bits in " + std::to_string(status)).c_str());
  return message;
}

namespace detail {

bool programmatic_launch(int binary_version, int ptx_version) {
  return binary_version >= kProgrammaticArch && ptx_version >= kProgrammaticArch;
}

bool streaming_stores(std::int64_t output_rows, std::int64_t row_bytes, std::size_t l2_bytes) {
  return 2 * output_rows * row_bytes > static_cast<std::int64_t>(l2_bytes);
}

std::size_t workspace_bytes(std::int64_t num_ranks, std::int64_t num_experts, Path path) {
  if (path == Path::kAuto && use_fused(num_ranks, num_experts)) return 0;
  return kTotalsBytes + fused_smem_bytes(num_ranks, num_experts);
}

std::size_t fused_smem_bytes(std::int64_t num_ranks, std::int64_t num_experts) {
  return static_cast<std::size_t>(table_words(num_ranks, num_experts)) * sizeof(std::int32_t);
}

bool use_fused(std::int64_t num_ranks, std::int64_t num_experts) {
  return num_ranks * num_experts <= kMaxFusedBlocks &&
         fused_smem_bytes(num_ranks, num_experts) <= kMaxFusedSmemBytes;
}

int blocks_per_sm(int occupancy, std::size_t dynamic_smem, const DeviceLimits& limits) {
  if (dynamic_smem == 0) return std::max(occupancy, 1);
  const auto by_smem =
      static_cast<int>(limits.smem_per_sm / (dynamic_smem + limits.reserved_smem_per_block));
  return std::max(1, std::min(occupancy, by_smem));
}

TileShape tile_shape(std::int64_t output_rows, std::int64_t row_bytes) {
  TileShape shape;
  shape.row_bytes = row_bytes;
  const std::int64_t max_tiles_per_row =
      std::max<std::int64_t>(1, kInt32Max / std::max<std::int64_t>(output_rows, 1));
  const std::int64_t tiles = (row_bytes + kTileBytes - 1) / kTileBytes;
  if (tiles <= max_tiles_per_row) {
    shape.tiles_per_row = static_cast<std::int32_t>(std::max<std::int64_t>(tiles, 1));
    return shape;
  }
  // Only past 2^31 tiles of 2 KiB (4 TiB): the tiles stay far below 2^31 bytes.
  const std::int64_t tile_bytes = (row_bytes + max_tiles_per_row - 1) / max_tiles_per_row;
  shape.tile_bytes = (tile_bytes + 15) / 16 * 16;
  shape.tiles_per_row =
      static_cast<std::int32_t>((row_bytes + shape.tile_bytes - 1) / shape.tile_bytes);
  return shape;
}

std::int64_t grid_size(const TileShape& tiles, std::int64_t output_rows, std::int64_t small_tasks,
                       int blocks_per_sm, int num_sms) {
  constexpr std::int64_t kWarpsPerBlock = kThreads / kWarpSize;
  const std::int64_t for_tiles =
      (output_rows * tiles.tiles_per_row + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const std::int64_t for_small = (small_tasks + kThreads - 1) / kThreads;
  const std::int64_t resident =
      static_cast<std::int64_t>(std::max(blocks_per_sm, 1)) * std::max(num_sms, 1);
  return std::clamp<std::int64_t>(std::max(for_tiles, for_small), 1, resident);
}

int word_width(const void* src, const void* dst, std::int64_t row_bytes) {
  const auto bits = reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst) |
                    static_cast<std::uintptr_t>(row_bytes);
  int width = 16;
  while (width > 1 && (bits & static_cast<std::uintptr_t>(width - 1)) != 0) width /= 2;
  return width;
}

LaunchPlan plan_launch(std::int64_t num_ranks, std::int64_t num_experts, bool int64_counts,
                       std::int64_t output_rows, std::int64_t row_bytes,
                       std::int64_t max_small_tasks, const DeviceLimits& limits, Path path) {
  LaunchPlan plan;
  plan.fused = path == Path::kAuto && use_fused(num_ranks, num_experts);
  plan.int64_counts = int64_counts;
  plan.tiles = tile_shape(output_rows, row_bytes);
  plan.smem_bytes = plan.fused ? fused_smem_bytes(num_ranks, num_experts) : 0;
  plan.programmatic = !plan.fused && limits.programmatic_launch;
  plan.streaming = streaming_stores(output_rows, row_bytes, limits.l2_bytes);
  const int occupancy =
      plan.fused ? limits.fused_occupancy[int64_counts ? 1 : 0] : limits.move_occupancy;
  plan.grid = grid_size(plan.tiles, output_rows, max_small_tasks,
                        blocks_per_sm(occupancy, plan.smem_bytes, limits), limits.num_sms);
  return plan;
}

}  // namespace detail
}  // namespace moe_reroute::cuda
