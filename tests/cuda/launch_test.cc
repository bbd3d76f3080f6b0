// The CUDA backend's host side on the CPU: launch shapes, the workspace,
// status messages and the validation that runs before any launch. None of it
// needs a GPU (the index math is in layout_test.cc).

#include "cuda/launch.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_reroute/cuda.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute::cuda {
namespace {

using detail::kTileBytes;

// An H200: 132 SMs, 228 KiB of shared memory per SM, 1 KiB reserved per block.
detail::DeviceLimits h200() {
  detail::DeviceLimits limits;
  limits.num_sms = 132;
  limits.smem_per_sm = 233472;
  limits.reserved_smem_per_block = 1024;
  limits.fused_occupancy[0] = limits.fused_occupancy[1] = 4;
  limits.move_occupancy = 4;
  limits.l2_bytes = 60 << 20;
  limits.programmatic_launch = true;
  return limits;
}

TEST(CudaLaunch, TilesAreTwoKibibytesUnlessTheTileCountPassesInt32) {
  const detail::TileShape decode = detail::tile_shape(256, 14336);  // bf16, H = 7168
  EXPECT_EQ(decode.tile_bytes, kTileBytes);
  EXPECT_EQ(decode.tiles_per_row, 7);
  EXPECT_EQ(detail::tile_shape(16384, 7168).tiles_per_row, 4);  // int8: 3.5 tiles
  EXPECT_EQ(detail::tile_shape(0, 1).tiles_per_row, 1);
  // 2^30 rows of 64 KiB would be 2^35 tiles: the tiles grow instead.
  const detail::TileShape huge = detail::tile_shape(std::int64_t{1} << 30, 65536);
  EXPECT_EQ(huge.tile_bytes % 16, 0);
  EXPECT_LE((std::int64_t{1} << 30) * huge.tiles_per_row, detail::kInt32Max);
  EXPECT_GE(huge.tiles_per_row * huge.tile_bytes, 65536);
}

TEST(CudaLaunch, GridCoversTheWorkUpToWhatIsResident) {
  const detail::DeviceLimits limits = h200();
  const detail::TileShape decode = detail::tile_shape(256, 14336);
  // 1792 tiles, 8 warps a block: 224 blocks, under 4 x 132 resident.
  EXPECT_EQ(detail::grid_size(decode, 256, 512, 4, limits.num_sms), 224);
  const detail::TileShape prefill = detail::tile_shape(163840, 14336);
  EXPECT_EQ(detail::grid_size(prefill, 163840, 327680, 4, limits.num_sms), 4 * 132);
  // Nothing to move still launches one block: it writes expert_token_num.
  EXPECT_EQ(detail::grid_size(detail::tile_shape(0, 16), 0, 0, 4, limits.num_sms), 1);
  // Only small tasks (R rows of -1 gather index): a thread each.
  EXPECT_EQ(detail::grid_size(detail::tile_shape(0, 16), 0, 2000, 4, limits.num_sms), 8);
}

TEST(CudaLaunch, SharedMemoryBoundsTheResidentBlocks) {
  const detail::DeviceLimits limits = h200();
  EXPECT_EQ(detail::blocks_per_sm(4, 0, limits), 4);
  EXPECT_EQ(detail::blocks_per_sm(4, detail::fused_smem_bytes(16, 16), limits), 4);
  EXPECT_EQ(detail::blocks_per_sm(4, detail::fused_smem_bytes(32, 32), limits), 4);
  // N x E = 8192: 96.5 KiB of tables, two blocks per SM.
  EXPECT_EQ(detail::blocks_per_sm(4, detail::fused_smem_bytes(64, 128), limits), 2);
  EXPECT_EQ(detail::blocks_per_sm(0, 0, limits), 1);
}

TEST(CudaLaunch, OneLaunchUpTo8192BlocksWithTheirTablesInSharedMemory) {
  EXPECT_TRUE(detail::use_fused(16, 16));
  EXPECT_TRUE(detail::use_fused(64, 128));
  EXPECT_TRUE(detail::use_fused(8192, 1));
  EXPECT_TRUE(detail::use_fused(16, 512));
  EXPECT_FALSE(detail::use_fused(1, 8192));  // E > 640: the tables pass 99 KiB
  EXPECT_FALSE(detail::use_fused(128, 65));
  EXPECT_LE(detail::fused_smem_bytes(8192, 1), detail::kMaxFusedSmemBytes);
}

TEST(CudaLaunch, SmallRowsUseTheWidestAccessEveryRowAllows) {
  alignas(16) static std::byte base[64];
  EXPECT_EQ(detail::word_width(base, base + 32, 224), 16);
  EXPECT_EQ(detail::word_width(base, base + 32, 4), 4);
  EXPECT_EQ(detail::word_width(base + 4, base + 32, 16), 4);
  EXPECT_EQ(detail::word_width(base, base + 32, 112), 16);
  EXPECT_EQ(detail::word_width(base, base + 8, 24), 8);
  EXPECT_EQ(detail::word_width(base + 1, base, 16), 1);
  EXPECT_EQ(detail::word_width(base, base, 6), 2);
}

TEST(CudaLaunch, PlansOneLaunchAtDecodeAndTwoPastTheFusedLimit) {
  const detail::DeviceLimits limits = h200();
  // Decode, bf16 H = 7168, 16 x 16 blocks: one launch of 224 blocks.
  const detail::LaunchPlan decode = detail::plan_launch(16, 16, false, 256, 14336, 256, limits);
  EXPECT_TRUE(decode.fused);
  EXPECT_FALSE(decode.programmatic);
  EXPECT_EQ(decode.grid, 224);
  EXPECT_EQ(decode.smem_bytes, detail::fused_smem_bytes(16, 16));
  EXPECT_EQ(decode.tiles, detail::tile_shape(256, 14336));
  // Prefill: every resident block, grid-strided.
  const detail::LaunchPlan prefill =
      detail::plan_launch(16, 16, true, 163840, 14336, 163840, limits);
  EXPECT_TRUE(prefill.int64_counts);
  EXPECT_EQ(prefill.grid, 4 * 132);
  // 300 x 400 blocks: the tables kernel, then the move kernel overlapping it.
  const detail::LaunchPlan split = detail::plan_launch(300, 400, false, 5000, 258, 5000, limits);
  EXPECT_FALSE(split.fused);
  EXPECT_TRUE(split.programmatic);
  EXPECT_EQ(split.smem_bytes, 0u);
  detail::DeviceLimits a100 = limits;
  a100.programmatic_launch = false;
  EXPECT_FALSE(detail::plan_launch(300, 400, false, 5000, 258, 5000, a100).programmatic);
}

TEST(CudaLaunch, TheTwoKernelPathRunsAtAnySizeWhenAskedFor) {
  const detail::DeviceLimits limits = h200();
  const detail::LaunchPlan split =
      detail::plan_launch(16, 16, false, 256, 14336, 256, limits, detail::Path::kTwoKernels);
  EXPECT_FALSE(split.fused);
  EXPECT_TRUE(split.programmatic);
  EXPECT_EQ(split.smem_bytes, 0u);
  EXPECT_EQ(detail::workspace_bytes(16, 16, detail::Path::kTwoKernels),
            detail::kTotalsBytes + (3 * 256 + 16) * 4u);
  EXPECT_EQ(detail::workspace_bytes(16, 16, detail::Path::kAuto), 0u);
  EXPECT_EQ(detail::workspace_bytes(300, 400, detail::Path::kAuto),
            detail::workspace_bytes(300, 400, detail::Path::kTwoKernels));
}

// The move kernel waits for the tables kernel only in code compiled for
// sm_90 and up: the decision follows the code the device runs, not the device.
TEST(CudaLaunch, ProgrammaticLaunchFollowsTheMoveKernelsCode) {
  EXPECT_TRUE(detail::programmatic_launch(90, 90));    // sm_90 SASS, or compute_90 PTX on sm_90
  EXPECT_TRUE(detail::programmatic_launch(100, 90));   // compute_90 PTX JIT-compiled on sm_100
  EXPECT_FALSE(detail::programmatic_launch(90, 80));   // compute_80 PTX JIT-compiled on sm_90
  EXPECT_FALSE(detail::programmatic_launch(120, 86));  // compute_86 PTX on sm_120
  EXPECT_FALSE(detail::programmatic_launch(80, 80));   // an A100
  EXPECT_FALSE(detail::programmatic_launch(86, 80));   // sm_80 SASS on sm_86
  EXPECT_EQ(detail::kProgrammaticArch, 90);
}

TEST(CudaLaunch, StreamingStoresOnlyWhereTheBytesPassTheL2) {
  const detail::DeviceLimits limits = h200();
  // Decode, bf16 H = 7168: 3.7 MB written stays in L2 for the grouped GEMM.
  EXPECT_FALSE(detail::streaming_stores(256, 14336, limits.l2_bytes));
  EXPECT_FALSE(detail::plan_launch(16, 16, false, 256, 14336, 256, limits).streaming);
  // Prefill: 235 MB written.
  EXPECT_TRUE(detail::streaming_stores(16384, 14336, limits.l2_bytes));
  EXPECT_TRUE(detail::plan_launch(16, 16, false, 16384, 14336, 16384, limits).streaming);
  // The edge: read and written together against the L2.
  EXPECT_FALSE(detail::streaming_stores(1, 1024, 2048));
  EXPECT_TRUE(detail::streaming_stores(1, 1025, 2048));
}

// Records which CUDA queries call_device makes.
struct DeviceQueries {
  bool capturing = false;
  int stream_device = 1;
  int asked_capturing = 0;
  int asked_device = 0;
  int device_of(const void* stream, int current) {
    return detail::call_device(
        stream, current,
        [this] {
          ++asked_capturing;
          return capturing;
        },
        [this] {
          ++asked_device;
          return stream_device;
        });
  }
};

TEST(CudaDevice, AStreamOfAnotherDeviceRunsThereOutsideCapture) {
  DeviceQueries q;
  int stream_object = 0;
  EXPECT_EQ(q.device_of(&stream_object, 0), 1);
  EXPECT_EQ(q.asked_capturing, 1);
  EXPECT_EQ(q.asked_device, 1);
}

// cudaStreamGetDevice would invalidate the capture: never asked then.
TEST(CudaDevice, ACapturingStreamIsNeverAskedForItsDevice) {
  DeviceQueries q;
  q.capturing = true;
  int stream_object = 0;
  EXPECT_EQ(q.device_of(&stream_object, 3), 3);
  EXPECT_EQ(q.asked_capturing, 1);
  EXPECT_EQ(q.asked_device, 0);
}

// The legacy (0 or 1) and per-thread (2) default streams are the current
// device's; asking whether the legacy stream captures fails while another
// stream captures in global mode, so neither question is asked.
TEST(CudaDevice, TheDefaultStreamsRunOnTheCurrentDevice) {
  for (const std::uintptr_t handle : {0, 1, 2}) {
    DeviceQueries q;
    EXPECT_EQ(q.device_of(reinterpret_cast<const void*>(handle), 2), 2);
    EXPECT_EQ(q.asked_capturing + q.asked_device, 0);
  }
}

TEST(CudaWorkspace, IsNeededOnlyPastTheFusedLimit) {
  EXPECT_EQ(required_workspace_bytes(1, 1), 0u);
  EXPECT_EQ(required_workspace_bytes(16, 16), 0u);
  EXPECT_EQ(required_workspace_bytes(8192, 1), 0u);
  // The Totals, then three int32 tables of the blocks and one of the experts.
  EXPECT_EQ(required_workspace_bytes(300, 400), detail::kTotalsBytes + (3 * 120000 + 400) * 4u);
  EXPECT_EQ(required_workspace_bytes(1, 8192), detail::kTotalsBytes + (4 * 8192) * 4u);
}

TEST(CudaStatus, MessagesNameTheArgument) {
  const std::string sum = "the counts do not sum to the number of rows of tokens";
  EXPECT_EQ(status_message(0), "");
  EXPECT_EQ(status_message(kStatusNegativeCount),
            "expert_token_num_per_rank: some count is negative");
  EXPECT_EQ(status_message(kStatusCountSumMismatch), "expert_token_num_per_rank: " + sum);
  EXPECT_EQ(status_message(kStatusNegativeCount | kStatusCountSumMismatch),
            "expert_token_num_per_rank: some count is negative; " + sum);
  EXPECT_EQ(status_message(64), "status: unknown bits in 64");
}

// Host buffers stand in for device memory: every call below must throw before
// anything is launched, so nothing is dereferenced.
class CudaValidation : public ::testing::Test {
 protected:
  static constexpr std::int64_t kRows = 6;
  static constexpr std::int64_t kHidden = 5;

