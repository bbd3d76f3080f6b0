// Fuzzes the forward operator (see fuzz_operator.h for what is checked).

#include <cstring>

#include "fuzz_operator.h"

namespace moe_reroute::fuzz {
namespace {

struct Forward {
  using Inputs = RerouteInputs;
  static constexpr bool kExpertOrderedTokens = false;

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
    testing::ReferenceInputs in = reference_inputs(arguments, buffers);
    in.num_tokens = arguments.tokens.shape()[0];
    const testing::ReferenceOutputs expected = testing::reference_reroute(
        in, arguments.attributes.expert_token_num_type, arguments.attributes.idx_type);
    const std::int64_t rows = expected.specified_rows;
    require_rows("permute_tokens", buffers.outputs[0], expected.tokens, rows, in.token_row_bytes);
    // Without scales the forward writes a zero float32 per row.
    require_rows("permute_per_token_scales", buffers.outputs[1], expected.scales, rows,
                 in.scales ? in.scale_row_bytes : 4);
    require_equal("permute_token_idx", buffers.outputs[2], expected.token_idx.data(),
                  expected.token_idx.size() * sizeof(std::int32_t));
    require_rows("permute_topk_weight", buffers.outputs[4], expected.weight, rows, 4);
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
