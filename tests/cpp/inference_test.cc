// Shape and dtype inference from views with null data: docs/spec.md section 5's table
// (the reference library's own cases), the empty optional outputs and the
// index limit, which must be refused by shape alone.

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "moe_reroute/operator.h"
#include "sweep.h"

namespace moe_reroute::test {
namespace {

TensorView meta(DType dtype, Shape shape) { return TensorView(nullptr, dtype, shape); }

// A view whose public ndim field a caller set out of 0..kMaxDims.
TensorView with_ndim(TensorView view, int ndim) {
  view.spec.shape.ndim = ndim;
  return view;
}

struct InferenceRow {
  std::string name;
  RerouteInputs inputs;
  std::optional<RerouteOutputSpecs> expected;  // nullopt: refused with code and parts
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::vector<std::string> parts;
};

void PrintTo(const InferenceRow& row, std::ostream* os) { *os << row.name; }

std::vector<InferenceRow> section5_rows() {
  const TensorView tokens = meta(DType::kFloat16, {256, 7168});
  const TensorView counts = meta(DType::kInt32, {16, 16});
  return {
      {"f16_256x7168_scales_256_weight_256x1",
       {tokens, counts, meta(DType::kFloat32, {256}), meta(DType::kFloat32, {256, 1})},
       RerouteOutputSpecs{{DType::kFloat16, {256, 7168}},
                          {DType::kFloat32, {256}},
                          {DType::kInt32, {256}},
                          {DType::kInt32, {16}},
                          {DType::kFloat32, {256, 1}}}},
      {"bf16_36x385_counts_3x12_scales_36x1_weight_36x1",
       {meta(DType::kBFloat16, {36, 385}), meta(DType::kInt64, {3, 12}),
        meta(DType::kFloat32, {36, 1}), meta(DType::kFloat32, {36, 1})},
       RerouteOutputSpecs{{DType::kBFloat16, {36, 385}},
                          {DType::kFloat32, {36, 1}},
                          {DType::kInt32, {36}},
                          {DType::kInt64, {12}},
                          {DType::kFloat32, {36, 1}}}},
      {"tokens_1d_refused", {meta(DType::kFloat16, {256}), counts}, std::nullopt,
       ErrorCode::kInvalidArgument, {"tokens", "2-D", "[256]"}},
      {"counts_1d_refused", {tokens, meta(DType::kInt32, {16})}, std::nullopt,
       ErrorCode::kInvalidArgument, {"expert_token_num_per_rank", "2-D", "[16]"}},
      {"weight_int32_refused", {tokens, counts, std::nullopt, meta(DType::kInt32, {256})},
       std::nullopt, ErrorCode::kUnsupported, {"expert_topk_weight", "dtype int32"}},
      {"weight_dim1_2_refused", {tokens, counts, std::nullopt, meta(DType::kFloat32, {256, 2})},
       std::nullopt, ErrorCode::kInvalidArgument, {"expert_topk_weight", "dim 1", "got 2"}},
      // Never read past Shape::dims, even to name the shape.
      {"tokens_ndim_9_refused", {with_ndim(tokens, 9), counts}, std::nullopt,
       ErrorCode::kInvalidArgument, {"tokens", "2-D", "float16[ndim 9]"}},
      {"counts_ndim_minus_1_refused", {tokens, with_ndim(counts, -1)}, std::nullopt,
       ErrorCode::kInvalidArgument, {"expert_token_num_per_rank", "2-D", "[ndim -1]"}},
      {"scales_ndim_5_refused", {tokens, counts, with_ndim(meta(DType::kFloat32, {256}), 5)},
       std::nullopt, ErrorCode::kInvalidArgument, {"per_token_scales", "float32[ndim 5]"}},
      {"weight_ndim_64_refused",
       {tokens, counts, std::nullopt, with_ndim(meta(DType::kFloat32, {256, 1}), 64)},
       std::nullopt, ErrorCode::kInvalidArgument, {"expert_topk_weight", "float32[ndim 64]"}},
  };
}

class Section5Table : public ::testing::TestWithParam<InferenceRow> {};

TEST_P(Section5Table, InfersTheListedOutputs) {
  const InferenceRow& row = GetParam();
  if (row.expected) {
    EXPECT_EQ(infer_reroute(row.inputs), *row.expected);
  } else {
    EXPECT_EQ(refusal_difference([&] { infer_reroute(row.inputs); }, row.code, row.parts), "");
  }
}

INSTANTIATE_TEST_SUITE_P(ReferenceLibraryCases, Section5Table, ::testing::ValuesIn(section5_rows()),
                         [](const ::testing::TestParamInfo<InferenceRow>& info) {
                           return info.param.name;
                         });

class AbsentOptionals : public ::testing::TestWithParam<DType> {};

// "any tokens, any counts, absent topk: last output empty"; absent scales: [A] float32.
TEST_P(AbsentOptionals, GiveEmptyWeightAndFloat32ScalesOfA) {
  for (DType count_dtype : kCountDTypes) {
    const RerouteOutputSpecs specs =
        infer_reroute({meta(GetParam(), {36, 64}), meta(count_dtype, {3, 12})});
    EXPECT_EQ(specs.permute_tokens, (TensorSpec{GetParam(), {36, 64}}));
    EXPECT_EQ(specs.permute_per_token_scales, (TensorSpec{DType::kFloat32, {36}}));
    EXPECT_EQ(specs.permute_token_idx, (TensorSpec{DType::kInt32, {36}}));
    EXPECT_EQ(specs.expert_token_num, (TensorSpec{count_dtype, {12}}));
    EXPECT_EQ(specs.permute_topk_weight, (TensorSpec{DType::kFloat32, {0}}));
  }
}

INSTANTIATE_TEST_SUITE_P(EveryTokenDType, AbsentOptionals, ::testing::ValuesIn(token_dtypes()),
                         DTypeParamName());

class InverseInference : public ::testing::TestWithParam<DType> {};

TEST_P(InverseInference, RestoresTheInputSpecsAndOnlyTheGivenOptionals) {
  const TensorView tokens = meta(GetParam(), {40, 128});
  const TensorView counts = meta(DType::kInt64, {4, 2});
  const InverseOutputSpecs bare = infer_inverse({tokens, counts});
  EXPECT_EQ(bare.restored_tokens, tokens.spec);
  EXPECT_FALSE(bare.restored_per_token_scales.has_value());
  EXPECT_FALSE(bare.restored_topk_weight.has_value());
  const TensorView scales = meta(DType::kFloat8E8M0, {40, 2, 2});
  const TensorView weight = meta(DType::kFloat32, {40});
  const InverseOutputSpecs full = infer_inverse({tokens, counts, scales, weight});
  EXPECT_EQ(full.restored_per_token_scales, scales.spec);
  EXPECT_EQ(full.restored_topk_weight, weight.spec);
}

INSTANTIATE_TEST_SUITE_P(EveryDType, InverseInference, ::testing::ValuesIn(all_dtypes()),
                         DTypeParamName());

constexpr std::int64_t kIndexLimit = 2147483647;

TEST(IndexLimit, InferenceRefusesMoreThanInt32MaxTokensByShapeAlone) {
  const RerouteInputs inputs = {meta(DType::kInt8, {kIndexLimit + 1, 1}),
                                meta(DType::kInt32, {1, 1})};
  EXPECT_EQ(refusal_difference([&] { infer_reroute(inputs); }, ErrorCode::kOutOfRange,
                               {"tokens", "2147483648", "2147483647"}),
            "");
  EXPECT_EQ(refusal_difference([&] { plan_reroute(inputs); }, ErrorCode::kOutOfRange,
                               {"tokens", "2147483648"}),
            "");
}

TEST(IndexLimit, InferenceAcceptsExactlyInt32MaxTokens) {
  const RerouteOutputSpecs specs =
      infer_reroute({meta(DType::kInt8, {kIndexLimit, 1}), meta(DType::kInt32, {1, 1})});
  EXPECT_EQ(specs.permute_token_idx, (TensorSpec{DType::kInt32, {kIndexLimit}}));
}

TEST(IndexLimit, InverseWritesNoIndexSoTakesMoreRows) {
  const TensorView tokens = meta(DType::kInt8, {kIndexLimit + 1, 1});
  EXPECT_EQ(infer_inverse({tokens, meta(DType::kInt32, {1, 1})}).restored_tokens, tokens.spec);
}

// check_output_specs, the data-free check of given outputs (the torch fake
// kernel of out=): every output in its inferred spec passes with null data;
// each output off its spec is refused with run_reroute's own message for it.
TEST(CheckOutputSpecs, RefusesEachOutputOffItsSpecAsTheRunDoes) {
  const RerouteInputs inputs{meta(DType::kBFloat16, {6, 4}), meta(DType::kInt32, {2, 2}),
                             meta(DType::kFloat32, {6}), meta(DType::kFloat32, {6, 1})};
  const RerouteOutputSpecs specs = infer_reroute(inputs, {});
  const std::vector<TensorSpec> wanted = {specs.permute_tokens, specs.permute_per_token_scales,
                                          specs.permute_token_idx, specs.expert_token_num,
                                          specs.permute_topk_weight};
  const auto outputs_of = [](const std::vector<TensorSpec>& given, std::vector<std::vector<std::byte>>* memory) {
    std::vector<TensorView> views;
    for (const TensorSpec& spec : given) {
      void* data = nullptr;
      if (memory) data = memory->emplace_back(static_cast<std::size_t>(spec.nbytes()) + 1).data();
      views.emplace_back(data, spec.dtype, spec.shape);
    }
    return RerouteOutputs{views[0], views[1], views[2], views[3], views[4]};
  };
  EXPECT_NO_THROW(check_output_specs(specs, outputs_of(wanted, nullptr)));

  // Real inputs, for the run's message: counts summing to A = 6.
  std::vector<std::vector<std::byte>> memory;
  RerouteInputs real = inputs;
  for (TensorView* view : {&real.tokens, &real.expert_token_num_per_rank}) {
    view->data = memory.emplace_back(static_cast<std::size_t>(view->nbytes())).data();
  }
  real.per_token_scales->data = memory.emplace_back(24).data();
  real.expert_topk_weight->data = memory.emplace_back(24).data();
  const std::int32_t counts[] = {1, 2, 0, 3};
  std::memcpy(real.expert_token_num_per_rank.data, counts, sizeof(counts));
  const char* names[] = {"permute_tokens", "permute_per_token_scales", "permute_token_idx",
                         "expert_token_num", "permute_topk_weight"};
  for (std::size_t i = 0; i < wanted.size(); ++i) {
    SCOPED_TRACE(names[i]);
    std::vector<TensorSpec> given = wanted;
    given[i].shape.dims[0] += 1;
    std::string refused;
    try {
      check_output_specs(specs, outputs_of(given, nullptr));
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      refused = error.what();
    }
    EXPECT_EQ(refused, std::string(names[i]) + ": must be " + wanted[i].to_string() + ", got " +
                           given[i].to_string());
    std::vector<std::vector<std::byte>> out_memory;
    try {
      moe_re_routing(real, outputs_of(given, &out_memory));
      ADD_FAILURE() << "the run took an output off its spec";
    } catch (const Error& error) {
      EXPECT_EQ(error.what(), refused);
    }
  }
}

}  // namespace
}  // namespace moe_reroute::test

