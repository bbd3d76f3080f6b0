#pragma once

// Random inputs and the copy limit, shared by the tests, the CLI's bench and
// gen, and the benchmarks.

#include <cstddef>
#include <cstdint>
#include <functional>
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

/// The byte every test fills outputs with before a run.
inline constexpr std::byte kPoison{0xA5};

/// "" when the first `specified_rows` rows of `row_bytes` bytes of `got` equal
/// `expected`'s and every byte after them still holds kPoison (rows the
/// contract leaves unspecified must not be written), else the first difference.
std::string rows_difference(const char* name, const std::byte* got, std::size_t got_bytes,
                            const std::vector<std::byte>& expected, std::int64_t specified_rows,
                            std::int64_t row_bytes);

/// "" when `got` holds exactly the `expected_bytes` bytes at `expected`, else
/// "<name>: byte i is x, expected y" (or the size mismatch).
std::string first_difference(const char* name, const std::vector<std::byte>& got,
                             const std::byte* expected, std::size_t expected_bytes);

/// Fills `bytes` with seeded random bytes (every bit pattern, NaNs included).
void fill_random(void* data, std::size_t bytes, std::uint64_t seed);

/// Runs body(t) for every t in [0, num_threads), one OpenMP thread each, as
/// the operator runs its plan: one thread runs inline, with no parallel region.
void for_each_thread(int num_threads, const std::function<void(int)>& body);

/// Copies `bytes` with `num_threads` threads, one contiguous slice each: the
/// physical limit the operator is measured against.
void parallel_copy(void* dst, const void* src, std::size_t bytes, int num_threads);

/// Writes `bytes` zeros the same way: the limit of the pad rows at k > 1.
void parallel_zero(void* dst, std::size_t bytes, int num_threads);

/// Gathers rows one at a time by an index, the naive baseline.
void per_row_gather(std::byte* dst, const std::byte* src, const std::int32_t* index,
                    std::int64_t num_rows, std::int64_t row_bytes);

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
  ReferenceInputs reference_inputs() const;
  void poison_outputs();
  /// Bytes the operator reads plus bytes it writes.
  std::int64_t bytes_moved() const;
  /// Output rows R: num_tokens, plus E * (k - 1) when expert_alignment k > 1.
  std::int64_t num_output_rows() const;
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
