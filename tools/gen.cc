// `gen`: random valid inputs as .npy files, and the `run` command that uses them.

#include <iostream>
#include <string>

#include "commands.h"
#include "moe_reroute/reroute.h"
#include "npy.h"
#include "output_set.h"

namespace moe_reroute::tools {

int gen_command(const GenOptions& o) {
  const testing::WorkloadConfig config = workload_config(o.workload);
  const testing::Workload workload(config);
  const RerouteInputs inputs = workload.inputs();
  plan_reroute(inputs, config.attributes, 1);

  const std::filesystem::path dir = o.out;
  std::string command = "moe-reroute run --tokens " + (dir / "tokens.npy").string() + " --counts " +
                        (dir / "counts.npy").string();
  OutputSet out(dir);
  out.add("tokens.npy", inputs.tokens);
  out.add("counts.npy", inputs.expert_token_num_per_rank);
  if (inputs.per_token_scales) {
    out.add("scales.npy", *inputs.per_token_scales);
    command += " --scales " + (dir / "scales.npy").string();
    if (default_dtype(storage_descr(config.scale_dtype)) != config.scale_dtype) {
      command += " --scales-dtype " + std::string(dtype_name(config.scale_dtype));
    }
  }
  if (inputs.expert_topk_weight) {
    out.add("topk_weight.npy", *inputs.expert_topk_weight);
    command += " --topk-weight " + (dir / "topk_weight.npy").string();
  }
  if (default_dtype(storage_descr(config.token_dtype)) != config.token_dtype) {
    command += " --tokens-dtype " + std::string(dtype_name(config.token_dtype));
  }
  for (const AttributeDesc& attribute : reroute_desc().attributes) {
    if (attribute.kind == AttributeKind::kDTypeName) continue;
    const std::int64_t value = attribute.get(config.attributes);
    if (value == attribute.default_value) continue;
    command += " " + flag_name(attribute.name);
    if (attribute.kind == AttributeKind::kInt) command += " " + std::to_string(value);
  }
  out.commit();
  std::cout << command << " --out " << (dir / "out").string() << "\n";
  return 0;
}

}  // namespace moe_reroute::tools
