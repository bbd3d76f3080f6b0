#pragma once

// The subcommands of moe-reroute. Each returns the process exit status and
// throws moe_reroute::Error for bad input (main turns it into exit status 2).

#include <cstdint>
#include <string>

#include "options.h"

namespace moe_reroute::tools {

/// `run` and `inverse`: the operator on .npy files. Empty paths and names are absent.
struct RunOptions {
  std::string tokens, counts, scales, topk_weight;
  std::string tokens_dtype, scales_dtype;
  Attributes attributes;
  int threads = 0;
  std::string out;
};

int run_command(const RunOptions& options);
int inverse_command(const RunOptions& options);

struct GenOptions {
  WorkloadOptions workload;
  std::string out;
};

int gen_command(const GenOptions& options);

}  // namespace moe_reroute::tools
