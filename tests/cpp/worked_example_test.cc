// docs/spec.md section 3's worked example, exact values: N = 2, E = 3,
// counts [[1, 0, 2], [2, 1, 0]], A = 6.

#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <vector>

#include "sweep.h"

namespace moe_reroute::test {
namespace {

constexpr std::int64_t kRows = 6;
constexpr std::int64_t kHidden = 2;
constexpr std::array<std::int64_t, 6> kCounts = {1, 0, 2, 2, 1, 0};

// Token row i holds (10 i, 10 i + 1); its scale 100 i and its weight 1000 i.
struct Example {
  std::vector<float> tokens, scales, weight;
  std::vector<std::int32_t> counts32;
  std::vector<std::int64_t> counts64;
  std::vector<float> permute_tokens, permute_scales, permute_weight;
  std::vector<std::int32_t> token_idx;
  std::vector<std::int64_t> expert_token_num;  // int32 counts use its first half
  DType count_dtype;

  explicit Example(DType counts_dtype)
      : permute_tokens(kRows * kHidden, -1.0f),
        permute_scales(kRows, -1.0f),
        permute_weight(kRows, -1.0f),
        token_idx(kRows, -1),
        expert_token_num(3, -1),
        count_dtype(counts_dtype) {
    for (std::int64_t i = 0; i < kRows; ++i) {
      tokens.push_back(10.0f * static_cast<float>(i));
      tokens.push_back(10.0f * static_cast<float>(i) + 1.0f);
      scales.push_back(100.0f * static_cast<float>(i));
      weight.push_back(1000.0f * static_cast<float>(i));
    }
    counts32.assign(kCounts.begin(), kCounts.end());
    counts64.assign(kCounts.begin(), kCounts.end());
  }

  RerouteInputs inputs() const {
    const void* counts =
        count_dtype == DType::kInt32 ? static_cast<const void*>(counts32.data()) : counts64.data();
    return {TensorView(tokens.data(), DType::kFloat32, {kRows, kHidden}),
            TensorView(counts, count_dtype, {2, 3}),
            TensorView(scales.data(), DType::kFloat32, {kRows}),
            TensorView(weight.data(), DType::kFloat32, {kRows, 1})};
  }

  RerouteOutputs outputs() {
    return {TensorView(permute_tokens.data(), DType::kFloat32, {kRows, kHidden}),
            TensorView(permute_scales.data(), DType::kFloat32, {kRows}),
            TensorView(token_idx.data(), DType::kInt32, {kRows}),
            TensorView(expert_token_num.data(), count_dtype, {3}),
            TensorView(permute_weight.data(), DType::kFloat32, {kRows, 1})};
  }

  std::vector<std::int64_t> written_expert_token_num() const {
    if (count_dtype == DType::kInt64) return expert_token_num;
    const auto* values = reinterpret_cast<const std::int32_t*>(expert_token_num.data());
    return {values[0], values[1], values[2]};
  }
};

class WorkedExample : public ::testing::TestWithParam<DType> {};

TEST_P(WorkedExample, GatherIndexAndCountsAreExact) {
  Example example(GetParam());
  moe_re_routing(example.inputs(), example.outputs(),
                 {kExpertTokenNumCount, kIdxGather});
  const std::vector<std::int64_t> order = {0, 3, 4, 5, 1, 2};
  std::vector<float> tokens, scales, weight;
  for (std::int64_t row : order) {
    tokens.push_back(example.tokens[static_cast<std::size_t>(row * kHidden)]);
    tokens.push_back(example.tokens[static_cast<std::size_t>(row * kHidden + 1)]);
    scales.push_back(example.scales[static_cast<std::size_t>(row)]);
    weight.push_back(example.weight[static_cast<std::size_t>(row)]);
  }
  EXPECT_EQ(example.permute_tokens, tokens);
  EXPECT_EQ(example.permute_scales, scales);
  EXPECT_EQ(example.permute_weight, weight);
  EXPECT_EQ(example.token_idx, (std::vector<std::int32_t>{0, 3, 4, 5, 1, 2}));
  EXPECT_EQ(example.written_expert_token_num(), (std::vector<std::int64_t>{3, 1, 2}));
}

TEST_P(WorkedExample, ScatterIndexAndCumsumAreExact) {
  Example example(GetParam());
  moe_re_routing(example.inputs(), example.outputs(),
                 {kExpertTokenNumCumsum, kIdxScatter});
  EXPECT_EQ(example.token_idx, (std::vector<std::int32_t>{0, 4, 5, 1, 2, 3}));
  EXPECT_EQ(example.written_expert_token_num(), (std::vector<std::int64_t>{3, 4, 6}));
  for (std::int64_t j = 0; j < kRows; ++j) {
    const auto to = static_cast<std::size_t>(example.token_idx[static_cast<std::size_t>(j)]);
    EXPECT_EQ(example.permute_tokens[to * kHidden], example.tokens[static_cast<std::size_t>(j * kHidden)]);
  }
}

TEST_P(WorkedExample, InverseRestoresRankOrder) {
  Example example(GetParam());
  moe_re_routing(example.inputs(), example.outputs());
  std::vector<float> restored_tokens(kRows * kHidden, -1.0f), restored_scales(kRows, -1.0f),
      restored_weight(kRows, -1.0f);
  const RerouteInputs forward = example.inputs();
  moe_re_routing_inverse(
      {TensorView(example.permute_tokens.data(), DType::kFloat32, {kRows, kHidden}),
       forward.expert_token_num_per_rank,
       TensorView(example.permute_scales.data(), DType::kFloat32, {kRows}),
       TensorView(example.permute_weight.data(), DType::kFloat32, {kRows, 1})},
      {TensorView(restored_tokens.data(), DType::kFloat32, {kRows, kHidden}),
       TensorView(restored_scales.data(), DType::kFloat32, {kRows}),
       TensorView(restored_weight.data(), DType::kFloat32, {kRows, 1})});
  EXPECT_EQ(restored_tokens, example.tokens);
  EXPECT_EQ(restored_scales, example.scales);
  EXPECT_EQ(restored_weight, example.weight);
}

INSTANTIATE_TEST_SUITE_P(BothCountDTypes, WorkedExample,
                         ::testing::Values(DType::kInt32, DType::kInt64),
                         DTypeParamName());

}  // namespace
}  // namespace moe_reroute::test