  CudaValidation() : buffer_(1 << 16) {
    std::byte* next = buffer_.data();
    const auto take = [&next](std::size_t bytes) {
      std::byte* taken = next;
      next += (bytes + 63) / 64 * 64;
      return taken;
    };
    inputs_.tokens = TensorView(take(kRows * kHidden * 2), DType::kBFloat16, {kRows, kHidden});
    inputs_.expert_token_num_per_rank = TensorView(take(24), DType::kInt32, {2, 3});
    outputs_.permute_tokens =
        TensorView(take(kRows * kHidden * 2), DType::kBFloat16, {kRows, kHidden});
    outputs_.permute_per_token_scales = TensorView(take(kRows * 4), DType::kFloat32, {kRows});
    outputs_.permute_token_idx = TensorView(take(kRows * 4), DType::kInt32, {kRows});
    outputs_.expert_token_num = TensorView(take(12), DType::kInt32, {3});
    outputs_.permute_topk_weight = TensorView(nullptr, DType::kFloat32, {0});
    context_.status = reinterpret_cast<std::int32_t*>(take(4));
    context_.workspace = take(required_workspace_bytes(2, 3));
    context_.workspace_bytes = required_workspace_bytes(2, 3);
  }

  // Counts [100, 100]: the call needs a workspace of 120432 bytes.
  void use_many_blocks() {
    many_counts_.assign(100 * 100, 0);
    many_experts_.assign(100, 0);
    inputs_.expert_token_num_per_rank = TensorView(many_counts_.data(), DType::kInt32, {100, 100});
    outputs_.expert_token_num = TensorView(many_experts_.data(), DType::kInt32, {100});
    workspace_.assign(required_workspace_bytes(100, 100) / 8, 0);
    context_.workspace = workspace_.data();
    context_.workspace_bytes = required_workspace_bytes(100, 100);
  }

