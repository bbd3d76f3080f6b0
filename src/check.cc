#include <cstdint>
#include <string>
#include <vector>

#include "check.h"

namespace moe_reroute::detail {
namespace {

// The bytes a view spans, [begin, end): computed once per view, since every
// output is compared with every input and every earlier output.
struct Span {
  std::uintptr_t begin;
  std::uintptr_t end;

  explicit Span(const TensorView& view)
      : begin(reinterpret_cast<std::uintptr_t>(view.data)),
        end(begin + static_cast<std::uintptr_t>(view.nbytes())) {}
  bool empty() const { return begin == end; }
  bool overlaps(const Span& other) const {
    return !empty() && !other.empty() && begin < other.end && other.begin < end;
  }
};

// Rule 10's spec check of one output.
void check_output_spec(const NamedView& output, const TensorSpec& spec) {
  check_dtype_value(*output.view, output.name);
  if (!(output.view->spec == spec)) {
    fail(ErrorCode::kInvalidArgument, std::string(output.name) + ": must be " + spec.to_string() +
                                          ", got " + output.view->spec.to_string());
  }
}

}  // namespace

void check_dtype_value(const TensorView& view, const char* name) {
  const auto value = static_cast<std::size_t>(view.dtype());
  if (value >= dtype_table().size()) {
    fail(ErrorCode::kUnsupported, std::string(name) + ": dtype enum value " +
                                      std::to_string(value) + " is not in the dtype table");
  }
}

std::vector<NamedView> named_outputs(const RerouteOutputs& outputs) {
  return {{"permute_tokens", &outputs.permute_tokens},
          {"permute_per_token_scales", &outputs.permute_per_token_scales},
          {"permute_token_idx", &outputs.permute_token_idx},
          {"expert_token_num", &outputs.expert_token_num},
          {"permute_topk_weight", &outputs.permute_topk_weight}};
}

std::vector<NamedView> named_outputs(const InverseInputs& inputs, const InverseOutputs& outputs) {
  if (outputs.restored_per_token_scales.has_value() != inputs.per_token_scales.has_value()) {
    fail(ErrorCode::kInvalidArgument,
         "restored_per_token_scales: must be given exactly when per_token_scales is");
  }
  if (outputs.restored_topk_weight.has_value() != inputs.expert_topk_weight.has_value()) {
    fail(ErrorCode::kInvalidArgument,
         "restored_topk_weight: must be given exactly when expert_topk_weight is");
  }
  std::vector<NamedView> named = {{"restored_tokens", &outputs.restored_tokens}};
  if (outputs.restored_per_token_scales) {
    named.push_back({"restored_per_token_scales", &*outputs.restored_per_token_scales});
  }
  if (outputs.restored_topk_weight) {
    named.push_back({"restored_topk_weight", &*outputs.restored_topk_weight});
  }
  return named;
}

void check_run_arguments(const std::vector<TensorSpec>& input_specs,
                         const std::vector<NamedView>& inputs,
                         const std::vector<TensorSpec>& output_specs,
                         const std::vector<NamedView>& outputs) {
  if (input_specs.size() != inputs.size()) {
    fail(ErrorCode::kInvalidArgument,
         "plan: made for " + std::to_string(input_specs.size()) + " inputs, run with " +
             std::to_string(inputs.size()) + " (optional inputs must match the plan)");
  }
  if (output_specs.size() != outputs.size()) {
    fail(ErrorCode::kInvalidArgument,
         "plan: made for " + std::to_string(output_specs.size()) + " outputs, run with " +
             std::to_string(outputs.size()) + " (optional outputs must match the inputs)");
  }
  // Each view's bytes are computed only once its spec has passed: a spec that
  // differs from the plan's may overflow int64.
  std::vector<Span> input_spans;
  input_spans.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const NamedView& input = inputs[i];
    check_dtype_value(*input.view, input.name);
    if (!(input.view->spec == input_specs[i])) {
      fail(ErrorCode::kInvalidArgument, std::string(input.name) + ": is " +
                                            input.view->spec.to_string() +
                                            " but the plan was made for " +
                                            input_specs[i].to_string());
    }
    input_spans.emplace_back(*input.view);
    if (input.view->data == nullptr && !input_spans[i].empty()) {
      fail(ErrorCode::kInvalidArgument, std::string(input.name) + ": data is null");
    }
  }
  std::vector<Span> output_spans;
  output_spans.reserve(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const NamedView& output = outputs[i];
    const TensorView& view = *output.view;
    check_output_spec(output, output_specs[i]);
    const Span& span = output_spans.emplace_back(view);
    if (view.data == nullptr && !span.empty()) {
      fail(ErrorCode::kInvalidArgument, std::string(output.name) + ": data is null");
    }
    for (std::size_t j = 0; j < inputs.size(); ++j) {
      if (span.overlaps(input_spans[j])) {
        fail(ErrorCode::kInvalidArgument,
             std::string(output.name) + ": overlaps input " + inputs[j].name);
      }
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (span.overlaps(output_spans[j])) {
        fail(ErrorCode::kInvalidArgument,
             std::string(output.name) + ": overlaps output " + outputs[j].name);
      }
    }
  }
}

}  // namespace moe_reroute::detail

namespace moe_reroute {

void check_output_specs(const RerouteOutputSpecs& specs, const RerouteOutputs& outputs) {
  const std::vector<detail::NamedView> named = detail::named_outputs(outputs);
  const TensorSpec expected[] = {specs.permute_tokens, specs.permute_per_token_scales,
                                 specs.permute_token_idx, specs.expert_token_num,
                                 specs.permute_topk_weight};
  for (std::size_t i = 0; i < named.size(); ++i) detail::check_output_spec(named[i], expected[i]);
}

}  // namespace moe_reroute
