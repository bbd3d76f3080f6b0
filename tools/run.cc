// `run` and `inverse`: read .npy inputs, plan (every check happens here, before
// anything is written), run, then write all outputs at once.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "moe_reroute/reroute.h"
#include "operator_files.h"

namespace moe_reroute::tools {
namespace {

struct LoadedInputs {
  LoadedTensor tokens, counts;
  std::optional<LoadedTensor> scales, weight;
};

LoadedInputs load_inputs(const RunOptions& o) {
  check_named_file(o.scales, o.scales_dtype, "per_token_scales", "--scales", "--scales-dtype");
  return {load_tensor(o.tokens, "tokens", given(o.tokens_dtype), "--tokens-dtype"),
          load_tensor(o.counts, "expert_token_num_per_rank", std::nullopt, ""),
          load_optional(o.scales, "per_token_scales", o.scales_dtype, "--scales-dtype"),
          load_optional(o.topk_weight, "expert_topk_weight", "", "")};
}

}  // namespace

int run_command(const RunOptions& o) {
  const LoadedInputs loaded = load_inputs(o);
  const RerouteInputs inputs{loaded.tokens.view, loaded.counts.view, view_of(loaded.scales),
                             view_of(loaded.weight)};
  const Plan plan = plan_reroute(inputs, o.attributes, o.threads);
  OutputBuffers buffers(plan.output_specs());
  const std::vector<TensorView>& v = buffers.views;
  run_reroute(plan, inputs, {v[0], v[1], v[2], v[3], v[4]});
  write_outputs(o.out, reroute_desc().outputs, v);
  return 0;
}

int inverse_command(const RunOptions& o) {
  const LoadedInputs loaded = load_inputs(o);
  const InverseInputs inputs{loaded.tokens.view, loaded.counts.view, view_of(loaded.scales),
                             view_of(loaded.weight)};
  const Plan plan = plan_inverse(inputs, o.attributes, o.threads);
  OutputBuffers buffers(plan.output_specs());
  const std::vector<TensorView>& v = buffers.views;
  InverseOutputs outputs{v[0], std::nullopt, std::nullopt};
  std::size_t next = 1;
  if (inputs.per_token_scales) outputs.restored_per_token_scales = v[next++];
  if (inputs.expert_topk_weight) outputs.restored_topk_weight = v[next++];
  run_inverse(plan, inputs, outputs);
  // An absent output is written too, as the empty (0,) float32 file `run`
  // writes for its weight, so no earlier run's file stays beside this run's.
  const TensorView absent(nullptr, DType::kFloat32, Shape{0});
  write_outputs(o.out, inverse_desc().outputs,
                {outputs.restored_tokens, outputs.restored_per_token_scales.value_or(absent),
                 outputs.restored_topk_weight.value_or(absent)});
  return 0;
}

}  // namespace moe_reroute::tools