  void expect_error(const std::string& message) {
    try {
      moe_re_routing(inputs_, outputs_, {}, context_);
      ADD_FAILURE() << "no error, expected: " << message;
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()), message);
    }
  }

  std::vector<std::byte> buffer_;
  std::vector<std::int32_t> many_counts_, many_experts_;
  std::vector<std::int64_t> workspace_;
  RerouteInputs inputs_;
  RerouteOutputs outputs_;
  DeviceContext context_;
};

TEST_F(CudaValidation, RejectsBadShapesWithTheCoreMessages) {
  inputs_.tokens = TensorView(inputs_.tokens.data, DType::kBFloat16, {kRows * kHidden});
  expect_error("tokens: must be 2-D [A, H], got bfloat16[30]");
}

TEST_F(CudaValidation, RejectsAWrongOutputSpec) {
  outputs_.permute_token_idx = TensorView(outputs_.permute_token_idx.data, DType::kInt64, {kRows});
  expect_error("permute_token_idx: must be int32[6], got int64[6]");
}

// Past the fused limit the tables go to the workspace.
TEST_F(CudaValidation, RejectsASmallWorkspace) {
  use_many_blocks();
  context_.workspace_bytes = 120431;
  expect_error("workspace: counts [100, 100] need 120432 bytes, got 120431");
}

