// The CUDA backend's host-side logic, on the CPU: row addressing, the byte
// split of a warp copy, launch shapes and the validation that runs before any
// launch. None of it needs a GPU.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/launch.h"
#include "moe_reroute/cuda.h"
#include "moe_reroute/reroute.h"
#include "reference.h"
#include "workload.h"

namespace moe_reroute::cuda {
namespace {

using detail::BlockTables;
using detail::kSegmentBytes;
using testing::random_counts;

struct CountsCase {
  std::int64_t num_ranks;
  std::int64_t num_experts;
  std::int64_t num_tokens;
  double skew;
  double zero_fraction;
};

const CountsCase kCountsCases[] = {
    {1, 1, 0, 0.0, 0.0},    {1, 1, 7, 0.0, 0.0},     {1, 16, 300, 1.0, 0.5},
    {16, 1, 300, 1.0, 0.5}, {2, 3, 6, 0.0, 0.0},     {16, 16, 4096, 0.0, 0.0},
    {8, 32, 1000, 3.0, 0.0}, {4, 4, 16, 0.0, 0.9},   {64, 64, 200, 0.0, 0.97},
    {3, 5, 0, 0.0, 0.0},    {32, 8, 2000, 2.0, 0.3},
};

// The source row of every output row, as the kernels find it, equals the
// naive reference's gather index (forward) or scatter index (inverse: the
// expert-order row that rank-order row j went to).
TEST(CudaSourceRow, MatchesTheNaiveReference) {
  std::uint64_t seed = 1;
  for (const CountsCase& c : kCountsCases) {
    const std::vector<std::int64_t> counts = random_counts(
        c.num_ranks, c.num_experts, c.num_tokens, c.skew, c.zero_fraction, seed++);
    std::vector<std::byte> rows(static_cast<std::size_t>(c.num_tokens) + 1);
    const RerouteInputs inputs{TensorView(rows.data(), DType::kUInt8, {c.num_tokens, 1}),
                               TensorView(counts.data(), DType::kInt64,
                                          {c.num_ranks, c.num_experts}),
                               std::nullopt, std::nullopt};
    const Plan plan = plan_reroute(inputs, {}, 1);
    testing::ReferenceInputs reference;
    reference.num_ranks = c.num_ranks;
    reference.num_experts = c.num_experts;
    reference.counts = counts;
    reference.tokens = rows.data();
    reference.token_row_bytes = 1;
    for (const Direction direction : {Direction::kForward, Direction::kInverse}) {
      const BlockTables tables =
          detail::block_tables(direction, plan.src_offset().data(), plan.dst_offset().data(),
                               c.num_ranks, c.num_experts);
      const std::vector<std::int32_t> expected =
          testing::reference_reroute(reference, kExpertTokenNumCount,
                                     direction == Direction::kForward ? kIdxGather : kIdxScatter)
              .token_idx;
      for (std::int64_t row = 0; row < c.num_tokens; ++row) {
        ASSERT_EQ(detail::source_row(tables, row), expected[static_cast<std::size_t>(row)])
            << "row " << row << " of N=" << c.num_ranks << " E=" << c.num_experts
            << (direction == Direction::kForward ? " forward" : " inverse");
      }
    }
  }
}

// Every (dst, src) alignment and every short length, plus long ones: the
// split covers the range once, its words are aligned on both sides, and the
// width is the widest that dst - src allows.
TEST(CudaSplitRange, CoversTheRangeWithTheWidestAlignedWords) {
  std::vector<std::int64_t> lengths;
  for (std::int64_t n = 0; n <= 80; ++n) lengths.push_back(n);
  for (std::int64_t n : {255, 256, 257, 2047, 2048, 2049, 7168, 14336, 14337}) lengths.push_back(n);
  for (std::uintptr_t dst = 4096; dst < 4096 + 32; ++dst) {
    for (std::uintptr_t src = 8192; src < 8192 + 32; ++src) {
      int widest = 1;
      while (widest < 16 && (dst - src) % static_cast<std::uintptr_t>(2 * widest) == 0) {
        widest *= 2;
      }
      for (const std::int64_t n : lengths) {
        const detail::RangeSplit split = detail::split_range(dst, src, n);
        ASSERT_EQ(split.width, widest) << dst << " " << src;
        ASSERT_EQ(split.head + split.words * split.width + split.tail, n);
        ASSERT_GE(split.head, 0);
        ASSERT_GE(split.tail, 0);
        ASSERT_LT(split.tail, split.width);
        ASSERT_LT(split.head, split.width);
        if (split.words > 0) {
          ASSERT_EQ((dst + static_cast<std::uintptr_t>(split.head)) % split.width, 0u);
          ASSERT_EQ((src + static_cast<std::uintptr_t>(split.head)) % split.width, 0u);
        } else {
          ASSERT_EQ(split.tail + split.head, n);
        }
      }
    }
  }
}

TEST(CudaSaturatingAdd, IsExactBelowTheCapAndAssociative) {
  std::mt19937_64 rng(7);
  const std::int64_t cap = (std::int64_t{1} << 57) + 1;
  std::uniform_int_distribution<std::int64_t> value(0, cap);
  for (int i = 0; i < 10000; ++i) {
    const std::int64_t a = value(rng) >> (i % 60);
    const std::int64_t b = value(rng) >> (i % 7 * 9);
    const std::int64_t c = value(rng);
    EXPECT_EQ(detail::saturating_add(a, b, cap), a + b < cap ? a + b : cap);
    EXPECT_EQ(detail::saturating_add(detail::saturating_add(a, b, cap), c, cap),
              detail::saturating_add(a, detail::saturating_add(b, c, cap), cap));
  }
}

TEST(CudaMoveLaunch, GivesEveryRowSegmentOneWarpTask) {
  struct Case {
    std::int64_t rows, row_bytes;
    int num_sms;
    detail::MoveLaunch expected;
  };
  const std::int64_t cap = 132 * detail::kMoveBlocksPerSm;
  const Case cases[] = {
      {256, 14336, 132, {7, 1792, 224}},            // decode, bf16 H = 7168
      {256, 7168, 132, {4, 1024, 128}},             // decode, int8: 3.5 segments
      {16384, 7168, 132, {4, 65536, cap}},          // prefill: grid-stride over the SMs
      {131072, 14336, 132, {7, 917504, cap}},
      {1, 1, 132, {1, 1, 1}},
      {9, 2049, 1, {2, 18, 3}},
      {0, 14336, 132, {7, 0, 0}},                   // A = 0: nothing to launch
      {100000, 1, 0, {1, 100000, detail::kMoveBlocksPerSm}},  // unknown SM count: 1
  };
  for (const Case& c : cases) {
    const detail::MoveLaunch launch = detail::move_launch(c.rows, c.row_bytes, c.num_sms);
    EXPECT_EQ(launch, c.expected) << c.rows << " x " << c.row_bytes;
    EXPECT_EQ(launch.block, detail::kMoveThreads);
    EXPECT_GE(launch.segments_per_row * kSegmentBytes, c.row_bytes);
    EXPECT_LT((launch.segments_per_row - 1) * kSegmentBytes, std::max<std::int64_t>(c.row_bytes, 1));
  }
}

TEST(CudaWorkspace, HoldsTwoInt64TablesOfTheBlocks) {
  EXPECT_EQ(required_workspace_bytes(1, 1), 16u);
  EXPECT_EQ(required_workspace_bytes(16, 16), 4096u);
  EXPECT_EQ(required_workspace_bytes(300, 400), 1920000u);
}

TEST(CudaStatus, MessagesNameTheArgument) {
  EXPECT_EQ(status_message(0), "");
  EXPECT_EQ(status_message(kStatusNegativeCount),
            "expert_token_num_per_rank: some count is negative");
  EXPECT_EQ(status_message(kStatusCountSumMismatch),
            "expert_token_num_per_rank: the counts do not sum to the number of rows of tokens");
  EXPECT_EQ(status_message(kStatusNegativeCount | kStatusCountSumMismatch),
            "expert_token_num_per_rank: some count is negative; the counts do not sum to the "
            "number of rows of tokens");
  EXPECT_EQ(status_message(8), "status: unknown bits in 8");
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

  void expect_error(const std::string& message) {
    try {
      moe_re_routing(inputs_, outputs_, {}, context_);
      ADD_FAILURE() << "no error, expected: " << message;
    } catch (const Error& error) {
      EXPECT_EQ(std::string(error.what()), message);
    }
  }

  std::vector<std::byte> buffer_;
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

TEST_F(CudaValidation, RejectsASmallWorkspace) {
  context_.workspace_bytes = 95;
  expect_error("workspace: counts [2, 3] need 96 bytes, got 95");
}

TEST_F(CudaValidation, RejectsANullStatusWord) {
  context_.status = nullptr;
  expect_error("status: data is null");
}

TEST_F(CudaValidation, RejectsAMisalignedStatusWordOrWorkspace) {
  context_.status = reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(context_.status) + 2);
  expect_error("status: data must be 4-byte aligned for the CUDA backend");
  context_.status = reinterpret_cast<std::int32_t*>(reinterpret_cast<std::byte*>(context_.status) - 2);
  context_.workspace = static_cast<std::byte*>(context_.workspace) + 4;
  expect_error("workspace: data must be 8-byte aligned for the CUDA backend");
}

TEST_F(CudaValidation, RejectsAWorkspaceOverlappingATensor) {
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

}  // namespace
}  // namespace moe_reroute::cuda
