#pragma once

// A deliberately naive reference of the operator, for the tests and the
// benchmarks' verification: offsets recomputed by plain loops, rows copied
// byte by byte. It shares no code with the library. Beside it, the byte
// comparisons of outputs against it (compare.cc).

#include <cstddef>
#include <cstdint>
#include <string>
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
  // The static-shape mode (docs/spec.md section 9): A, the rows in rank order
  // (-1: the counts' sum), and k, the expert segment alignment.
  std::int64_t num_tokens = -1;
  std::int64_t expert_alignment = 1;
};

struct ReferenceOutputs {
  // Rows of tokens, scales and weight whose bytes the contract fixes; the rows
  // after them (tail rows of the forward, spare rows of the inverse) are
  // unspecified and hold zeros here.
  std::int64_t specified_rows = 0;
  std::vector<std::byte> tokens;
  std::vector<std::byte> scales;  // zeros, 4 bytes a row, when there are no scales (forward)
  std::vector<std::byte> weight;  // empty when there is no weight
  std::vector<std::int32_t> token_idx;         // forward only
  std::vector<std::int64_t> expert_token_num;  // forward only
};

/// The forward of docs/spec.md sections 3 and 9: R = A rows when k = 1, else
/// A + E * (k - 1); pad rows zero, gather index -1 at pad and tail rows,
/// scatter index -1 at spare rows, cumsum over the padded segments.
ReferenceOutputs reference_reroute(const ReferenceInputs& in, std::int64_t expert_token_num_type,
                                   std::int64_t idx_type);

/// The inverse: R rows in (padded) expert order back to A rows in rank order.
ReferenceOutputs reference_inverse(const ReferenceInputs& in);

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

}  // namespace moe_reroute::testing
