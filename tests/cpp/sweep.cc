#include "sweep.h"

#include <algorithm>
#include <random>

#include "reference.h"

namespace moe_reroute::test {
namespace {

// The workload a case runs on: it holds a weight exactly when the case has one.
testing::Workload make_workload(const Case& c) {
  testing::WorkloadConfig config = c.config;
  config.has_weight = c.weight != WeightForm::kNone;
  return testing::Workload(config);
}

std::optional<TensorView> weight_view(void* data, std::int64_t num_tokens, WeightForm form) {
  switch (form) {
    case WeightForm::kA1:
      return TensorView(data, DType::kFloat32, {num_tokens, 1});
    case WeightForm::kA:
      return TensorView(data, DType::kFloat32, {num_tokens});
    case WeightForm::kNone:
      return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

std::vector<DType> token_dtypes() {
  std::vector<DType> dtypes;
  for (const DTypeInfo& info : dtype_table()) {
    if (info.roles & kRoleToken) dtypes.push_back(info.dtype);
  }
  return dtypes;
}

std::vector<DType> all_dtypes() {
  std::vector<DType> dtypes;
  for (const DTypeInfo& info : dtype_table()) dtypes.push_back(info.dtype);
  return dtypes;
}

std::string direction_name(Direction direction) {
  return direction == Direction::kForward ? "forward" : "inverse";
}

std::string scale_form_name(ScaleForm form) {
  switch (form) {
    case ScaleForm::kNone:
      return "none";
    case ScaleForm::kFloat32A:
      return "f32_A";
    case ScaleForm::kFloat32AS:
      return "f32_AS";
    case ScaleForm::kFloat32AK2:
      return "f32_AK2";
    case ScaleForm::kE8m0A:
      return "e8m0_A";
    case ScaleForm::kE8m0AS:
      return "e8m0_AS";
    case ScaleForm::kE8m0AK2:
      return "e8m0_AK2";
  }
  return "";
}

bool scales_pair(DType token_dtype, ScaleForm form) {
  const bool fp8 = token_dtype == DType::kFloat8E5M2 || token_dtype == DType::kFloat8E4M3FN;
  const bool fp4 = token_dtype == DType::kFloat4E2M1 || token_dtype == DType::kFloat4E1M2;
  switch (form) {
    case ScaleForm::kNone:
    case ScaleForm::kFloat32A:
    case ScaleForm::kFloat32AS:
      return true;
    case ScaleForm::kFloat32AK2:
    case ScaleForm::kE8m0AK2:
      return fp8;
    case ScaleForm::kE8m0A:
    case ScaleForm::kE8m0AS:
      return fp8 || fp4;
  }
  return false;
}

std::vector<std::tuple<DType, ScaleForm>> scale_pairings(bool accepted) {
  std::vector<std::tuple<DType, ScaleForm>> pairings;
  for (DType dtype : token_dtypes()) {
    for (ScaleForm form : kScaleForms) {
      if (scales_pair(dtype, form) == accepted) pairings.emplace_back(dtype, form);
    }
  }
  return pairings;
}

void set_scale_form(testing::WorkloadConfig& config, ScaleForm form, std::int64_t width) {
  config.has_scales = form != ScaleForm::kNone;
  const bool e8m0 = form == ScaleForm::kE8m0A || form == ScaleForm::kE8m0AS ||
                    form == ScaleForm::kE8m0AK2;
  config.scale_dtype = e8m0 ? DType::kFloat8E8M0 : DType::kFloat32;
  switch (form) {
    case ScaleForm::kNone:
    case ScaleForm::kFloat32A:
    case ScaleForm::kE8m0A:
      config.scale_tail = {};
      break;
    case ScaleForm::kFloat32AS:
    case ScaleForm::kE8m0AS:
      config.scale_tail = {width};
      break;
    case ScaleForm::kFloat32AK2:
    case ScaleForm::kE8m0AK2:
      config.scale_tail = {std::max<std::int64_t>(1, config.hidden / 64), 2};
      break;
  }
}

std::string weight_form_name(WeightForm form) {
  switch (form) {
    case WeightForm::kA1:
      return "A1";
    case WeightForm::kA:
      return "A";
    case WeightForm::kNone:
      return "none";
  }
  return "";
}

std::string Case::to_string() const {
  const testing::WorkloadConfig& c = config;
  const std::string scales = c.has_scales ? std::string(dtype_name(c.scale_dtype)) + " tail " +
                                                Shape(c.scale_tail).to_string()
                                          : "none";
  return "A=" + std::to_string(c.num_tokens) + " H=" + std::to_string(c.hidden) +
         " N=" + std::to_string(c.num_ranks) + " E=" + std::to_string(c.num_experts) +
         " tokens=" + std::string(dtype_name(c.token_dtype)) +
         " counts=" + std::string(dtype_name(c.count_dtype)) + " scales=" + scales +
         " weight=" + weight_form_name(weight) +
         " idx_type=" + std::to_string(c.attributes.idx_type) +
         " expert_token_num_type=" + std::to_string(c.attributes.expert_token_num_type) +
         " skew=" + std::to_string(c.skew) + " zero_fraction=" + std::to_string(c.zero_fraction) +
         " seed=" + std::to_string(c.seed);
}

Case random_case(DType token_dtype, ScaleForm scales, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto uniform = [&rng](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  Case c;
  testing::WorkloadConfig& config = c.config;
  config.token_dtype = token_dtype;
  config.num_ranks = uniform(1, 8);
  config.num_experts = uniform(1, 8);
  config.num_tokens = uniform(0, 300);
  config.hidden = uniform(1, 160);
  if (dtype_info(token_dtype).bits < 8) config.hidden += config.hidden % 2;
  config.skew = static_cast<double>(uniform(0, 3)) * 0.5;
  config.zero_fraction = static_cast<double>(uniform(0, 2)) * 0.25;
  config.seed = seed;
  set_scale_form(config, scales, uniform(1, 4));
  return c;
}

std::vector<Case> sweep_cases(DType token_dtype, ScaleForm scales, bool every_attribute,
                              std::uint64_t seed) {
  std::vector<Attributes> attributes = {{}};
  if (every_attribute) {
    attributes = {{kExpertTokenNumCount, kIdxGather},
                  {kExpertTokenNumCount, kIdxScatter},
                  {kExpertTokenNumCumsum, kIdxGather},
                  {kExpertTokenNumCumsum, kIdxScatter}};
  }
  std::vector<Case> cases;
  for (DType count_dtype : kCountDTypes) {
    for (WeightForm weight : kWeightForms) {
      for (const Attributes& attribute : attributes) {
        Case c = random_case(token_dtype, scales, seed + cases.size());
        c.config.count_dtype = count_dtype;
        c.config.attributes = attribute;
        c.weight = weight;
        cases.push_back(c);
      }
    }
  }
  return cases;
}

std::vector<Edge> edges() {
  return {
      {"zero_counts", 4, 8, 200, 32, 0.0, 0.5},
      {"one_block_holds_every_token", 4, 4, 300, 16, 0.0, 1.0},
      {"one_rank", 1, 8, 100, 24},
      {"one_expert", 8, 1, 100, 24},
      {"one_rank_one_expert", 1, 1, 50, 10},
      {"no_tokens", 3, 5, 0, 16},
      {"hidden_20000", 2, 3, 24, 20000, 1.0},
      {"sparse_64x64_counts", 64, 64, 500, 8, 0.0, 0.9},
      {"skewed_counts", 8, 16, 1000, 16, 2.0},
  };
}

Case edge_case(const Edge& edge, DType token_dtype, std::uint64_t seed) {
  Case c;
  testing::WorkloadConfig& config = c.config;
  config.token_dtype = token_dtype;
  config.num_ranks = edge.num_ranks;
  config.num_experts = edge.num_experts;
  config.num_tokens = edge.num_tokens;
  config.hidden = edge.hidden;
  config.skew = edge.skew;
  config.zero_fraction = edge.zero_fraction;
  config.seed = seed;
  set_scale_form(config, ScaleForm::kFloat32AS, 2);
  return c;
}

ForwardCall forward_call(testing::Workload& workload, WeightForm weight) {
  ForwardCall call{workload.inputs(), workload.outputs()};
  const std::int64_t num_tokens = workload.config().num_tokens;
  call.inputs.expert_topk_weight = weight_view(workload.weight.data(), num_tokens, weight);
  call.outputs.permute_topk_weight =
      weight_view(workload.permute_weight.data(), num_tokens, weight)
          .value_or(TensorView(nullptr, DType::kFloat32, {0}));
  return call;
}

InverseCall inverse_call(testing::Workload& workload, WeightForm weight) {
  const ForwardCall forward = forward_call(workload, weight);
  InverseCall call;
  call.inputs = {forward.inputs.tokens, forward.inputs.expert_token_num_per_rank,
                 forward.inputs.per_token_scales, forward.inputs.expert_topk_weight};
  call.outputs.restored_tokens = forward.outputs.permute_tokens;
  if (forward.inputs.per_token_scales) {
    call.outputs.restored_per_token_scales = forward.outputs.permute_per_token_scales;
  }
  if (forward.inputs.expert_topk_weight) {
    call.outputs.restored_topk_weight = forward.outputs.permute_topk_weight;
  }
  return call;
}

std::string forward_difference(const Case& c, int num_threads) {
  testing::Workload workload = make_workload(c);
  const ForwardCall call = forward_call(workload, c.weight);
  moe_re_routing(call.inputs, call.outputs, c.config.attributes, num_threads);
  return workload.compare(testing::reference_reroute(workload.reference_inputs(),
                                                     c.config.attributes.expert_token_num_type,
                                                     c.config.attributes.idx_type));
}

std::string inverse_difference(const Case& c, int num_threads) {
  testing::Workload workload = make_workload(c);
  const InverseCall call = inverse_call(workload, c.weight);
  moe_re_routing_inverse(call.inputs, call.outputs, {}, num_threads);
  return inverse_outputs_difference(workload);
}

std::string difference(Direction direction, const Case& c, int num_threads) {
  return direction == Direction::kForward ? forward_difference(c, num_threads)
                                          : inverse_difference(c, num_threads);
}

std::string inverse_outputs_difference(const testing::Workload& workload) {
  const testing::ReferenceOutputs expected = testing::reference_inverse(workload.reference_inputs());
  const bool has_scales = workload.config().has_scales;
  for (const std::string& diff :
       {testing::first_difference("restored_tokens", workload.permute_tokens,
                                  expected.tokens.data(), expected.tokens.size()),
        has_scales ? testing::first_difference("restored_per_token_scales",
                                               workload.permute_scales, expected.scales.data(),
                                               expected.scales.size())
                   : std::string(),
        testing::first_difference("restored_topk_weight", workload.permute_weight,
                                  expected.weight.data(), expected.weight.size())}) {
    if (!diff.empty()) return diff;
  }
  return "";
}

std::string refusal_difference(const std::function<void()>& call, ErrorCode code,
                               const std::vector<std::string>& parts) {
  try {
    call();
  } catch (const Error& error) {
    const std::string message = error.what();
    if (error.code() != code) {
      return std::string("code ") + error_code_name(error.code()) + ", expected " +
             error_code_name(code) + ": " + message;
    }
    for (const std::string& part : parts) {
      if (message.find(part) == std::string::npos) {
        return "message \"" + message + "\" lacks \"" + part + "\"";
      }
    }
    return "";
  }
  return "no error thrown";
}

}  // namespace moe_reroute::test
