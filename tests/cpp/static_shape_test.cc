// docs/spec.md section 9, static shapes: expert_alignment k pads each expert's
// segment to a multiple of k rows; allow_spare_rows lets the counts cover fewer
// than A rows. Exact values on a worked example, then random cases against the
// naive reference (which computes the padded layout on its own), the refusals,
// and the inverse.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "reference.h"
#include "sweep.h"

namespace moe_reroute::test {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

using testing::kPoison;

// The worked example of section 3 received into A = 8 rows (2 spare), k = 4:
// totals c = [3, 1, 2], segments of 4 rows at 0, 4, 8, R = 8 + 3 * 3 = 17.
TEST(StaticShapes, WorkedExampleHasTheDocumentedLayout) {
  const std::int64_t num_tokens = 8;
  const std::int64_t rows = 17;
  std::vector<float> tokens(num_tokens);
  for (std::int64_t i = 0; i < num_tokens; ++i) tokens[i] = 10.0f * static_cast<float>(i + 1);
  const std::vector<std::int32_t> counts = {1, 0, 2, 2, 1, 0};
  for (const int idx_type : {kIdxGather, kIdxScatter}) {
    for (const int num_type : {kExpertTokenNumCount, kExpertTokenNumCumsum}) {
      const Attributes attributes{num_type, idx_type, /*expert_alignment=*/4,
                                  /*allow_spare_rows=*/true};
      const std::int64_t index_rows = idx_type == kIdxGather ? rows : num_tokens;
      std::vector<float> permute_tokens(rows, -7.0f), permute_scales(rows, -7.0f);
      std::vector<std::int32_t> index(index_rows, 99), expert_token_num(3, 99);
      const RerouteInputs inputs{TensorView(tokens.data(), DType::kFloat32, {num_tokens, 1}),
                                 TensorView(counts.data(), DType::kInt32, {2, 3})};
      moe_re_routing(inputs,
                     {TensorView(permute_tokens.data(), DType::kFloat32, {rows, 1}),
                      TensorView(permute_scales.data(), DType::kFloat32, {rows}),
                      TensorView(index.data(), DType::kInt32, {index_rows}),
                      TensorView(expert_token_num.data(), DType::kInt32, {3}),
                      TensorView(nullptr, DType::kFloat32, {0})},
                     attributes, 2);
      // Rows 0-2: sources 0, 3, 4; row 3 pad; row 4: source 5; rows 5-7 pad;
      // rows 8-9: sources 1, 2; rows 10-11 pad; rows 12-16 tail (not written).
      const std::vector<float> expected_tokens = {10, 40, 50, 0, 60, 0,  0,  0, 20,
                                                  30, 0,  0,  -7, -7, -7, -7, -7};
      EXPECT_EQ(permute_tokens, expected_tokens);
      std::vector<float> expected_scales(12, 0.0f);
      expected_scales.resize(rows, -7.0f);
      EXPECT_EQ(permute_scales, expected_scales);
      if (idx_type == kIdxGather) {
        EXPECT_EQ(index, (std::vector<std::int32_t>{0, 3, 4, -1, 5, -1, -1, -1, 1, 2, -1, -1, -1,
                                                    -1, -1, -1, -1}));
      } else {
        EXPECT_EQ(index, (std::vector<std::int32_t>{0, 8, 9, 1, 2, 4, -1, -1}));
      }
      const std::vector<std::int32_t> counted = {3, 1, 2};
      const std::vector<std::int32_t> cumsum = {4, 8, 12};
      EXPECT_EQ(expert_token_num, num_type == kExpertTokenNumCount ? counted : cumsum);
    }
  }
}

TEST(StaticShapes, InferenceGivesROutputRowsFromShapesAlone) {
  const RerouteInputs inputs{TensorView(nullptr, DType::kBFloat16, {10, 64}),
                             TensorView(nullptr, DType::kInt64, {2, 3}),
                             TensorView(nullptr, DType::kFloat32, {10, 4}),
                             TensorView(nullptr, DType::kFloat32, {10, 1})};
  const RerouteOutputSpecs gather = infer_reroute(inputs, {1, kIdxGather, 4, false});
  EXPECT_EQ(gather.permute_tokens, (TensorSpec{DType::kBFloat16, {19, 64}}));
  EXPECT_EQ(gather.permute_per_token_scales, (TensorSpec{DType::kFloat32, {19, 4}}));
  EXPECT_EQ(gather.permute_token_idx, (TensorSpec{DType::kInt32, {19}}));
  EXPECT_EQ(gather.expert_token_num, (TensorSpec{DType::kInt64, {3}}));
  EXPECT_EQ(gather.permute_topk_weight, (TensorSpec{DType::kFloat32, {19, 1}}));
  const RerouteOutputSpecs scatter = infer_reroute(inputs, {1, kIdxScatter, 4, true});
  EXPECT_EQ(scatter.permute_token_idx, (TensorSpec{DType::kInt32, {10}}));
  // k = 1 keeps R = A, with or without spare rows.
  EXPECT_EQ(infer_reroute(inputs, {1, kIdxGather, 1, true}).permute_tokens,
            (TensorSpec{DType::kBFloat16, {10, 64}}));
  const InverseOutputSpecs restored =
      infer_inverse({TensorView(nullptr, DType::kBFloat16, {19, 64}), inputs.expert_token_num_per_rank,
                     TensorView(nullptr, DType::kFloat32, {19, 4}), std::nullopt},
                    {1, 0, 4, false});
  EXPECT_EQ(restored.restored_tokens, (TensorSpec{DType::kBFloat16, {10, 64}}));
  EXPECT_EQ(restored.restored_per_token_scales, (TensorSpec{DType::kFloat32, {10, 4}}));
}

// A static-shape case: A rows, `valid` of them covered by the counts.
struct StaticCase {
  std::string name;
  std::int64_t num_ranks, num_experts, num_tokens, num_valid;
  double skew = 0.0;
  double zero_fraction = 0.0;
};

std::vector<StaticCase> static_cases() {
  return {
      {"random", 3, 5, 200, 200, 0.5},
      {"spare_rows", 4, 4, 256, 64, 1.0},
      {"one_expert", 6, 1, 90, 71},
      {"all_zero_counts", 2, 3, 40, 0},
      {"no_tokens", 3, 2, 0, 0},
      {"skewed", 8, 8, 500, 450, 2.0, 0.3},
  };
}

WorkloadConfig static_config(const StaticCase& c, std::int64_t k, DType token_dtype,
                             ScaleForm scales, std::uint64_t seed) {
  WorkloadConfig config;
  config.num_ranks = c.num_ranks;
  config.num_experts = c.num_experts;
  config.num_tokens = c.num_tokens;
  config.num_valid_tokens = c.num_valid;
  config.hidden = 70;
  config.token_dtype = token_dtype;
  config.skew = c.skew;
  config.zero_fraction = c.zero_fraction;
  config.seed = seed;
  config.attributes.expert_alignment = k;
  config.attributes.allow_spare_rows = c.num_valid < c.num_tokens;
  set_scale_form(config, scales, 3);
  return config;
}

class StaticShapeCases : public ::testing::TestWithParam<std::int64_t> {};

// Forward: every case x count dtype x idx_type x expert_token_num_type x
// scale form of FP8 tokens (which take them all) and bfloat16, on 1-3 threads.
TEST_P(StaticShapeCases, ForwardMatchesNaiveReference) {
  const std::int64_t k = GetParam();
  std::uint64_t seed = static_cast<std::uint64_t>(k) * 1000;
  for (const StaticCase& c : static_cases()) {
    for (const DType token_dtype : {DType::kFloat8E4M3FN, DType::kBFloat16}) {
      for (const ScaleForm scales : kScaleForms) {
        if (!scales_pair(token_dtype, scales)) continue;
        for (const DType count_dtype : kCountDTypes) {
          for (const Attributes& a : {Attributes{1, 0}, Attributes{0, 1}, Attributes{0, 0},
                                      Attributes{1, 1}}) {
            WorkloadConfig config = static_config(c, k, token_dtype, scales, ++seed);
            config.count_dtype = count_dtype;
            config.attributes.expert_token_num_type = a.expert_token_num_type;
            config.attributes.idx_type = a.idx_type;
            config.has_weight = seed % 2 == 0;
            Workload workload(config);
            SCOPED_TRACE(c.name + " k=" + std::to_string(k) + " " +
                         std::string(dtype_name(token_dtype)) + " scales=" +
                         scale_form_name(scales) + " " + std::string(dtype_name(count_dtype)) +
                         " type=" + std::to_string(a.expert_token_num_type) +
                         " idx=" + std::to_string(a.idx_type));
            moe_re_routing(workload.inputs(), workload.outputs(), config.attributes,
                           1 + static_cast<int>(seed % 3));
            EXPECT_EQ(workload.compare(testing::reference_reroute(
                          workload.reference_inputs(), a.expert_token_num_type, a.idx_type)),
                      "");
          }
        }
      }
    }
  }
}

// The inverse: R rows in padded expert order (random bytes, pad rows included)
// back to A rows; spare rows of the output keep their poison.
TEST_P(StaticShapeCases, InverseMatchesNaiveReference) {
  const std::int64_t k = GetParam();
  std::uint64_t seed = static_cast<std::uint64_t>(k) * 7000;
  for (const StaticCase& c : static_cases()) {
    for (const ScaleForm scales : {ScaleForm::kNone, ScaleForm::kFloat32AS, ScaleForm::kE8m0AK2}) {
      const WorkloadConfig config = static_config(c, k, DType::kFloat16, scales, ++seed);
      // The workload's counts, with input rows R = A + E * (k - 1).
      WorkloadConfig rows_config = config;
      rows_config.num_tokens =
          k == 1 ? c.num_tokens : c.num_tokens + c.num_experts * (k - 1);
      rows_config.num_valid_tokens = c.num_valid;
      rows_config.attributes.expert_alignment = 1;
      Workload source(rows_config);
      const RerouteInputs in = source.inputs();
      const std::int64_t a = c.num_tokens;
      std::vector<std::byte> restored_tokens(static_cast<std::size_t>(a * 140), kPoison);
      const std::int64_t scale_row_bytes =
          in.per_token_scales && rows_config.num_tokens > 0
              ? in.per_token_scales->nbytes() / rows_config.num_tokens
              : 0;
      std::vector<std::byte> restored_scales(static_cast<std::size_t>(a * scale_row_bytes),
                                             kPoison);
      std::vector<std::byte> restored_weight(static_cast<std::size_t>(a * 4), kPoison);
      InverseOutputs out{TensorView(restored_tokens.data(), DType::kFloat16, {a, 70})};
      if (in.per_token_scales) {
        Shape shape = in.per_token_scales->shape();
        shape.dims[0] = a;
        out.restored_per_token_scales =
            TensorView(restored_scales.data(), in.per_token_scales->dtype(), shape);
      }
      out.restored_topk_weight = TensorView(restored_weight.data(), DType::kFloat32, {a, 1});
      SCOPED_TRACE(c.name + " k=" + std::to_string(k) + " scales=" + scale_form_name(scales));
      moe_re_routing_inverse({in.tokens, in.expert_token_num_per_rank, in.per_token_scales,
                              in.expert_topk_weight},
                             out, config.attributes, 2);

      testing::ReferenceInputs reference = source.reference_inputs();
      reference.num_tokens = a;
      reference.expert_alignment = k;
      const testing::ReferenceOutputs expected = testing::reference_inverse(reference);
      const auto check = [&](const char* name, const std::vector<std::byte>& got,
                             const std::vector<std::byte>& want, std::int64_t row_bytes) {
        EXPECT_EQ(testing::rows_difference(name, got.data(), got.size(), want,
                                           expected.specified_rows, row_bytes),
                  "");
      };
      check("restored_tokens", restored_tokens, expected.tokens, 140);
      if (in.per_token_scales) {
        check("restored_per_token_scales", restored_scales, expected.scales, scale_row_bytes);
      }
      check("restored_topk_weight", restored_weight, expected.weight, 4);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Alignments, StaticShapeCases, ::testing::Values(1, 2, 16, 128),
                         [](const ::testing::TestParamInfo<std::int64_t>& info) {
                           return "k" + std::to_string(info.param);
                         });

// Refusals name the argument and write nothing.
TEST(StaticShapes, RefusalsNameTheArgument) {
  WorkloadConfig config;
  config.num_tokens = 64;
  config.hidden = 8;
  config.num_ranks = 2;
  config.num_experts = 4;
  config.num_valid_tokens = 60;
  config.attributes.allow_spare_rows = true;
  Workload workload(config);
  const auto forward = [&](Attributes attributes) {
    return [&workload, attributes] {
      moe_re_routing(workload.inputs(), workload.outputs(), attributes, 2);
    };
  };
  const Attributes spare{1, 0, 1, true};
  EXPECT_EQ(refusal_difference(forward({1, 0, 0, true}), ErrorCode::kInvalidArgument,
                               {"expert_alignment", "must be >= 1", "got 0"}),
            "");
  EXPECT_EQ(refusal_difference(forward({1, 0, -5, true}), ErrorCode::kInvalidArgument,
                               {"expert_alignment", "got -5"}),
            "");
  EXPECT_EQ(refusal_difference(forward({1, 0, std::numeric_limits<std::int64_t>::max(), true}),
                               ErrorCode::kOutOfRange, {"expert_alignment", "overflows"}),
            "");
  EXPECT_EQ(refusal_difference(forward({1, 0, std::int64_t{1} << 30, true}),
                               ErrorCode::kOutOfRange, {"expert_alignment", "int32 index limit"}),
            "");
  // Without allow_spare_rows the counts must cover every row, as always.
  EXPECT_EQ(refusal_difference(forward({1, 0, 1, false}), ErrorCode::kInvalidArgument,
                               {"expert_token_num_per_rank", "counts sum to 60", "64 rows"}),
            "");
  for (const std::byte b : workload.permute_tokens) ASSERT_EQ(b, kPoison);
  for (const std::byte b : workload.token_idx) ASSERT_EQ(b, kPoison);
  moe_re_routing(workload.inputs(), workload.outputs(), spare, 2);

  // More than A is an error even with spare rows.
  const std::vector<std::int32_t> counts = {30, 40};
  std::vector<float> tokens(64);
  const RerouteInputs over{TensorView(tokens.data(), DType::kFloat32, {64, 1}),
                           TensorView(counts.data(), DType::kInt32, {1, 2})};
  EXPECT_EQ(refusal_difference([&] { plan_reroute(over, spare); }, ErrorCode::kInvalidArgument,
                               {"expert_token_num_per_rank", "counts sum to 70", "64 rows",
                                "never more"}),
            "");
  // The inverse's R rows must hold the padding room E * (k - 1).
  const InverseInputs short_rows{TensorView(tokens.data(), DType::kFloat32, {5, 1}),
                                 TensorView(counts.data(), DType::kInt32, {1, 2})};
  EXPECT_EQ(refusal_difference([&] { infer_inverse(short_rows, {1, 0, 4, true}); },
                               ErrorCode::kInvalidArgument,
                               {"tokens", "5 rows", "expert_alignment 4", "at least 6"}),
            "");
}

}  // namespace
}  // namespace moe_reroute::test
