// Fuzzes the inverse operator (see fuzz_operator.h for what is checked); of
// the attributes it decodes, the inverse reads expert_alignment and allow_spare_rows.

#include "fuzz_operator.h"

namespace moe_reroute::fuzz {
namespace {

struct Inverse {
  using Inputs = InverseInputs;
  static constexpr bool kExpertOrderedTokens = true;

  static std::vector<TensorSpec> infer(const Inputs& inputs, const Attributes& attributes) {
    const InverseOutputSpecs specs = infer_inverse(inputs, attributes);
    std::vector<TensorSpec> list = {specs.restored_tokens};
    if (specs.restored_per_token_scales) list.push_back(*specs.restored_per_token_scales);
    if (specs.restored_topk_weight) list.push_back(*specs.restored_topk_weight);
    return list;
  }
  static Plan plan(const Inputs& inputs, const Attributes& attributes, int num_threads) {
    return plan_inverse(inputs, attributes, num_threads);
  }
  // Views in spec order: tokens, then scales and weight where the inputs have them.
  static InverseOutputs outputs(const Inputs& inputs, const std::vector<TensorView>& views) {
    InverseOutputs out{views[0], std::nullopt, std::nullopt};
    std::size_t next = 1;
    if (inputs.per_token_scales) out.restored_per_token_scales = views[next++];
    if (inputs.expert_topk_weight) out.restored_topk_weight = views[next++];
    return out;
  }
  static void call(const Inputs& inputs, const std::vector<TensorView>& views,
                   const Attributes& attributes, int num_threads) {
    moe_re_routing_inverse(inputs, outputs(inputs, views), attributes, num_threads);
  }
  static void run(const Plan& plan, const Inputs& inputs, const std::vector<TensorView>& views) {
    run_inverse(plan, inputs, outputs(inputs, views));
  }
  static void check_against_reference(const Arguments& arguments, const Buffers& buffers) {
    testing::ReferenceInputs in = reference_inputs(arguments, buffers);
    const std::int64_t k = arguments.attributes.expert_alignment;
    in.num_tokens = arguments.tokens.shape()[0] - (k == 1 ? 0 : in.num_experts * (k - 1));
    const testing::ReferenceOutputs expected = testing::reference_inverse(in);
    std::size_t next = 0;
    const std::int64_t rows = expected.specified_rows;
    require_rows("restored_tokens", buffers.outputs[next++], expected.tokens, rows,
                 in.token_row_bytes);
    if (arguments.scales) {
      require_rows("restored_per_token_scales", buffers.outputs[next++], expected.scales, rows,
                   in.scale_row_bytes);
    }
    if (arguments.weight) {
      require_rows("restored_topk_weight", buffers.outputs[next++], expected.weight, rows, 4);
    }
  }
};

}  // namespace
}  // namespace moe_reroute::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return moe_reroute::fuzz::fuzz_operator<moe_reroute::fuzz::Inverse>(data, size);
}
