#pragma once

// A deliberately naive reference of the operator, for tests and the CLI's
// self-check: offsets recomputed by plain loops, rows copied byte by byte.
// It shares no code with the library.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace moe_reroute::testing {

struct ReferenceInputs {
  std::int64_t num_ranks = 0;
  std::int64_t num_experts = 0;
  std::vector<std::int64_t> counts;  // [N * E], row-major
  const std::byte* tokens = nullptr;
  std::int64_t token_row_bytes = 0;
  const std::byte* scales = nullptr;  // null: no scales
  std::int64_t scale_row_bytes = 0;
  const std::byte* weight = nullptr;  // null: no weight; 4 bytes a row
};

struct ReferenceOutputs {
  std::vector<std::byte> tokens;
  std::vector<std::byte> scales;  // zeros, 4 bytes a row, when there are no scales (forward)
  std::vector<std::byte> weight;  // empty when there is no weight
  std::vector<std::int32_t> token_idx;         // forward only
  std::vector<std::int64_t> expert_token_num;  // forward only
};

/// The forward of SPEC section 3.
ReferenceOutputs reference_reroute(const ReferenceInputs& in, int expert_token_num_type,
                                   int idx_type);

/// The inverse: rows in expert order back to rank order.
ReferenceOutputs reference_inverse(const ReferenceInputs& in);

}  // namespace moe_reroute::testing