TEST_F(CudaValidation, RejectsANullStatusWord) {
  context_.status = nullptr;
  expect_error("status: data is null");
}

TEST_F(CudaValidation, RejectsAMisalignedStatusWordOrWorkspace) {
  context_.status =
      reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(context_.status) + 2);
  expect_error("status: data must be 4-byte aligned for the CUDA backend");
  context_.status =
      reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(context_.status) - 2);
  context_.workspace = static_cast<std::byte*>(context_.workspace) + 4;
  expect_error("workspace: data must be 8-byte aligned for the CUDA backend");
}

TEST_F(CudaValidation, RejectsAWorkspaceOverlappingATensor) {
  use_many_blocks();
  context_.workspace = inputs_.tokens.data;
  expect_error("workspace: overlaps input tokens");
}

TEST_F(CudaValidation, RejectsMisalignedIntegerViews) {
  outputs_.permute_token_idx.data = static_cast<std::byte*>(outputs_.permute_token_idx.data) + 1;
  expect_error("permute_token_idx: data must be 4-byte aligned for the CUDA backend");
}

TEST_F(CudaValidation, InverseRejectsMissingOptionalOutputs) {
  std::vector<float> scales(kRows);
  InverseInputs inputs{inputs_.tokens, inputs_.expert_token_num_per_rank,
                       TensorView(scales.data(), DType::kFloat32, {kRows}), std::nullopt};
  InverseOutputs outputs{outputs_.permute_tokens, std::nullopt, std::nullopt};
  try {
    moe_re_routing_inverse(inputs, outputs, {}, context_);
    ADD_FAILURE() << "no error";
  } catch (const Error& error) {
    EXPECT_EQ(std::string(error.what()),
              "restored_per_token_scales: must be given exactly when per_token_scales is");
  }
}

