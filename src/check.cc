#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "check.h"
#include "moe_reroute/operator.h"

namespace moe_reroute::detail {
namespace {

// The bytes a contiguous view spans.
ByteSpan span_of(const NamedView& named) {
  const auto begin = reinterpret_cast<std::uintptr_t>(named.view->data);
  return {named.name, begin, begin + static_cast<std::uintptr_t>(named.view->nbytes())};
}

bool overlaps(const ByteSpan& a, const ByteSpan& b) {
  return a.begin != a.end && b.begin != b.end && a.begin < b.end && b.begin < a.end;
}

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
  const TensorView* views[] = {&outputs.permute_tokens, &outputs.permute_per_token_scales,
                               &outputs.permute_token_idx, &outputs.expert_token_num,
                               &outputs.permute_topk_weight};
  std::vector<NamedView> named;
  for (std::size_t i = 0; i < std::size(views); ++i) {
    named.push_back({reroute_desc().outputs[i].name.data(), views[i]});
  }
  return named;
}

std::vector<NamedView> named_outputs(const InverseInputs& inputs, const InverseOutputs& outputs) {
  const TensorView* inputs_of[] = {&inputs.tokens, &inputs.expert_token_num_per_rank,
                                   given(inputs.per_token_scales), given(inputs.expert_topk_weight)};
  const TensorView* views[] = {&outputs.restored_tokens, given(outputs.restored_per_token_scales),
                               given(outputs.restored_topk_weight)};
  std::vector<NamedView> named;
  for (std::size_t i = 0; i < std::size(views); ++i) {
    const OutputDesc& output = inverse_desc().outputs[i];
    const auto like = static_cast<std::size_t>(output.stored_like);
    if (output.optional && (views[i] != nullptr) != (inputs_of[like] != nullptr)) {
      fail(ErrorCode::kInvalidArgument, std::string(output.name) + ": must be given exactly when " +
                                            std::string(inverse_desc().inputs[like].name) + " is");
    }
    if (views[i]) named.push_back({output.name.data(), views[i]});
  }
  return named;
}

void check_run_arguments(std::span<const TensorSpec> input_specs,
                         const std::vector<NamedView>& inputs,
                         std::span<const TensorSpec> output_specs,
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
  std::vector<ByteSpan> input_spans;
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
    const ByteSpan& span = input_spans.emplace_back(span_of(input));
    if (input.view->data == nullptr && span.begin != span.end) {
      fail(ErrorCode::kInvalidArgument, std::string(input.name) + ": data is null");
    }
  }
  std::vector<ByteSpan> output_spans;
  output_spans.reserve(outputs.size());
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const NamedView& output = outputs[i];
    check_output_spec(output, output_specs[i]);
    const ByteSpan& span = output_spans.emplace_back(span_of(output));
    if (output.view->data == nullptr && span.begin != span.end) {
      fail(ErrorCode::kInvalidArgument, std::string(output.name) + ": data is null");
    }
  }
  check_disjoint(input_spans, output_spans);
}

}  // namespace moe_reroute::detail

namespace moe_reroute {

void check_disjoint(std::span<const ByteSpan> inputs, std::span<const ByteSpan> outputs) {
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const ByteSpan& input : inputs) {
      if (detail::overlaps(outputs[i], input)) {
        detail::fail(ErrorCode::kInvalidArgument,
                     std::string(outputs[i].name) + ": overlaps input " + input.name);
      }
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (detail::overlaps(outputs[i], outputs[j])) {
        detail::fail(ErrorCode::kInvalidArgument,
                     std::string(outputs[i].name) + ": overlaps output " + outputs[j].name);
      }
    }
  }
}

void check_disjoint(std::span<const ByteSpan> inputs, const RerouteOutputs& outputs) {
  std::vector<ByteSpan> spans;
  for (const detail::NamedView& output : detail::named_outputs(outputs)) {
    spans.push_back(detail::span_of(output));
  }
  check_disjoint(inputs, spans);
}

void check_output_specs(const RerouteOutputSpecs& specs, const RerouteOutputs& outputs) {
  const std::vector<detail::NamedView> named = detail::named_outputs(outputs);
  const TensorSpec expected[] = {specs.permute_tokens, specs.permute_per_token_scales,
                                 specs.permute_token_idx, specs.expert_token_num,
                                 specs.permute_topk_weight};
  for (std::size_t i = 0; i < named.size(); ++i) detail::check_output_spec(named[i], expected[i]);
}

}  // namespace moe_reroute
