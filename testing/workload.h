#pragma once

// Random valid inputs of the operator, for the CLI's gen, the tests and the
// benchmarks (library moe_reroute_workload, all the CLI links of testing/).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "moe_reroute/reroute.h"
#include "reference.h"

namespace moe_reroute::testing {

/// Counts [N * E], row-major, >= 0, summing to `num_tokens`. Each token picks a
/// block with probability proportional to 1 / (1 + rank_in_shuffled_order)^skew
/// (skew 0: uniform); a `zero_fraction` of the blocks get no token at all.
std::vector<std::int64_t> random_counts(std::int64_t num_ranks, std::int64_t num_experts,
                                        std::int64_t num_tokens, double skew,
                                        double zero_fraction, std::uint64_t seed);

/// Fills `bytes` with seeded random bytes (every bit pattern, NaNs included).
void fill_random(void* data, std::size_t bytes, std::uint64_t seed);

struct WorkloadConfig {
  std::int64_t num_tokens = 16384;
  std::int64_t hidden = 7168;
  DType token_dtype = DType::kInt8;
  std::int64_t num_ranks = 16;
  std::int64_t num_experts = 16;
  DType count_dtype = DType::kInt32;
  bool has_scales = true;
  DType scale_dtype = DType::kFloat32;
  std::vector<std::int64_t> scale_tail;  // dims after A: {} = [A], {S}, {K, 2}
  bool has_weight = true;
  double skew = 0.0;
  double zero_fraction = 0.0;
  std::uint64_t seed = 0;
  Attributes attributes;
  // Rows the counts cover: -1 is all of num_tokens; fewer leaves spare rows
  // (needs attributes.allow_spare_rows).
  std::int64_t num_valid_tokens = -1;
};

/// The forward inputs `config` describes, with null data: for inference and
/// validation before anything is allocated.
RerouteInputs meta_inputs(const WorkloadConfig& config);

/// Owns the inputs and outputs of one forward call, filled with random bytes
/// (outputs poisoned with 0xA5).
class Workload {
 public:
  explicit Workload(const WorkloadConfig& config);

  const WorkloadConfig& config() const { return config_; }
  RerouteInputs inputs() const;
  RerouteOutputs outputs();
  void poison_outputs();
  /// Bytes the operator reads plus bytes it writes.
  std::int64_t bytes_moved() const;
  /// Output rows R: num_tokens, plus E * (k - 1) when expert_alignment k > 1.
  std::int64_t num_output_rows() const;

  // Checks against the naive reference: defined beside it (compare.cc, library
  // moe_reroute_testing), so that the CLI links no reference code.
  ReferenceInputs reference_inputs() const;
  /// "" when every output equals the reference byte for byte, else the first
  /// difference; rows the contract leaves unspecified must still hold the poison.
  std::string compare(const ReferenceOutputs& expected) const;

  std::vector<std::int64_t> counts;
  std::vector<std::byte> counts_storage, tokens, scales, weight;
  std::vector<std::byte> permute_tokens, permute_scales, permute_weight, token_idx,
      expert_token_num;

 private:
  std::int64_t scale_row_bytes() const;

  WorkloadConfig config_;
};

}  // namespace moe_reroute::testing
