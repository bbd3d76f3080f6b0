// docs/spec.md section 4: every rule the C++ core enforces, for the forward and the
// inverse. Each refusal must carry the right code, name the argument and the
// offending value, and leave every output holding its poison and every input
// its bytes.

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <span>
#include <string>

#include "sweep.h"

namespace moe_reroute::test {
namespace {

using testing::Workload;
using testing::WorkloadConfig;

constexpr std::byte kPoison{0xA5};

// A = 64, H = 16 bfloat16 tokens, N = 2, E = 4 int32 counts, float32 [A, 2]
// scales, an [A, 1] weight.
WorkloadConfig base_config() {
  WorkloadConfig config;
  config.num_tokens = 64;
  config.hidden = 16;
  config.token_dtype = DType::kBFloat16;
  config.num_ranks = 2;
  config.num_experts = 4;
  config.seed = 11;
  set_scale_form(config, ScaleForm::kFloat32AS, 2);
  return config;
}

void set_count(Workload& w, std::size_t index, std::int64_t value) {
  const auto value32 = static_cast<std::int32_t>(value);
  const bool int32 = w.config().count_dtype == DType::kInt32;
  std::memcpy(w.counts_storage.data() + index * (int32 ? 4 : 8),
              int32 ? static_cast<const void*>(&value32) : &value, int32 ? 4 : 8);
}

// Changes the first non-empty count by `delta`: the counts then sum to A + delta.
void shift_sum(Workload& w, std::int64_t delta) {
  for (std::size_t i = 0; i < w.counts.size(); ++i) {
    if (w.counts[i] > 0) return set_count(w, i, w.counts[i] + delta);
  }
}

WeightForm weight_of(const Workload& w) {
  return w.config().has_weight ? WeightForm::kA1 : WeightForm::kNone;
}

void forward(Workload& w, const std::function<void(ForwardCall&)>& edit,
             const Attributes& attributes = {}) {
  ForwardCall call = forward_call(w, weight_of(w));
  edit(call);
  moe_re_routing(call.inputs, call.outputs, attributes, 2);
}

void inverse(Workload& w, const std::function<void(InverseCall&)>& edit) {
  InverseCall call = inverse_call(w, weight_of(w));
  edit(call);
  moe_re_routing_inverse(call.inputs, call.outputs, {}, 2);
}

void no_edit(ForwardCall&) {}

struct Refusal {
  std::string name;
  std::function<void(WorkloadConfig&)> configure;
  std::function<void(Workload&)> call;
  ErrorCode code;
  std::vector<std::string> parts;
};

void PrintTo(const Refusal& refusal, std::ostream* os) { *os << refusal.name; }

void keep_config(WorkloadConfig&) {}

std::vector<Refusal> forward_refusals() {
  const ErrorCode invalid = ErrorCode::kInvalidArgument;
  const ErrorCode unsupported = ErrorCode::kUnsupported;
  const auto with_count_dtype = [](DType dtype) {
    return [dtype](WorkloadConfig& c) { c.count_dtype = dtype; };
  };
  const auto with_scales = [](ScaleForm form) {
    return [form](WorkloadConfig& c) { set_scale_form(c, form, 2); };
  };
  const auto with_fp8_scales = [](ScaleForm form) {
    return [form](WorkloadConfig& c) {
      c.token_dtype = DType::kFloat8E4M3FN;
      set_scale_form(c, form, 2);
    };
  };
  const auto tokens_as = [](DType dtype, Shape shape) {
    return [dtype, shape](Workload& w) {
      forward(w, [&](ForwardCall& c) { c.inputs.tokens.spec = {dtype, shape}; });
    };
  };
  const auto counts_as = [](DType dtype, Shape shape) {
    return [dtype, shape](Workload& w) {
      forward(w, [&](ForwardCall& c) { c.inputs.expert_token_num_per_rank.spec = {dtype, shape}; });
    };
  };
  const auto scales_as = [](DType dtype, Shape shape) {
    return [dtype, shape](Workload& w) {
      forward(w, [&](ForwardCall& c) { c.inputs.per_token_scales->spec = {dtype, shape}; });
    };
  };
  const auto weight_as = [](DType dtype, Shape shape) {
    return [dtype, shape](Workload& w) {
      forward(w, [&](ForwardCall& c) { c.inputs.expert_topk_weight->spec = {dtype, shape}; });
    };
  };
  const auto with_attributes = [](Attributes attributes) {
    return [attributes](Workload& w) { forward(w, no_edit, attributes); };
  };
  const auto output = [](TensorView RerouteOutputs::*member, DType dtype, Shape shape) {
    return [member, dtype, shape](Workload& w) {
      forward(w, [&](ForwardCall& c) { (c.outputs.*member).spec = {dtype, shape}; });
    };
  };
  const auto output_at = [](TensorView RerouteOutputs::*member,
                            std::function<void*(const ForwardCall&)> data) {
    return [member, data](Workload& w) {
      forward(w, [&](ForwardCall& c) { (c.outputs.*member).data = data(c); });
    };
  };
  using O = RerouteOutputs;
  const DType bf16 = DType::kBFloat16;
  const DType f32 = DType::kFloat32;
  return {
      // Rule 1.
      {"tokens_1d", keep_config, tokens_as(bf16, {1024}), invalid, {"tokens", "2-D", "[1024]"}},
      {"tokens_3d", keep_config, tokens_as(bf16, {64, 4, 4}), invalid, {"tokens", "[64, 4, 4]"}},
      {"tokens_h_0", keep_config, tokens_as(bf16, {64, 0}), invalid, {"tokens", "H", "got 0"}},
      {"tokens_a_negative", keep_config, tokens_as(bf16, {-1, 16}), invalid, {"tokens", "got -1"}},
      {"tokens_dtype_int32", keep_config, tokens_as(DType::kInt32, {64, 8}), unsupported,
       {"tokens", "int32"}},
      {"tokens_dtype_float8_e8m0", keep_config, tokens_as(DType::kFloat8E8M0, {64, 32}),
       unsupported, {"tokens", "float8_e8m0"}},
      // Rule 2.
      {"fp4_tokens_odd_h", [](WorkloadConfig& c) { c.token_dtype = DType::kFloat4E2M1; },
       tokens_as(DType::kFloat4E2M1, {64, 15}), invalid, {"tokens", "float4_e2m1", "even", "15"}},
      {"fp4_e1m2_tokens_odd_h", [](WorkloadConfig& c) { c.token_dtype = DType::kFloat4E1M2; },
       tokens_as(DType::kFloat4E1M2, {64, 1}), invalid, {"tokens", "float4_e1m2", "got 1"}},
      // Rule 3.
      {"counts_1d", keep_config, counts_as(DType::kInt32, {8}), invalid,
       {"expert_token_num_per_rank", "2-D", "[8]"}},
      {"counts_no_ranks", keep_config, counts_as(DType::kInt32, {0, 4}), invalid,
       {"expert_token_num_per_rank", "[0, 4]"}},
      {"counts_no_experts", keep_config, counts_as(DType::kInt32, {8, 0}), invalid,
       {"expert_token_num_per_rank", "[8, 0]"}},
      {"counts_dtype_float32", keep_config, counts_as(f32, {2, 4}), unsupported,
       {"expert_token_num_per_rank", "float32", "int32 or int64"}},
      // Rule 4.
      {"negative_count_int32", keep_config,
       [](Workload& w) {
         set_count(w, 5, -3);
         forward(w, no_edit);
       },
       invalid, {"expert_token_num_per_rank", "count[1][1] = -3", "negative"}},
      {"negative_count_int64", with_count_dtype(DType::kInt64),
       [](Workload& w) {
         set_count(w, 2, std::numeric_limits<std::int64_t>::min());
         forward(w, no_edit);
       },
       invalid, {"expert_token_num_per_rank", "count[0][2] = -9223372036854775808"}},
      // Rule 5.
      {"counts_sum_above_a", keep_config,
       [](Workload& w) {
         shift_sum(w, 1);
         forward(w, no_edit);
       },
       invalid, {"expert_token_num_per_rank", "counts sum to 65", "64 rows"}},
      {"counts_sum_below_a_int64", with_count_dtype(DType::kInt64),
       [](Workload& w) {
         shift_sum(w, -1);
         forward(w, no_edit);
       },
       invalid, {"expert_token_num_per_rank", "counts sum to 63", "64 rows"}},
      // Two int64 maxima and A + 2 wrap around to exactly A.
      {"int64_sum_overflow_that_wraps_to_a", with_count_dtype(DType::kInt64),
       [](Workload& w) {
         for (std::size_t i = 0; i < w.counts.size(); ++i) set_count(w, i, 0);
         set_count(w, 0, std::numeric_limits<std::int64_t>::max());
         set_count(w, 1, std::numeric_limits<std::int64_t>::max());
         set_count(w, 2, 64 + 2);
         forward(w, no_edit);
       },
       ErrorCode::kOutOfRange, {"expert_token_num_per_rank", "overflow"}},
      // Rule 7.
      {"scales_1d_dim0_not_a", with_scales(ScaleForm::kFloat32A), scales_as(f32, {63}), invalid,
       {"per_token_scales", "dim 0 is 63", "64 rows"}},
      {"scales_2d_dim0_not_a", keep_config, scales_as(f32, {65, 2}), invalid,
       {"per_token_scales", "dim 0 is 65", "64 rows"}},
      {"scales_float32_3d", keep_config, scales_as(f32, {64, 1, 2}), invalid,
       {"per_token_scales", "bfloat16 tokens", "[A], [A, S], got", "[64, 1, 2]"}},
      {"scales_float32_0d", keep_config, scales_as(f32, Shape{}), invalid,
       {"per_token_scales", "float32[]"}},
      {"scales_e8m0_with_bfloat16_tokens", with_scales(ScaleForm::kE8m0AS),
       scales_as(DType::kFloat8E8M0, {64, 2}), unsupported,
       {"per_token_scales", "float8_e8m0", "bfloat16 tokens"}},
      {"scales_e8m0_last_dim_not_2", with_fp8_scales(ScaleForm::kE8m0AK2),
       scales_as(DType::kFloat8E8M0, {64, 1, 3}), invalid,
       {"per_token_scales", "float8_e4m3fn tokens", "[A], [A, S], [A, K, 2]", "[64, 1, 3]"}},
      {"scales_e8m0_4d", with_fp8_scales(ScaleForm::kE8m0AK2),
       scales_as(DType::kFloat8E8M0, {64, 1, 2, 1}), invalid,
       {"per_token_scales", "[64, 1, 2, 1]"}},
      {"scales_width_0", keep_config, scales_as(f32, {64, 0}), invalid,
       {"per_token_scales", "dim 1", "[64, 0]"}},
      {"scales_dtype_int8", keep_config, scales_as(DType::kInt8, {64, 8}), unsupported,
       {"per_token_scales", "int8"}},
      // Rule 8.
      {"weight_dtype_bfloat16", keep_config, weight_as(bf16, {64, 1}), unsupported,
       {"expert_topk_weight", "bfloat16", "float32"}},
      {"weight_dim1_2", keep_config, weight_as(f32, {32, 2}), invalid,
       {"expert_topk_weight", "dim 1 must be 1, got 2"}},
      {"weight_dim0_not_a", keep_config, weight_as(f32, {63, 1}), invalid,
       {"expert_topk_weight", "dim 0 is 63", "64 rows"}},
      {"weight_3d", keep_config, weight_as(f32, {64, 1, 1}), invalid,
       {"expert_topk_weight", "[64, 1, 1]"}},
      {"weight_output_without_weight_input", keep_config,
       [](Workload& w) { forward(w, [](ForwardCall& c) { c.inputs.expert_topk_weight.reset(); }); },
       invalid, {"permute_topk_weight", "must be float32[0]", "float32[64, 1]"}},
      {"weight_input_without_weight_output", keep_config,
       [](Workload& w) {
         forward(w, [](ForwardCall& c) {
           c.outputs.permute_topk_weight = TensorView(nullptr, DType::kFloat32, {0});
         });
       },
       invalid, {"permute_topk_weight", "must be float32[64, 1]", "got float32[0]"}},
      // Rule 9.
      {"expert_token_num_type_2", keep_config, with_attributes({2, kIdxGather}), invalid,
       {"expert_token_num_type", "got 2"}},
      {"idx_type_minus_1", keep_config, with_attributes({kExpertTokenNumCount, -1}), invalid,
       {"idx_type", "got -1"}},
      // Whole 64-bit values: 2^32 is not 0 (gather), 2^32 + 1 not 1 (count).
      {"expert_token_num_type_2_pow_32_plus_1", keep_config,
       with_attributes({(std::int64_t{1} << 32) + 1, kIdxGather}), invalid,
       {"expert_token_num_type", "got 4294967297"}},
      {"idx_type_2_pow_32", keep_config,
       with_attributes({kExpertTokenNumCount, std::int64_t{1} << 32}), invalid,
       {"idx_type", "got 4294967296"}},
      // A DType cast from a bad integer: named before its name is looked up.
      {"tokens_dtype_enum_99", keep_config, tokens_as(DType{99}, {64, 16}), unsupported,
       {"tokens", "dtype enum value 99 is not in the dtype table"}},
      {"counts_dtype_enum_13", keep_config, counts_as(DType{13}, {2, 4}), unsupported,
       {"expert_token_num_per_rank", "dtype enum value 13"}},
      {"scales_dtype_enum_255", keep_config, scales_as(DType{255}, {64, 2}), unsupported,
       {"per_token_scales", "dtype enum value 255"}},
      {"weight_dtype_enum_20", keep_config, weight_as(DType{20}, {64, 1}), unsupported,
       {"expert_topk_weight", "dtype enum value 20"}},
      {"permute_token_idx_dtype_enum_40", keep_config,
       output(&O::permute_token_idx, DType{40}, {64}), unsupported,
       {"permute_token_idx", "dtype enum value 40"}},
      // Rule 10: output specs.
      {"permute_tokens_wrong_shape", keep_config, output(&O::permute_tokens, bf16, {64, 15}),
       invalid, {"permute_tokens", "must be bfloat16[64, 16]", "got bfloat16[64, 15]"}},
      {"permute_tokens_ndim_9", keep_config,
       [](Workload& w) {
         forward(w, [](ForwardCall& c) { c.outputs.permute_tokens.spec.shape.ndim = 9; });
       },
       invalid, {"permute_tokens", "must be bfloat16[64, 16]", "got bfloat16[ndim 9]"}},
      {"permute_tokens_wrong_dtype", keep_config,
       output(&O::permute_tokens, DType::kFloat16, {64, 16}), invalid,
       {"permute_tokens", "got float16[64, 16]"}},
      {"permute_per_token_scales_wrong_shape", keep_config,
       output(&O::permute_per_token_scales, f32, {64}), invalid,
       {"permute_per_token_scales", "must be float32[64, 2]", "got float32[64]"}},
      {"permute_token_idx_int64", keep_config,
       output(&O::permute_token_idx, DType::kInt64, {64}), invalid,
       {"permute_token_idx", "must be int32[64]", "got int64[64]"}},
      {"expert_token_num_wrong_dtype", keep_config,
       output(&O::expert_token_num, DType::kInt64, {4}), invalid,
       {"expert_token_num", "must be int32[4]", "got int64[4]"}},
      {"expert_token_num_wrong_shape", keep_config,
       output(&O::expert_token_num, DType::kInt32, {5}), invalid,
       {"expert_token_num", "got int32[5]"}},
      {"permute_tokens_null", keep_config,
       output_at(&O::permute_tokens, [](const ForwardCall&) { return nullptr; }), invalid,
       {"permute_tokens", "data is null"}},
      // Rule 10: overlap.
      {"permute_tokens_is_tokens", keep_config,
       output_at(&O::permute_tokens, [](const ForwardCall& c) { return c.inputs.tokens.data; }),
       invalid, {"permute_tokens", "overlaps input tokens"}},
      // Tokens are the first input checked, so what lies past their end cannot
      // change the message.
      {"permute_tokens_overlap_tokens_partly", keep_config,
       output_at(&O::permute_tokens,
                 [](const ForwardCall& c) {
                   return static_cast<std::byte*>(c.inputs.tokens.data) + 100;
                 }),
       invalid, {"permute_tokens", "overlaps input tokens"}},
      {"expert_token_num_inside_counts", keep_config,
       output_at(&O::expert_token_num,
                 [](const ForwardCall& c) {
                   return static_cast<std::byte*>(c.inputs.expert_token_num_per_rank.data) + 4;
                 }),
       invalid, {"expert_token_num", "overlaps input expert_token_num_per_rank"}},
      {"permute_topk_weight_overlaps_permute_scales", keep_config,
       output_at(&O::permute_topk_weight,
                 [](const ForwardCall& c) { return c.outputs.permute_per_token_scales.data; }),
       invalid, {"permute_topk_weight", "overlaps output permute_per_token_scales"}},
      {"expert_token_num_overlaps_permute_token_idx", keep_config,
       output_at(&O::expert_token_num,
                 [](const ForwardCall& c) {
                   return static_cast<std::byte*>(c.outputs.permute_token_idx.data) + 240;
                 }),
       invalid, {"expert_token_num", "overlaps output permute_token_idx"}},
      // The plan's contract.
      {"plan_run_with_tokens_of_another_spec", keep_config,
       [](Workload& w) {
         ForwardCall call = forward_call(w, WeightForm::kA1);
         const Plan plan = plan_reroute(call.inputs);
         call.inputs.tokens.spec.shape = {64, 8};
         run_reroute(plan, call.inputs, call.outputs);
       },
       invalid, {"tokens", "is bfloat16[64, 8]", "plan was made for bfloat16[64, 16]"}},
      {"plan_run_with_counts_of_another_dtype", keep_config,
       [](Workload& w) {
         ForwardCall call = forward_call(w, WeightForm::kA1);
         const Plan plan = plan_reroute(call.inputs);
         call.inputs.expert_token_num_per_rank.spec = {DType::kInt64, {2, 2}};
         run_reroute(plan, call.inputs, call.outputs);
       },
       invalid, {"expert_token_num_per_rank", "is int64[2, 2]", "made for int32[2, 4]"}},
      {"plan_run_with_a_scales_dtype_enum_outside_the_table", keep_config,
       [](Workload& w) {
         ForwardCall call = forward_call(w, WeightForm::kA1);
         const Plan plan = plan_reroute(call.inputs);
         call.inputs.per_token_scales->spec.dtype = DType{77};
         run_reroute(plan, call.inputs, call.outputs);
       },
       unsupported, {"per_token_scales", "dtype enum value 77"}},
      {"plan_with_scales_run_without", keep_config,
       [](Workload& w) {
         ForwardCall call = forward_call(w, WeightForm::kA1);
         const Plan plan = plan_reroute(call.inputs);
         call.inputs.per_token_scales.reset();
         run_reroute(plan, call.inputs, call.outputs);
       },
       invalid, {"plan", "made for 4 inputs, run with 3"}},
      {"inverse_plan_run_forward", keep_config,
       [](Workload& w) {
         const ForwardCall call = forward_call(w, WeightForm::kA1);
         run_reroute(plan_inverse(inverse_call(w, WeightForm::kA1).inputs), call.inputs,
                     call.outputs);
       },
       invalid, {"plan", "plan_inverse", "run_reroute"}},
  };
}

std::vector<Refusal> inverse_refusals() {
  const ErrorCode invalid = ErrorCode::kInvalidArgument;
  return {
      {"forward_plan_run_inverse", keep_config,
       [](Workload& w) {
         const InverseCall call = inverse_call(w, WeightForm::kA1);
         run_inverse(plan_reroute(forward_call(w, WeightForm::kA1).inputs), call.inputs,
                     call.outputs);
       },
       invalid, {"plan", "plan_reroute", "run_inverse"}},
      {"negative_count", keep_config,
       [](Workload& w) {
         set_count(w, 7, -1);
         inverse(w, [](InverseCall&) {});
       },
       invalid, {"expert_token_num_per_rank", "count[1][3] = -1"}},
      {"counts_sum_above_a", keep_config,
       [](Workload& w) {
         shift_sum(w, 1);
         inverse(w, [](InverseCall&) {});
       },
       invalid, {"expert_token_num_per_rank", "counts sum to 65", "64 rows"}},
      {"tokens_1d", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.inputs.tokens.spec.shape = {1024}; });
       },
       invalid, {"tokens", "2-D", "[1024]"}},
      {"scales_dim0_not_a", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.inputs.per_token_scales->spec.shape = {32, 4}; });
       },
       invalid, {"per_token_scales", "dim 0 is 32"}},
      {"weight_dim1_2", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.inputs.expert_topk_weight->spec.shape = {32, 2}; });
       },
       invalid, {"expert_topk_weight", "dim 1 must be 1, got 2"}},
      {"restored_scales_missing", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.outputs.restored_per_token_scales.reset(); });
       },
       invalid, {"restored_per_token_scales", "exactly when per_token_scales"}},
      {"restored_weight_without_weight", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.inputs.expert_topk_weight.reset(); });
       },
       invalid, {"restored_topk_weight", "exactly when expert_topk_weight"}},
      {"restored_tokens_wrong_shape", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.outputs.restored_tokens.spec.shape = {64, 17}; });
       },
       invalid, {"restored_tokens", "must be bfloat16[64, 16]", "got bfloat16[64, 17]"}},
      {"restored_tokens_is_tokens", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) { c.outputs.restored_tokens.data = c.inputs.tokens.data; });
       },
       invalid, {"restored_tokens", "overlaps input tokens"}},
      {"restored_weight_overlaps_restored_scales", keep_config,
       [](Workload& w) {
         inverse(w, [](InverseCall& c) {
           c.outputs.restored_topk_weight->data = c.outputs.restored_per_token_scales->data;
         });
       },
       invalid, {"restored_topk_weight", "overlaps output restored_per_token_scales"}},
  };
}

