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
  std::int64_t idx_type = 0;
  std::int64_t expert_token_num_type = 1;
  std::int64_t expert_alignment = 1;
  bool allow_spare_rows = false;
  int threads = 0;
  std::string out;

  Attributes attributes() const {
    return {expert_token_num_type, idx_type, expert_alignment, allow_spare_rows};
  }
};

int run_command(const RunOptions& options);
int inverse_command(const RunOptions& options);

struct GenOptions {
  WorkloadOptions workload;
  std::string out;
};

int gen_command(const GenOptions& options);

}  // namespace moe_reroute::tools
