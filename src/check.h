#pragma once

// Helpers shared by planning and the backends' output checks.

#include <cstdint>
#include <string>
#include <vector>

#include "moe_reroute/error.h"
#include "moe_reroute/tensor.h"

namespace moe_reroute::detail {

[[noreturn]] inline void fail(ErrorCode code, const std::string& message) {
  throw Error(code, message);
}

/// Bytes of `spec`; throws Error naming `name` for a negative dim or a size
/// past int64.
std::int64_t checked_nbytes(const TensorSpec& spec, const char* name);

/// Bytes of one dim-0 row: everything past dim 0.
inline std::int64_t row_bytes(const TensorSpec& spec) {
  std::int64_t elements = 1;
  for (int d = 1; d < spec.shape.ndim; ++d) elements *= spec.shape[d];
  return dtype_bytes(spec.dtype, elements);
}

}  // namespace moe_reroute::detail

namespace moe_reroute::detail {

struct NamedView {
  const char* name;
  const TensorView* view;
};

/// Rule 10 and the plan's contract: every input and output has the spec the
/// plan holds for it, data is non-null where bytes are moved, and no output
/// overlaps an input or another output. Throws Error.
void check_run_arguments(const std::vector<TensorSpec>& input_specs,
                         const std::vector<NamedView>& inputs,
                         const std::vector<TensorSpec>& output_specs,
                         const std::vector<NamedView>& outputs);

}  // namespace moe_reroute::detail