namespace moe_reroute::test {
namespace {

// output_rows is the shape rules' dim 0 as a formula in the tokens' rows and
// E: checked against inference over every attribute and input combination.
TEST(OutputRows, IsWhatInferenceGivesAtEverySize) {
  for (const std::int64_t rows : {0, 1, 7, 300}) {
    for (const std::int64_t experts : {1, 3, 16}) {
      for (const std::int64_t k : {1, 2, 128}) {
        for (const std::int64_t idx_type : {kIdxGather, kIdxScatter}) {
          for (const bool given : {false, true}) {
            const Attributes attributes{kExpertTokenNumCount, idx_type, k, true};
            const auto formula = [&](const OperatorDesc& op, std::size_t i, std::int64_t r) {
              const RowsFormula f = output_rows(op, i, attributes, given);
              return f.per_input_row * r + f.per_expert * experts;
            };
            RerouteInputs in{TensorView(nullptr, DType::kFloat16, {rows, 8}),
                             TensorView(nullptr, DType::kInt32, {2, experts})};
            if (given) {
              in.per_token_scales = TensorView(nullptr, DType::kFloat32, {rows, 2});
              in.expert_topk_weight = TensorView(nullptr, DType::kFloat32, {rows, 1});
            }
            const RerouteOutputSpecs specs = infer_reroute(in, attributes);
            const TensorSpec forward[] = {specs.permute_tokens, specs.permute_per_token_scales,
                                          specs.permute_token_idx, specs.expert_token_num,
                                          specs.permute_topk_weight};
            for (std::size_t i = 0; i < std::size(forward); ++i) {
              EXPECT_EQ(forward[i].shape[0], formula(reroute_desc(), i, rows))
                  << reroute_desc().outputs[i].name << " A=" << rows << " E=" << experts
                  << " k=" << k;
            }
            const std::int64_t inverse_rows = rows + experts * (k - 1);
            InverseInputs back{TensorView(nullptr, DType::kFloat32, {inverse_rows, 8}),
                               TensorView(nullptr, DType::kInt32, {2, experts})};
            if (given) {
              back.per_token_scales = TensorView(nullptr, DType::kFloat32, {inverse_rows});
              back.expert_topk_weight = TensorView(nullptr, DType::kFloat32, {inverse_rows, 1});
            }
            const InverseOutputSpecs restored = infer_inverse(back, attributes);
            const TensorSpec absent{DType::kFloat32, {0}};
            const TensorSpec inverse[] = {restored.restored_tokens,
                                          restored.restored_per_token_scales.value_or(absent),
                                          restored.restored_topk_weight.value_or(absent)};
            for (std::size_t i = 0; i < std::size(inverse); ++i) {
              EXPECT_EQ(inverse[i].shape[0], formula(inverse_desc(), i, inverse_rows))
                  << inverse_desc().outputs[i].name << " R=" << inverse_rows;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace moe_reroute::test
