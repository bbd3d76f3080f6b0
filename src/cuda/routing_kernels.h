#pragma once

// The kernels of moe_init_routing and moe_finalize_routing on CUDA, and the
// workspace they share with the host, in plain C++ so that the CPU tests
// check its layout.
//
// Init is a counting sort made stable by giving each warp a chunk of
// positions it walks in order: the ids are checked and counted per chunk,
// one block scans the counts (expert-major, chunk-minor) into where each
// chunk's pairs of each expert begin, the warps walk their chunks again to
// place each pair, and last the rows move. Finalize checks the row indices,
// then sums each token's rows. A check that fails sets the call's flag in
// the workspace (zeroed by the call's first operation) and a status bit; the
// kernels after it read the flag and write nothing.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace moe_reroute::cuda::detail {

/// Status bits the routing kernels OR into the status word (mirror cuda.h's
/// StatusBit, which needs the build's export header).
inline constexpr std::int32_t kBitExpertId = 4;
inline constexpr std::int32_t kBitRowIndex = 8;
inline constexpr std::int32_t kBitBiasRow = 16;

/// Bytes of the call's flag at the start of the workspace (16: what follows
/// stays 16-byte aligned).
inline constexpr std::size_t kFlagBytes = 16;

/// Where init's tables lie in the workspace (byte offsets) and how the
/// positions are split into chunks, one warp each.
struct InitRoutingWorkspace {
  std::int64_t chunk = 0;       // positions a warp walks
  std::int64_t num_chunks = 0;  // ceil(positions / chunk)
  std::size_t begins = 0;       // [E] int32: where each expert's rows begin
  std::size_t table = 0;        // [num_chunks, E] int32: each chunk's pairs per expert
  std::size_t source = 0;       // [rows] int32: x's row of each row of expanded_x, or -1
  std::size_t bytes = 0;        // the whole workspace
  bool operator==(const InitRoutingWorkspace& other) const = default;
};

/// The workspace of T * k = `positions` pairs, E = `expert_num` >= 1 and
/// `expanded_rows` rows of expanded_x (n, or E * C). A chunk is at least
/// E / 4 positions, so the table holds at most about 4 * positions + E ints.
InitRoutingWorkspace init_routing_workspace(std::int64_t positions, std::int64_t expert_num,
                                            std::int64_t expanded_rows);

struct InitRoutingParams {
  const std::byte* x = nullptr;
  std::byte* expanded_x = nullptr;
  std::int64_t row_bytes = 0;
  int width = 1;  // bytes per access: 16, 8, 4, 2 or 1, as every row allows
  const void* expert_idx = nullptr;
  bool int64_ids = false;
  std::int64_t positions = 0;  // T * k
  std::int64_t top_k = 1;
  std::int32_t expert_num = 1;
  std::int64_t expanded_rows = 0;  // n (dropless) or E * C
  std::int32_t capacity = 0;       // C with drop_pad_mode 1; 0: dropless
  std::int32_t* expanded_row_idx = nullptr;
  std::int32_t* count_or_cumsum = nullptr;  // null: not produced
  bool cumsum = false;
  std::int32_t* before_capacity = nullptr;  // null: not produced
  std::int32_t* status = nullptr;
  std::byte* workspace = nullptr;
  InitRoutingWorkspace layout;
};

/// Enqueues a moe_init_routing call on `stream`; returns the first error.
cudaError_t launch_init_routing(const InitRoutingParams& params, cudaStream_t stream);

enum class FloatKind { kFloat16, kBFloat16, kFloat32 };

struct FinalizeRoutingParams {
  FloatKind dtype = FloatKind::kFloat32;         // expanded_x, x1, x2, bias, out
  FloatKind scales_dtype = FloatKind::kFloat32;  // float32 beside any dtype, or dtype's
  const void* expanded_x = nullptr;
  std::int64_t expanded_rows = 0;  // R, or E * C
  const std::int32_t* expanded_row_idx = nullptr;
  const void* x1 = nullptr;
  const void* x2 = nullptr;
  const void* bias = nullptr;
  std::int64_t bias_rows = 0;
  const void* scales = nullptr;
  const std::int32_t* expert_idx = nullptr;
  void* out = nullptr;
  std::int64_t num_tokens = 0;  // T
  std::int64_t top_k = 1;
  std::int64_t hidden = 1;
  bool row_major = false;  // drop_pad_mode 2, 3: the row of (t, j) at t * k + j
  bool capacity = false;   // drop_pad_mode 1, 3: -1 is a dropped pair
  std::int32_t* status = nullptr;
  std::byte* workspace = nullptr;  // the call's flag
};

/// Enqueues a moe_finalize_routing call on `stream`; returns the first error.
cudaError_t launch_finalize_routing(const FinalizeRoutingParams& params, cudaStream_t stream);

}  // namespace moe_reroute::cuda::detail
