#include "launch.h"

#include <algorithm>
#include <limits>
#include <string>

#include "moe_reroute/cuda.h"

namespace moe_reroute::cuda {

std::size_t required_workspace_bytes(std::int64_t num_ranks, std::int64_t num_experts) {
  return 2 * static_cast<std::size_t>(num_ranks) * static_cast<std::size_t>(num_experts) *
         sizeof(std::int64_t);
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
  if (status & ~(kStatusNegativeCount | kStatusCountSumMismatch)) {
    message += message.empty() ? "" : "; ";
    message += "status: unknown bits in " + std::to_string(status);
  }
  return message;
}

namespace detail {

BlockTables block_tables(Direction direction, const std::int64_t* rank_begin,
                         const std::int64_t* expert_begin, std::int64_t num_ranks,
                         std::int64_t num_experts) {
  if (direction == Direction::kForward) {
    return {expert_begin, rank_begin, num_experts, 1, num_ranks, num_experts};
  }
  return {rank_begin, expert_begin, num_ranks, num_experts, num_experts, 1};
}

MoveLaunch move_launch(std::int64_t num_rows, std::int64_t token_row_bytes, int num_sms) {
  MoveLaunch launch;
  launch.segments_per_row = std::max<std::int64_t>(1, (token_row_bytes + kSegmentBytes - 1) /
                                                          kSegmentBytes);
  // At most one task per row plus one per kSegmentBytes of tokens: fits in
  // int64 because the plan checked that the token bytes do.
  launch.num_tasks = num_rows * launch.segments_per_row;
  const std::int64_t warps_per_block = kMoveThreads / kWarpSize;
  const std::int64_t needed = (launch.num_tasks + warps_per_block - 1) / warps_per_block;
  const std::int64_t useful = std::max(1, num_sms) * kMoveBlocksPerSm;
  launch.grid = std::min({needed, useful,
                          static_cast<std::int64_t>(std::numeric_limits<std::int32_t>::max())});
  return launch;
}

}  // namespace detail
}  // namespace moe_reroute::cuda
