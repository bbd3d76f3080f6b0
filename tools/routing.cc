// `init-routing` and `finalize-routing`: read the .npy inputs, infer the
// output specs (the shape checks, before any output is allocated), run the
// operator (every other check, before it writes), then write all outputs at
// once, named as in the operator's description.

#include "moe_reroute/routing.h"

#include <optional>
#include <string>
#include <vector>

#include "commands.h"
#include "operator_files.h"

namespace moe_reroute::tools {

int init_routing_command(const InitRoutingOptions& o) {
  const InitRoutingDesc& desc = init_routing_desc();
  const LoadedTensor x =
      load_tensor(o.paths[0], desc.inputs[0].name, given(o.x_dtype), "--x-dtype");
  const LoadedTensor expert_idx = load_tensor(o.paths[1], desc.inputs[1].name, std::nullopt, "");
  const InitRoutingInputs inputs{x.view, expert_idx.view};
  const InitRoutingOutputSpecs specs = infer_init_routing(inputs, o.attributes);
  OutputBuffers buffers({specs.expanded_x, specs.expanded_row_idx,
                         specs.expert_tokens_count_or_cumsum, specs.expert_tokens_before_capacity});
  const std::vector<TensorView>& v = buffers.views;
  moe_init_routing(inputs, {v[0], v[1], v[2], v[3]}, o.attributes, o.threads);
  write_outputs(o.out, desc.outputs, v);
  return 0;
}

int finalize_routing_command(const FinalizeRoutingOptions& o) {
  const FinalizeRoutingDesc& desc = finalize_routing_desc();
  check_named_file(o.paths[5], o.scales_dtype, desc.inputs[5].name, flag_name(desc.inputs[5].name),
                   "--scales-dtype");
  const auto load = [&](std::size_t input, const std::string& dtype_name,
                        std::string_view dtype_flag) {
    return load_optional(o.paths[input], desc.inputs[input].name, dtype_name, dtype_flag);
  };
  // x1, x2 and bias have expanded_x's dtype, so its name names theirs too.
  const std::string& x_dtype = o.expanded_x_dtype;
  constexpr std::string_view kXFlag = "--expanded-x-dtype";
  const std::optional<LoadedTensor> expanded_x = load(0, x_dtype, kXFlag),
                                    expanded_row_idx = load(1, "", ""),
                                    x1 = load(2, x_dtype, kXFlag), x2 = load(3, x_dtype, kXFlag),
                                    bias = load(4, x_dtype, kXFlag),
                                    scales = load(5, o.scales_dtype, "--scales-dtype"),
                                    expert_idx = load(6, "", "");
  const FinalizeRoutingInputs inputs{expanded_x->view,   expanded_row_idx->view, view_of(x1),
                                     view_of(x2),        view_of(bias),          view_of(scales),
                                     view_of(expert_idx)};
  const FinalizeRoutingOutputSpecs specs = infer_finalize_routing(inputs, o.attributes);
  OutputBuffers buffers({specs.out});
  moe_finalize_routing(inputs, {buffers.views[0]}, o.attributes, o.threads);
  write_outputs(o.out, desc.outputs, buffers.views);
  return 0;
}

}  // namespace moe_reroute::tools
