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
  std::size_t l2_bytes = 0;
  bool programmatic_launch = false;  // programmatic_launch() of the move kernel's code
};

/// The least sm_XY (10 * X + Y) whose code of the move kernel waits for the
/// tables kernel's grid (cudaGridDependencySynchronize in kernels.cu).
inline constexpr int kProgrammaticArch = 90;

/// Whether the move kernel may start during the tables kernel: only where the
/// code the device runs for it (cudaFuncGetAttributes) was compiled for
/// kProgrammaticArch or later. The device's own capability does not decide:
/// compute_80 PTX JIT-compiled for an sm_90 device runs there without the wait.
bool programmatic_launch(int binary_version, int ptx_version);

/// Whether token rows are written with evict-first (.cs) stores: only where
/// the bytes a call reads and writes pass the L2, so that a decode-sized
/// output stays in L2 for the grouped GEMM that reads it next.
bool streaming_stores(std::int64_t output_rows, std::int64_t row_bytes, std::size_t l2_bytes);

/// The device a call on `stream` (a cudaStream_t) runs on. The legacy and the
/// per-thread default stream (handles 0, 1 and 2) are the current device's. A
/// stream being captured is not asked (cudaStreamGetDevice is refused during
/// capture on CUDA 13.0 with driver 580 and invalidates it): the current
/// device runs the call, as the caller's device guard set it. Any other stream
/// is asked for its device.
template <typename IsCapturing, typename StreamDevice>
int call_device(const void* stream, int current, IsCapturing is_capturing,
                StreamDevice stream_device) {
  if (reinterpret_cast<std::uintptr_t>(stream) <= 2 || is_capturing()) return current;
  return stream_device();
}

/// Which kernels run a call: one launch where use_fused says so, or the
/// tables kernel and the move kernel at any size (for the benchmark's
/// one-launch / two-launch comparison and the tests of the two-kernel path).
enum class Path { kAuto, kTwoKernels };

/// Device workspace bytes of a call with counts [N, E] on `path`.
std::size_t workspace_bytes(std::int64_t num_ranks, std::int64_t num_experts, Path path);

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
  bool streaming = false;      // token rows go out with evict-first stores
  bool operator==(const LaunchPlan& other) const = default;
};

/// The launch of a call with counts [N, E], output_rows rows of row_bytes
/// token bytes and at most max_small_tasks small tasks, on a device with `limits`.
LaunchPlan plan_launch(std::int64_t num_ranks, std::int64_t num_experts, bool int64_counts,
                       std::int64_t output_rows, std::int64_t row_bytes,
                       std::int64_t max_small_tasks, const DeviceLimits& limits,
                       Path path = Path::kAuto);

/// Bytes before the tables in the workspace of the two-kernel path: the
/// Totals the tables kernel leaves for the move kernel.
inline constexpr std::size_t kTotalsBytes = 32;

}  // namespace moe_reroute::cuda::detail
