// Fuzzes the forward operator (see fuzz_operator.h for what is checked).

#include <cstring>

#include "fuzz_operator.h"

namespace moe_reroute::fuzz {
namespace {

struct Forward {
  using Inputs = RerouteInputs;

  static std::vector<TensorSpec> infer(const Inputs& inputs, const Attributes& attributes) {
    const RerouteOutputSpecs specs = infer_reroute(inputs, attributes);
    return {specs.permute_tokens, specs.permute_per_token_scales, specs.permute_token_idx,
            specs.expert_token_num, specs.permute_topk_weight};
  }
  static Plan plan(const Inputs& inputs, const Attributes& attributes, int num_threads) {
    return plan_reroute(inputs, attributes, num_threads);
  }
  static RerouteOutputs outputs(const std::vector<TensorView>& views) {
    return {views[0], views[1], views[2], views[3], views[4]};
  }
  static void call(const Inputs& inputs, const std::vector<TensorView>& views,
                   const Attributes& attributes, int num_threads) {
    moe_re_routing(inputs, outputs(views), attributes, num_threads);
  }
  static void run(const Plan& plan, const Inputs& inputs, const std::vector<TensorView>& views) {
    run_reroute(plan, inputs, outputs(views));
  }
  static void check_against_reference(const Arguments& arguments, const Buffers& buffers) {
    const testing::ReferenceOutputs expected = testing::reference_reroute(
        reference_inputs(arguments, buffers), arguments.attributes.expert_token_num_type,
        arguments.attributes.idx_type);
    require_equal("permute_tokens", buffers.outputs[0], expected.tokens.data(),
                  expected.tokens.size());
    require_equal("permute_per_token_scales", buffers.outputs[1], expected.scales.data(),
                  expected.scales.size());
    require_equal("permute_token_idx", buffers.outputs[2], expected.token_idx.data(),
                  expected.token_idx.size() * sizeof(std::int32_t));
    require_equal("permute_topk_weight", buffers.outputs[4], expected.weight.data(),
                  expected.weight.size());
    const bool int32 = arguments.counts.dtype() == DType::kInt32;
    const std::vector<std::byte>& got = buffers.outputs[3];
    require(got.size() == expected.expert_token_num.size() * (int32 ? 4 : 8),
            "expert_token_num: wrong size");
    for (std::size_t e = 0; e < expected.expert_token_num.size(); ++e) {
      std::int32_t value32 = 0;
      std::int64_t value = 0;
      if (int32) {
        std::memcpy(&value32, got.data() + e * 4, 4);
        value = value32;
      } else {
        std::memcpy(&value, got.data() + e * 8, 8);
      }
      require(value == expected.expert_token_num[e],
              "expert_token_num[" + std::to_string(e) + "] differs from the reference");
    }
  }
};

}  // namespace
}  // namespace moe_reroute::fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  return moe_reroute::fuzz::fuzz_operator<moe_reroute::fuzz::Forward>(data, size);
}
