// The host side of moe_init_routing and moe_finalize_routing on CUDA, on the
// CPU: the workspace, the status messages of their bits and every refusal
// before a launch. Host buffers stand in for device memory: a refused call
// throws before CUDA is asked anything (without a GPU, a call that got that
// far would throw ErrorCode::kBackend instead).

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/routing_kernels.h"
#include "moe_reroute/cuda.h"
#include "moe_reroute/routing.h"

namespace moe_reroute::cuda {
namespace {

TEST(CudaRoutingWorkspace, ChunksOfAtLeastAQuarterOfTheExperts) {
  // T = 4096, k = 8, E = 256: 128 positions a warp, 256 chunks.
  const detail::InitRoutingWorkspace prefill = detail::init_routing_workspace(32768, 256, 32768);
  EXPECT_EQ(prefill.chunk, 128);
  EXPECT_EQ(prefill.num_chunks, 256);
  EXPECT_EQ(prefill.begins, detail::kFlagBytes);
  EXPECT_EQ(prefill.table, 16u + 256 * 4);
  EXPECT_EQ(prefill.source, prefill.table + 256 * 256 * 4);
  EXPECT_EQ(prefill.bytes, prefill.source + 32768 * 4);
  // E = 4096: chunks of 1024 keep the table near the positions.
  EXPECT_EQ(detail::init_routing_workspace(32768, 4096, 32768).chunk, 1024);
  // No position: no chunk, the begins still hold E.
  const detail::InitRoutingWorkspace empty = detail::init_routing_workspace(0, 1, 0);
  EXPECT_EQ(empty.num_chunks, 0);
  EXPECT_EQ(empty.bytes, 32u);
}

TEST(CudaRoutingWorkspace, TablesAreBoundedAndAligned) {
  for (const std::int64_t positions : {0, 1, 31, 32, 127, 128, 129, 5000, 1 << 20}) {
    for (const std::int64_t experts : {1, 3, 64, 257, 4096, 1 << 20}) {
      const detail::InitRoutingWorkspace w =
          detail::init_routing_workspace(positions, experts, positions);
      const std::string at = std::to_string(positions) + " x " + std::to_string(experts);
      EXPECT_GE(w.num_chunks * w.chunk, positions) << at;
      EXPECT_LT((w.num_chunks - 1) * w.chunk, std::max<std::int64_t>(positions, 1)) << at;
      EXPECT_EQ(w.chunk % 32, 0) << at;
      EXPECT_LE(w.num_chunks * experts, 4 * positions + experts) << at;
      for (const std::size_t offset : {w.begins, w.table, w.source, w.bytes}) {
        EXPECT_EQ(offset % 16, 0u) << at;
      }
      EXPECT_GE(w.table - w.begins, static_cast<std::size_t>(experts) * 4) << at;
      EXPECT_GE(w.source - w.table, static_cast<std::size_t>(w.num_chunks * experts) * 4) << at;
      EXPECT_GE(w.bytes - w.source, static_cast<std::size_t>(positions) * 4) << at;
    }
  }
}

TEST(CudaRoutingStatus, MessagesNameTheArgument) {
  EXPECT_EQ(status_message(kStatusExpertIdOutOfRange),
            "expert_idx: some id is outside [0, expert_num)");
  EXPECT_EQ(status_message(kStatusRowIndexOutOfRange),
            "expanded_row_idx: some row is below -1, -1 with drop_pad_mode 0 or 2, or not below "
            "E * C with drop_pad_mode 1 or 3");
  EXPECT_EQ(status_message(kStatusBiasRowOutOfRange), "expert_idx: some id is not a row of bias");
  EXPECT_EQ(status_message(kStatusRowIndexOutOfRange | kStatusBiasRowOutOfRange | 64),
            status_message(kStatusRowIndexOutOfRange) +
                "; expert_idx: some id is not a row of bias; status: unknown bits in 88");
}

// Aligned host memory handed out in 64-byte steps.
class HostArena {
 public:
  HostArena() : storage_(1 << 14) {}
  std::byte* take(std::size_t bytes) {
    std::byte* taken = reinterpret_cast<std::byte*>(storage_.data()) + used_;
    used_ += (bytes + 63) / 64 * 64;
    return taken;
  }

 private:
  std::vector<std::int64_t> storage_;
  std::size_t used_ = 0;
};

template <typename Body>
void expect_error(const Body& call, ErrorCode code, const std::string& message) {
  try {
    call();
    ADD_FAILURE() << "no error, expected: " << message;
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), code);
    EXPECT_EQ(std::string(error.what()), message);
  }
}