class Refusals : public ::testing::TestWithParam<Refusal> {};

TEST_P(Refusals, NameTheArgumentAndWriteNothing) {
  const Refusal& refusal = GetParam();
  WorkloadConfig config = base_config();
  refusal.configure(config);
  Workload w(config);
  const Workload original = w;
  EXPECT_EQ(refusal_difference([&] { refusal.call(w); }, refusal.code, refusal.parts), "");
  for (const auto* output :
       {&w.permute_tokens, &w.permute_scales, &w.permute_weight, &w.token_idx, &w.expert_token_num}) {
    EXPECT_EQ(std::count(output->begin(), output->end(), kPoison),
              static_cast<std::ptrdiff_t>(output->size()));
  }
  EXPECT_EQ(w.tokens, original.tokens);
  EXPECT_EQ(w.scales, original.scales);
  EXPECT_EQ(w.weight, original.weight);
}

std::string refusal_name(const ::testing::TestParamInfo<Refusal>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Forward, Refusals, ::testing::ValuesIn(forward_refusals()), refusal_name);
INSTANTIATE_TEST_SUITE_P(Inverse, Refusals, ::testing::ValuesIn(inverse_refusals()), refusal_name);

// The base workload itself is accepted, so each refusal above is caused by its edit.
TEST(Refusals, BaseWorkloadIsAccepted) {
  Workload w(base_config());
  forward(w, no_edit);
  EXPECT_EQ(w.compare(testing::reference_reroute(w.reference_inputs(), kExpertTokenNumCount,
                                                 kIdxGather)),
            "");
  Workload back(base_config());
  inverse(back, [](InverseCall&) {});
  EXPECT_EQ(inverse_outputs_difference(back), "");
}