// Rule 7's refused pairings (docs/spec.md), written out here: the CUDA host
// checks refuse each, naming per_token_scales, before anything is launched.
TEST_F(CudaValidation, RefusesEveryPairingTheTableRefuses) {
  struct Refused {
    DType tokens;
    DType scales;
    Shape tail;  // the dims after A
  };
  const Shape ak2{1, 2};
  std::vector<Refused> refused;
  for (const DType plain : {DType::kFloat16, DType::kBFloat16, DType::kInt8, DType::kHiFloat8,
                            DType::kFloat32, DType::kUInt8}) {
    refused.push_back({plain, DType::kFloat32, ak2});
    for (const Shape& tail : {Shape{}, Shape{3}, ak2})
      refused.push_back({plain, DType::kFloat8E8M0, tail});
  }
  for (const DType fp4 : {DType::kFloat4E2M1, DType::kFloat4E1M2}) {
    refused.push_back({fp4, DType::kFloat32, ak2});
    refused.push_back({fp4, DType::kFloat8E8M0, ak2});
  }
  ASSERT_EQ(refused.size(), 28u);
  std::vector<std::byte> scales(kRows * 16);
  for (const Refused& r : refused) {
    Shape shape{kRows};
    for (int d = 0; d < r.tail.ndim; ++d)
      shape.dims[static_cast<std::size_t>(shape.ndim++)] = r.tail[d];
    inputs_.tokens = TensorView(inputs_.tokens.data, r.tokens, {kRows, 4});
    outputs_.permute_tokens = TensorView(outputs_.permute_tokens.data, r.tokens, {kRows, 4});
    inputs_.per_token_scales = TensorView(scales.data(), r.scales, shape);
    outputs_.permute_per_token_scales =
        TensorView(outputs_.permute_per_token_scales.data, r.scales, shape);
    try {
      moe_re_routing(inputs_, outputs_, {}, context_);
      ADD_FAILURE() << "no error for " << dtype_name(r.tokens) << " tokens with "
                    << inputs_.per_token_scales->spec.to_string();
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()).rfind("per_token_scales: ", 0), 0u) << error.what();
      EXPECT_NE(std::string(error.what()).find(std::string(dtype_name(r.tokens)) + " tokens"),
                std::string::npos)
          << error.what();
    }
  }
}

}  // namespace
}  // namespace moe_reroute::cuda
