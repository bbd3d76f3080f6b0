#pragma once

// The fuzz flow shared by the forward and the inverse: inference must refuse
// exactly what planning refuses, with the same message, and agree on the
// outputs; an accepted plan must tile the rows; a small call gets real
// buffers: refused, it writes nothing; with a broken output, running refuses
// and writes nothing; accepted, it equals the naive reference byte for byte.
//
// `Operator` provides Inputs, infer, plan, call (plan and run in one), run
// and check_against_reference, all over output specs and views in the order
// of the operator's output struct.

#include <optional>
#include <string>
#include <vector>

#include "fuzz_arguments.h"

namespace moe_reroute::fuzz {

template <typename Operator>
int fuzz_operator(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider provider(data, size);
  const Arguments arguments = decode_arguments(provider, Operator::kExpertOrderedTokens);
  const typename Operator::Inputs shapes{arguments.tokens, arguments.counts, arguments.scales,
                                         arguments.weight};

  std::optional<std::vector<TensorSpec>> output_specs;
  std::string infer_error;
  try {
    output_specs = Operator::infer(shapes, arguments.attributes);
  } catch (const Error& e) {
    infer_error = e.what();
  }
  std::optional<Plan> plan;
  std::string plan_error;
  try {
    plan = Operator::plan(shapes, arguments.attributes, arguments.num_threads);
  } catch (const Error& e) {
    plan_error = e.what();
  }
  if (!output_specs) {
    require(!plan && plan_error == infer_error,
            "planning did not refuse as inference did: " + infer_error + " / " + plan_error);
    return 0;
  }
  if (plan) {
    require(plan->output_specs() == *output_specs, "plan and inference disagree on the outputs");
    require_plan_tiles(*plan);
  }
  std::vector<TensorSpec> all_specs = *output_specs;
  all_specs.push_back(arguments.tokens.spec);
  if (arguments.scales) all_specs.push_back(arguments.scales->spec);
  if (arguments.weight) all_specs.push_back(arguments.weight->spec);
  if (!small_enough(all_specs)) return 0;

  Buffers buffers(arguments, *output_specs);
  const auto inputs = buffers.inputs<typename Operator::Inputs>(arguments);
  const std::vector<TensorView> outputs = buffers.output_views(*output_specs);
  if (!plan) {
    try {
      Operator::call(inputs, outputs, arguments.attributes, arguments.num_threads);
      require(false, "the one-call form accepted what planning refused: " + plan_error);
    } catch (const Error& e) {
      require(e.what() == plan_error, "the one-call form refused differently: " +
                                          std::string(e.what()) + " / " + plan_error);
    }
    require(buffers.outputs_untouched(), "a refused call wrote output bytes");
    return 0;
  }

  std::vector<TensorView> broken = outputs;
  std::vector<TensorView*> broken_pointers;
  for (TensorView& view : broken) broken_pointers.push_back(&view);
  const std::string breakage = break_one_output(provider, broken_pointers, {&inputs.tokens});
  if (!breakage.empty()) {
    try {
      Operator::run(*plan, inputs, broken);
      require(false, "running accepted an output with " + breakage);
    } catch (const Error&) {
    }
    require(buffers.outputs_untouched(), "a refused run wrote output bytes (" + breakage + ")");
  }

  Operator::run(*plan, inputs, outputs);
  Operator::check_against_reference(arguments, buffers);
  return 0;
}

}  // namespace moe_reroute::fuzz
