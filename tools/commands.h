#pragma once

// The subcommands of moe-reroute. Each returns the process exit status and
// throws moe_reroute::Error for bad input (main turns it into exit status 2).

#include <cstdint>
#include <string>

#include "workload.h"

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

/// The workload `bench` and `gen` build; the defaults are the reference
/// library's example (A = 16384, H = 7168, int8, 16 ranks x 16 experts).
struct WorkloadOptions {
  std::int64_t tokens = 16384;
  std::int64_t hidden = 7168;
  std::int64_t ranks = 16;
  std::int64_t experts = 16;
  std::string tokens_dtype = "int8";
  std::string counts_dtype = "int32";
  // none, f32 ([A]), f32xS, f32k2 ([A, K, 2], K = ceil(H/64)), e8m0a ([A]), e8m0xS, e8m0 ([A, K, 2])
  std::string scales = "f32";
  bool topk_weight = true;
  double skew = 0.0;
  std::uint64_t seed = 0;
  std::int64_t idx_type = 0;
  std::int64_t expert_token_num_type = 1;
  std::int64_t expert_alignment = 1;
  std::int64_t valid_tokens = -1;  // rows the counts cover; -1: all (else allow_spare_rows)
};

/// The testing workload for `options`; throws Error naming the flag for an
/// unknown dtype name or scales form.
testing::WorkloadConfig workload_config(const WorkloadOptions& options);

struct BenchOptions {
  WorkloadOptions workload;
  int threads = 0;
  int repeat = 20;
  bool json = false;
};

int bench_command(const BenchOptions& options);

struct GenOptions {
  WorkloadOptions workload;
  std::string out;
};

int gen_command(const GenOptions& options);

}  // namespace moe_reroute::tools
