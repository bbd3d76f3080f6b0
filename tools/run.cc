// `run` and `inverse`: read .npy inputs, plan (every check happens here, before
// anything is written), run, then write all outputs at once.

#include <cstddef>
#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "moe_reroute/reroute.h"
#include "npy.h"
#include "output_set.h"

namespace moe_reroute::tools {
namespace {

std::optional<std::string> given(const std::string& value) {
  return value.empty() ? std::nullopt : std::optional(value);
}

struct LoadedInputs {
  LoadedTensor tokens, counts;
  std::optional<LoadedTensor> scales, weight;
};

LoadedInputs load_inputs(const RunOptions& o) {
  LoadedInputs in{load_tensor(o.tokens, "tokens", given(o.tokens_dtype), "--tokens-dtype"),
                  load_tensor(o.counts, "expert_token_num_per_rank", std::nullopt, ""),
                  std::nullopt, std::nullopt};
  if (!o.scales.empty()) {
    in.scales = load_tensor(o.scales, "per_token_scales", given(o.scales_dtype), "--scales-dtype");
  } else if (!o.scales_dtype.empty()) {
    throw Error(ErrorCode::kInvalidArgument, "per_token_scales: --scales-dtype needs --scales");
  }
  if (!o.topk_weight.empty()) {
    in.weight = load_tensor(o.topk_weight, "expert_topk_weight", std::nullopt, "");
  }
  return in;
}

std::optional<TensorView> view_of(const std::optional<LoadedTensor>& loaded) {
  return loaded ? std::optional(loaded->view) : std::nullopt;
}

// Output buffers for the plan's output specs, in their order.
struct OutputBuffers {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<TensorView> views;

  explicit OutputBuffers(const std::vector<TensorSpec>& specs) {
    bytes.reserve(specs.size());
    for (const TensorSpec& spec : specs) {
      bytes.emplace_back(static_cast<std::size_t>(spec.nbytes()));
      views.emplace_back(bytes.back().data(), spec.dtype, spec.shape);
    }
  }
};

void write_outputs(const std::string& dir, const std::vector<std::string>& names,
                   const std::vector<TensorView>& views) {
  OutputSet out(dir);
  for (std::size_t i = 0; i < names.size(); ++i) out.add(names[i], views[i]);
  out.commit();
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
  write_outputs(o.out,
                {"permute_tokens.npy", "permute_per_token_scales.npy", "permute_token_idx.npy",
                 "expert_token_num.npy", "permute_topk_weight.npy"},
                v);
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
  write_outputs(o.out,
                {"restored_tokens.npy", "restored_per_token_scales.npy",
                 "restored_topk_weight.npy"},
                {outputs.restored_tokens, outputs.restored_per_token_scales.value_or(absent),
                 outputs.restored_topk_weight.value_or(absent)});
  return 0;
}

}  // namespace moe_reroute::tools
