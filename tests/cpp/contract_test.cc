// Contract rules beyond the byte moves: rule 7's pairing table row by row, a
// plan that cannot go stale, and views at any alignment on the CPU.

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "reference.h"
#include "sweep.h"

namespace moe_reroute::test {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

using testing::kPoison;

WorkloadConfig small_config(DType token_dtype, ScaleForm scales) {
  WorkloadConfig config;
  config.num_tokens = 96;
  config.hidden = 128;
  config.num_ranks = 3;
  config.num_experts = 4;
  config.token_dtype = token_dtype;
  config.seed = 5;
  set_scale_form(config, scales, 3);
  return config;
}

using Pairing = std::tuple<DType, ScaleForm>;

std::string pairing_name(const ::testing::TestParamInfo<Pairing>& info) {
  const auto [dtype, form] = info.param;
  return std::string(dtype_name(dtype)) + "_" + scale_form_name(form);
}

class AcceptedPairing : public ::testing::TestWithParam<Pairing> {};

TEST_P(AcceptedPairing, MovesEveryByte) {
  const auto [dtype, form] = GetParam();
  Workload workload(small_config(dtype, form));
  moe_re_routing(workload.inputs(), workload.outputs(), {}, 2);
  EXPECT_EQ(workload.compare(testing::reference_reroute(workload.reference_inputs(), 1, 0)), "");
}

INSTANTIATE_TEST_SUITE_P(Rule7, AcceptedPairing, ::testing::ValuesIn(scale_pairings(true)),
                         pairing_name);

class RefusedPairing : public ::testing::TestWithParam<Pairing> {};

TEST_P(RefusedPairing, NamesPerTokenScalesAndWritesNothing) {
  const auto [dtype, form] = GetParam();
  Workload workload(small_config(dtype, form));
  const bool e8m0 = workload.config().scale_dtype == DType::kFloat8E8M0;
  // e8m0 beside tokens that take none is a dtype refusal; a form the tokens'
  // row of the table lacks is a shape refusal.
  const bool dtype_refusal = e8m0 && !scales_pair(dtype, ScaleForm::kE8m0AS);
  EXPECT_EQ(refusal_difference(
                [&] { moe_re_routing(workload.inputs(), workload.outputs(), {}, 2); },
                dtype_refusal ? ErrorCode::kUnsupported : ErrorCode::kInvalidArgument,
                {"per_token_scales", std::string(dtype_name(dtype)) + " tokens"}),
            "");
  for (const std::byte b : workload.permute_tokens) ASSERT_EQ(b, kPoison);
  for (const std::byte b : workload.permute_scales) ASSERT_EQ(b, kPoison);
  EXPECT_THROW(infer_reroute(workload.inputs()), Error);
}

INSTANTIATE_TEST_SUITE_P(Rule7, RefusedPairing, ::testing::ValuesIn(scale_pairings(false)),
                         pairing_name);

// A plan holds the layout of its counts; run after they changed (same shapes)
// it must refuse, never write the old layout.
TEST(StalePlan, ChangedCountsAreRefusedBeforeAnythingIsWritten) {
  for (const DType count_dtype : kCountDTypes) {
    WorkloadConfig config = small_config(DType::kBFloat16, ScaleForm::kFloat32A);
    config.count_dtype = count_dtype;
    Workload workload(config);
    const Plan plan = plan_reroute(workload.inputs());
    const Plan inverse = plan_inverse({workload.inputs().tokens,
                                       workload.inputs().expert_token_num_per_rank});
    // Move one row from block (0, 0) to block (2, 3): same sum, other layout.
    const std::size_t bytes = count_dtype == DType::kInt32 ? 4 : 8;
    const auto shift = [&](std::size_t block, std::int64_t delta) {
      const std::int64_t value = workload.counts[block] + delta;
      const auto value32 = static_cast<std::int32_t>(value);
      std::memcpy(workload.counts_storage.data() + block * bytes,
                  bytes == 4 ? static_cast<const void*>(&value32) : &value, bytes);
    };
    ASSERT_GT(workload.counts[0], 0);
    shift(0, -1);
    shift(11, +1);
    EXPECT_EQ(refusal_difference([&] { run_reroute(plan, workload.inputs(), workload.outputs()); },
                                 ErrorCode::kInvalidArgument,
                                 {"expert_token_num_per_rank", "count[0][0] is " +
                                                                   std::to_string(workload.counts[0] - 1),
                                  "plan was made for " + std::to_string(workload.counts[0]),
                                  "plan again"}),
              "");
    for (const std::byte b : workload.permute_tokens) ASSERT_EQ(b, kPoison);
    EXPECT_EQ(refusal_difference(
                  [&] {
                    run_inverse(inverse,
                                {workload.inputs().tokens,
                                 workload.inputs().expert_token_num_per_rank},
                                {workload.outputs().permute_tokens});
                  },
                  ErrorCode::kInvalidArgument, {"expert_token_num_per_rank", "plan again"}),
              "");
    for (const std::byte b : workload.permute_tokens) ASSERT_EQ(b, kPoison);
  }
}

// Counts, index and expert_token_num at every byte offset: loads and stores go
// through memcpy, so each offset gives the reference's bytes.
TEST(MisalignedViews, CountsIndexAndExpertTokenNumAtAnyOffset) {
  for (const DType count_dtype : kCountDTypes) {
    for (const int idx_type : {kIdxGather, kIdxScatter}) {
      for (std::size_t offset = 1; offset < 8; ++offset) {
        WorkloadConfig config = small_config(DType::kFloat16, ScaleForm::kFloat32AS);
        config.count_dtype = count_dtype;
        config.attributes.idx_type = idx_type;
        Workload workload(config);
        std::vector<std::byte> counts(workload.counts_storage.size() + 8);
        std::vector<std::byte> index(workload.token_idx.size() + 8, kPoison);
        std::vector<std::byte> num(workload.expert_token_num.size() + 8, kPoison);
        std::memcpy(counts.data() + offset, workload.counts_storage.data(),
                    workload.counts_storage.size());
        RerouteInputs in = workload.inputs();
        RerouteOutputs out = workload.outputs();
        in.expert_token_num_per_rank.data = counts.data() + offset;
        out.permute_token_idx.data = index.data() + offset;
        out.expert_token_num.data = num.data() + offset;
        moe_re_routing(in, out, config.attributes, 2);
        std::memcpy(workload.token_idx.data(), index.data() + offset, workload.token_idx.size());
        std::memcpy(workload.expert_token_num.data(), num.data() + offset,
                    workload.expert_token_num.size());
        EXPECT_EQ(workload.compare(testing::reference_reroute(workload.reference_inputs(), 1,
                                                              idx_type)),
                  "")
            << dtype_name(count_dtype) << " idx_type " << idx_type << " offset " << offset;

        // The inverse reads the same misaligned counts.
        std::vector<std::byte> restored(workload.tokens.size(), kPoison);
        moe_re_routing_inverse({in.tokens, in.expert_token_num_per_rank},
                               {TensorView(restored.data(), in.tokens.dtype(), in.tokens.shape())},
                               {}, 2);
        const testing::ReferenceOutputs back = testing::reference_inverse(workload.reference_inputs());
        EXPECT_EQ(testing::first_difference("restored_tokens", restored, back.tokens.data(),
                                            back.tokens.size()),
                  "");
      }
    }
  }
}

}  // namespace
}  // namespace moe_reroute::test
