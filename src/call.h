#pragma once

// A call validated from its shapes, dtypes and attributes: what every backend
// consumes. The CPU plans from it (src/plan.cc, src/cpu/); the CUDA backend
// launches from it (src/cuda/api.cc); a new backend would do the same.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "moe_reroute/reroute.h"

namespace moe_reroute::detail {

struct Call {
  Direction direction = Direction::kForward;
  Attributes attributes;
  std::int64_t num_tokens = 0;  // A: the forward's input rows, the inverse's output rows
  std::int64_t num_rows = 0;    // R: the forward's output rows, the inverse's input rows
  std::int64_t num_ranks = 0;   // N
  std::int64_t num_experts = 0;  // E
  std::int64_t token_row_bytes = 0;
  std::int64_t scale_row_bytes = 0;   // 0: no scales
  std::int64_t weight_row_bytes = 0;  // 0: no weight
  std::array<TensorSpec, 4> input_specs_storage;
  std::array<TensorSpec, 5> output_specs_storage;
  std::size_t num_inputs = 0;
  std::size_t num_outputs = 0;

  /// tokens, counts, scales?, weight?
  std::span<const TensorSpec> input_specs() const {
    return std::span(input_specs_storage).first(num_inputs);
  }
  /// The given outputs in their struct's order.
  std::span<const TensorSpec> output_specs() const {
    return std::span(output_specs_storage).first(num_outputs);
  }
};

/// Every rule of docs/spec.md section 4 but 4 and 5 (they need the counts'
/// values); throws Error naming the argument.
Call validate(const RerouteInputs& inputs, const Attributes& attributes);
Call validate(const InverseInputs& inputs, const Attributes& attributes);

}  // namespace moe_reroute::detail