// T = 6, k = 2, H = 5 bfloat16, E = 4, counts as their flag 2.
class CudaInitRouting : public ::testing::Test {
 protected:
  CudaInitRouting() {
    inputs_.x = TensorView(arena_.take(6 * 5 * 2), DType::kBFloat16, {6, 5});
    inputs_.expert_idx = TensorView(arena_.take(6 * 2 * 4), DType::kInt32, {6, 2});
    attributes_.expert_num = 4;
    attributes_.expert_tokens_count_or_cumsum_flag = kExpertTokensCount;
    outputs_.expanded_x = TensorView(arena_.take(12 * 5 * 2), DType::kBFloat16, {12, 5});
    outputs_.expanded_row_idx = TensorView(arena_.take(12 * 4), DType::kInt32, {12});
    outputs_.expert_tokens_count_or_cumsum = TensorView(arena_.take(16), DType::kInt32, {4});
    outputs_.expert_tokens_before_capacity = TensorView(nullptr, DType::kInt32, {0});
    context_.status = reinterpret_cast<std::int32_t*>(arena_.take(4));
    context_.workspace_bytes = init_routing_workspace_bytes(inputs_, attributes_);
    context_.workspace = arena_.take(context_.workspace_bytes);
  }

  void expect_refused(ErrorCode code, const std::string& message) {
    expect_error([&] { moe_init_routing(inputs_, outputs_, attributes_, context_); }, code,
                 message);
  }

  HostArena arena_;
  InitRoutingInputs inputs_;
  InitRoutingOutputs outputs_;
  InitRoutingAttributes attributes_;
  DeviceContext context_;
};

TEST_F(CudaInitRouting, WorkspaceFromTheShapesAndAttributes) {
  // 12 positions, E = 4: one chunk; 12 rows of source.
  EXPECT_EQ(context_.workspace_bytes, detail::init_routing_workspace(12, 4, 12).bytes);
  attributes_.drop_pad_mode = kDropPad;
  attributes_.expert_capacity = 3;
  attributes_.expert_tokens_count_or_cumsum_flag = kExpertTokensNone;
  EXPECT_EQ(init_routing_workspace_bytes(inputs_, attributes_),
            detail::init_routing_workspace(12, 4, 4 * 3).bytes);
  attributes_.active_num = 5;  // read only in drop_pad_mode 0
  attributes_.drop_pad_mode = kDropless;
  EXPECT_EQ(init_routing_workspace_bytes(inputs_, attributes_),
            detail::init_routing_workspace(12, 4, 5).bytes);
}

TEST_F(CudaInitRouting, RefusesExpertNumZeroNamingIt) {
  attributes_.expert_num = 0;
  attributes_.expert_tokens_count_or_cumsum_flag = kExpertTokensNone;
  const std::string message =
      "expert_num: must be >= 1 for the CUDA backend (it bounds the histogram of the ids), got 0";
  expect_error([&] { init_routing_workspace_bytes(inputs_, attributes_); },
               ErrorCode::kInvalidArgument, message);
  outputs_.expert_tokens_count_or_cumsum = TensorView(nullptr, DType::kInt32, {0});
  expect_refused(ErrorCode::kInvalidArgument, message);
}

TEST_F(CudaInitRouting, RefusesWithTheCoreMessages) {
  inputs_.x = TensorView(inputs_.x.data, DType::kBFloat16, {30});
  expect_refused(ErrorCode::kInvalidArgument, "x: must be 2-D [T, H], got bfloat16[30]");
}

TEST_F(CudaInitRouting, RefusesAWrongOutputSpec) {
  outputs_.expanded_row_idx = TensorView(outputs_.expanded_row_idx.data, DType::kInt32, {11});
  expect_refused(ErrorCode::kInvalidArgument, "expanded_row_idx: must be int32[12], got int32[11]");
}

TEST_F(CudaInitRouting, RefusesASmallWorkspace) {
  const std::size_t needed = context_.workspace_bytes;
  context_.workspace_bytes = needed - 1;
  expect_refused(ErrorCode::kInvalidArgument, "workspace: moe_init_routing needs " +
                                                  std::to_string(needed) + " bytes, got " +
                                                  std::to_string(needed - 1));
}

TEST_F(CudaInitRouting, RefusesANullOrOverlappingStatusAndWorkspace) {
  std::int32_t* const status = context_.status;
  context_.status = nullptr;
  expect_refused(ErrorCode::kInvalidArgument, "status: data is null");
  context_.status = status;
  context_.workspace = outputs_.expanded_x.data;
  expect_refused(ErrorCode::kInvalidArgument, "workspace: overlaps output expanded_x");
}

TEST_F(CudaInitRouting, RefusesMisalignedIndices) {
  auto* base = static_cast<std::byte*>(outputs_.expanded_row_idx.data);
  outputs_.expanded_row_idx = TensorView(base + 2, DType::kInt32, {12});
  expect_refused(ErrorCode::kInvalidArgument,
                 "expanded_row_idx: data must be 4-byte aligned for the CUDA backend");
  outputs_.expanded_row_idx = TensorView(base, DType::kInt32, {12});
  inputs_.expert_idx = TensorView(arena_.take(6 * 2 * 8 + 8) + 4, DType::kInt64, {6, 2});
  expect_refused(ErrorCode::kInvalidArgument,
                 "expert_idx: data must be 8-byte aligned for the CUDA backend");
  inputs_.expert_idx = TensorView(arena_.take(6 * 2 * 4), DType::kInt32, {6, 2});
  auto* counts = static_cast<std::byte*>(outputs_.expert_tokens_count_or_cumsum.data);
  outputs_.expert_tokens_count_or_cumsum = TensorView(counts + 1, DType::kInt32, {4});
  expect_refused(ErrorCode::kInvalidArgument,
                 "expert_tokens_count_or_cumsum: data must be 4-byte aligned for the CUDA backend");
}

