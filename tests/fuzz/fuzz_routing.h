#pragma once

// The fuzz flow shared by moe_init_routing and moe_finalize_routing, which
// have no plan: inference refuses exactly what the call refuses for a reason
// that needs no values, with the same message, and a refused call writes no
// output byte; where inference accepts, a broken output is refused with
// nothing written, and with the right outputs the call refuses exactly where
// an input's data is null or a value breaks the contract (naming it, nothing
// written), else it equals the naive reference byte for byte.
//
// `Operator` provides Case (decoded inputs in description order over their
// own storage, attributes, num_threads, `runnable`: every input got storage),
// decode, describe (the call in a line, for findings), desc, inputs, infer
// and call over output specs and views in the order of the operator's output
// struct, value_refusal (the start of the message the contract's value rules
// require, or "") and check_against_reference.

#include <optional>
#include <string>
#include <vector>

#include "fuzz_arguments.h"

namespace moe_reroute::fuzz {

/// "<name>: data is null" for the first given input whose data is null but
/// holds bytes (the call checks inputs in description order), else "".
template <typename Desc>
std::string null_data_refusal(const Desc& desc, const std::vector<const TensorView*>& inputs) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i] && inputs[i]->data == nullptr && inputs[i]->nbytes() > 0) {
      return std::string(desc.inputs[i].name) + ": data is null";
    }
  }
  return "";
}

template <typename Operator>
int fuzz_routing(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider provider(data, size);
  typename Operator::Case c;  // decoded in place: its views point into its own storage
  Operator::decode(provider, c);
  set_finding_context(Operator::describe(c));

  std::optional<std::vector<TensorSpec>> output_specs;
  std::string infer_error;
  try {
    output_specs = Operator::infer(c);
  } catch (const Error& e) {
    infer_error = e.what();
  }
  if (!output_specs) {
    // Poisoned stand-ins: the call must refuse before it looks at its outputs' specs.
    const std::vector<TensorSpec> stand_ins(Operator::desc().outputs.size(),
                                            TensorSpec{DType::kUInt8, {16}});
    PoisonedOutputs buffers(stand_ins);
    try {
      Operator::call(c, buffers.output_views(stand_ins));
      require(false, "the call accepted what inference refused: " + infer_error);
    } catch (const Error& e) {
      require(e.what() == infer_error, "the call refused differently from inference: " +
                                           std::string(e.what()) + " / " + infer_error);
    }
    require(buffers.outputs_untouched(), "a refused call wrote output bytes");
    return 0;
  }
  if (!c.runnable || !small_enough(*output_specs)) return 0;

  PoisonedOutputs buffers(*output_specs);
  const std::vector<TensorView> outputs = buffers.output_views(*output_specs);
  std::vector<const TensorView*> inputs;
  for (const TensorView* input : Operator::inputs(c)) {
    if (input) inputs.push_back(input);
  }
  std::vector<TensorView> broken = outputs;
  std::vector<TensorView*> broken_pointers;
  for (TensorView& view : broken) broken_pointers.push_back(&view);
  const std::string breakage = break_one_output(provider, broken_pointers, inputs);
  if (!breakage.empty()) {
    try {
      Operator::call(c, broken);
      require(false, "the call accepted an output with " + breakage);
    } catch (const Error&) {
    }
    require(buffers.outputs_untouched(), "a refused call wrote output bytes (" + breakage + ")");
  }

  std::string refusal = null_data_refusal(Operator::desc(), Operator::inputs(c));
  if (refusal.empty()) refusal = Operator::value_refusal(c);
  try {
    Operator::call(c, outputs);
    require(refusal.empty(), "the call accepted what the contract refuses: " + refusal);
  } catch (const Error& e) {
    const std::string message = e.what();
    require(!refusal.empty() && message.rfind(refusal, 0) == 0,
            "the call refused with \"" + message + "\" where the contract " +
                (refusal.empty() ? std::string("accepts") : "expects \"" + refusal + "...\""));
    require(buffers.outputs_untouched(), "a refused call wrote output bytes (" + message + ")");
    return 0;
  }
  Operator::check_against_reference(c, buffers);
  return 0;
}

}  // namespace moe_reroute::fuzz
