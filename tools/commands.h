#pragma once

// The subcommands of moe-reroute. Each returns the process exit status and
// throws moe_reroute::Error for bad input (main turns it into exit status 2).

#include <cstdint>
#include <string>
#include <vector>

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

/// `init-routing` and `finalize-routing`: the operator on .npy files, named by
/// the inputs of its description (`paths`, in their order; empty: absent).
template <typename A>
struct OperatorOptions {
  std::vector<std::string> paths;
  A attributes;
  int threads = 0;
  std::string out;
};

struct InitRoutingOptions : OperatorOptions<InitRoutingAttributes> {
  std::string x_dtype;
};

/// `expanded_x_dtype` names the dtype of expanded_x and of x1, x2 and bias,
/// which have expanded_x's dtype.
struct FinalizeRoutingOptions : OperatorOptions<FinalizeRoutingAttributes> {
  std::string expanded_x_dtype, scales_dtype;
};

int init_routing_command(const InitRoutingOptions& options);
int finalize_routing_command(const FinalizeRoutingOptions& options);

struct GenOptions {
  WorkloadOptions workload;
  std::string out;
};

int gen_command(const GenOptions& options);

}  // namespace moe_reroute::tools
