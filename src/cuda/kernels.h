#pragma once

// The kernels of a call: one fused launch (each CTA builds the tables in its
// shared memory, then moves its share of the rows) or, past kMaxFusedBlocks
// blocks, a tables kernel writing the workspace and a move kernel launched
// after it with programmatic dependent launch.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "launch.h"

namespace moe_reroute::cuda::detail {

/// One tensor's rows: dst row i gets src row src_row(i), `words` accesses
/// of `width` bytes (the small rows; the token rows go by tiles); a null src
/// zero-fills, a null dst moves nothing.
struct RowMove {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::int64_t row_bytes = 0;
  int width = 1;
  std::int32_t words = 0;
};

struct KernelParams {
  Layout layout;
  const void* counts = nullptr;  // [N, E] int32 or int64
  TileShape tiles;               // of the token rows
  RowMove tokens;
  RowMove scales;
  RowMove weight;
  IndexMode index;
  std::int32_t* index_data = nullptr;  // permute_token_idx
  void* expert_token_num = nullptr;    // [E] of the counts dtype; null for the inverse
  bool cumsum = false;
  bool streaming = false;  // evict-first stores of the token rows (LaunchPlan::streaming)
  std::int32_t* status = nullptr;
  void* workspace = nullptr;  // the two-kernel path: Totals, then the tables
};

/// Occupancy, cache and shared-memory limits of `device`, which must be the
/// current device, and whether its code of the move kernel waits for the
/// tables kernel (programmatic_launch); also raises the fused kernels'
/// dynamic shared-memory limit there.
cudaError_t query_limits(int device, DeviceLimits& limits);

/// Enqueues the call on `stream`; returns the launch error.
cudaError_t launch(const KernelParams& params, const LaunchPlan& plan, cudaStream_t stream);

}  // namespace moe_reroute::cuda::detail
