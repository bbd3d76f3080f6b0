#pragma once

// The two launches of a call: the offsets (one block: validate and scan the
// counts, write the status word and expert_token_num) and the row move.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "launch.h"
#include "moe_reroute/dtype.h"

namespace moe_reroute::cuda::detail {

struct OffsetsParams {
  const void* counts = nullptr;  // [N, E] int32 or int64, device
  DType count_dtype = DType::kInt32;
  std::int64_t num_ranks = 0;
  std::int64_t num_experts = 0;
  std::int64_t num_tokens = 0;
  std::int64_t* rank_begin = nullptr;    // workspace [N * E]
  std::int64_t* expert_begin = nullptr;  // workspace [N * E]
  void* expert_token_num = nullptr;      // [E] of count_dtype; null for the inverse
  bool cumsum = false;
  std::int32_t* status = nullptr;
};

/// One tensor's rows: dst row i gets src row source_row(i); a null src
/// zero-fills, a null dst moves nothing.
struct RowMove {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::int64_t row_bytes = 0;
};

struct MoveParams {
  BlockTables tables;
  RowMove tokens;
  RowMove scales;
  RowMove weight;
  std::int32_t* index = nullptr;  // permute_token_idx; null for the inverse
  bool gather = true;
  std::int64_t segments_per_row = 0;
  std::int64_t num_tasks = 0;
  const std::int32_t* status = nullptr;
};

/// Enqueues the offsets kernel on `stream`; returns the launch error.
cudaError_t launch_offsets(const OffsetsParams& params, cudaStream_t stream);

/// Enqueues the move kernel with grid `launch` on `stream` (nothing when the
/// grid is empty); it moves nothing unless the status word is 0.
cudaError_t launch_move(const MoveParams& params, const MoveLaunch& launch, cudaStream_t stream);

}  // namespace moe_reroute::cuda::detail