// T = 3, k = 2, H = 4 float16 in drop_pad_mode 2, every optional input.
class CudaFinalizeRouting : public ::testing::Test {
 protected:
  CudaFinalizeRouting() {
    inputs_.expanded_x = TensorView(arena_.take(6 * 4 * 2), DType::kFloat16, {6, 4});
    inputs_.expanded_row_idx = TensorView(arena_.take(6 * 4), DType::kInt32, {6});
    inputs_.x1 = TensorView(arena_.take(3 * 4 * 2), DType::kFloat16, {3, 4});
    inputs_.x2 = TensorView(arena_.take(3 * 4 * 2), DType::kFloat16, {3, 4});
    inputs_.bias = TensorView(arena_.take(5 * 4 * 2), DType::kFloat16, {5, 4});
    inputs_.scales = TensorView(arena_.take(3 * 2 * 2), DType::kFloat16, {3, 2});
    inputs_.expert_idx = TensorView(arena_.take(3 * 2 * 4), DType::kInt32, {3, 2});
    attributes_.drop_pad_mode = kFinalizeRowMajor;
    outputs_.out = TensorView(arena_.take(3 * 4 * 2), DType::kFloat16, {3, 4});
    context_.status = reinterpret_cast<std::int32_t*>(arena_.take(4));
    context_.workspace_bytes = finalize_routing_workspace_bytes(inputs_, attributes_);
    context_.workspace = arena_.take(context_.workspace_bytes);
  }

  void expect_refused(ErrorCode code, const std::string& message) {
    expect_error([&] { moe_finalize_routing(inputs_, outputs_, attributes_, context_); }, code,
                 message);
  }

  HostArena arena_;
  FinalizeRoutingInputs inputs_;
  FinalizeRoutingOutputs outputs_;
  FinalizeRoutingAttributes attributes_;
  DeviceContext context_;
};

TEST_F(CudaFinalizeRouting, WorkspaceIsTheFlag) {
  EXPECT_EQ(context_.workspace_bytes, detail::kFlagBytes);
  attributes_.drop_pad_mode = 4;
  expect_error([&] { finalize_routing_workspace_bytes(inputs_, attributes_); },
               ErrorCode::kInvalidArgument, "drop_pad_mode: must be 0, 1, 2 or 3, got 4");
}

TEST_F(CudaFinalizeRouting, RefusesWithTheCoreMessages) {
  inputs_.scales = TensorView(inputs_.scales->data, DType::kBFloat16, {3, 2});
  expect_refused(ErrorCode::kUnsupported,
                 "scales: dtype bfloat16 does not pair with expanded_x's float16 (the same dtype, "
                 "or float32)");
  inputs_.scales = TensorView(inputs_.scales->data, DType::kFloat16, {3, 2});
  inputs_.x1.reset();
  expect_refused(ErrorCode::kInvalidArgument, "x2: needs x1");
}

TEST_F(CudaFinalizeRouting, RefusesAnOverlapAndASmallWorkspace) {
  outputs_.out = TensorView(inputs_.x2->data, DType::kFloat16, {3, 4});
  expect_refused(ErrorCode::kInvalidArgument, "out: overlaps input x2");
  outputs_.out = TensorView(arena_.take(3 * 4 * 2), DType::kFloat16, {3, 4});
  context_.workspace_bytes = 15;
  expect_refused(ErrorCode::kInvalidArgument,
                 "workspace: moe_finalize_routing needs 16 bytes, got 15");
}

TEST_F(CudaFinalizeRouting, RefusesMisalignedElements) {
  const auto shifted = [](const TensorView& view, std::int64_t by) {
    return TensorView(static_cast<std::byte*>(view.data) + by, view.dtype(), view.shape());
  };
  inputs_.x1 = shifted(*inputs_.x1, 1);
  expect_refused(ErrorCode::kInvalidArgument,
                 "x1: data must be 2-byte aligned for the CUDA backend");
  inputs_.x1 = shifted(*inputs_.x1, -1);
  inputs_.expert_idx = shifted(*inputs_.expert_idx, 2);
  expect_refused(ErrorCode::kInvalidArgument,
                 "expert_idx: data must be 4-byte aligned for the CUDA backend");
  inputs_.expert_idx = shifted(*inputs_.expert_idx, -2);
  outputs_.out = shifted(outputs_.out, 1);
  expect_refused(ErrorCode::kInvalidArgument,
                 "out: data must be 2-byte aligned for the CUDA backend");
}

}  // namespace
}  // namespace moe_reroute::cuda