// check_disjoint: spans that share a byte overlap; touching or empty ones do not.
TEST(CheckDisjoint, NamesTheFirstOverlappingOutput) {
  const ByteSpan inputs[] = {{"tokens", 100, 200}, {"expert_token_num_per_rank", 300, 310}};
  const auto message = [&](std::initializer_list<ByteSpan> outputs) -> std::string {
    try {
      check_disjoint(inputs, std::span<const ByteSpan>(outputs.begin(), outputs.size()));
    } catch (const Error& error) {
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      return error.what();
    }
    return "";
  };
  EXPECT_EQ(message({{"permute_tokens", 200, 300}, {"expert_token_num", 310, 320}}), "");
  EXPECT_EQ(message({{"permute_tokens", 150, 150}, {"permute_token_idx", 0, 0}}), "");
  EXPECT_EQ(message({{"permute_tokens", 0, 101}}), "permute_tokens: overlaps input tokens");
  EXPECT_EQ(message({{"permute_tokens", 400, 500}, {"expert_token_num", 305, 306}}),
            "expert_token_num: overlaps input expert_token_num_per_rank");
  EXPECT_EQ(message({{"permute_tokens", 400, 500}, {"permute_topk_weight", 499, 600}}),
            "permute_topk_weight: overlaps output permute_tokens");
}

}  // namespace
}  // namespace moe_reroute::test
