#pragma once

/// The one exception type of the library.

#include <stdexcept>
#include <string>

#include "moe_reroute/export.h"

namespace moe_reroute {

enum class ErrorCode {
  kInvalidArgument,  // a shape, value or attribute breaks the contract
  kUnsupported,      // a dtype this argument cannot hold
  kOutOfRange,       // a size past what the outputs can represent (index, int64 sum)
  kBackend,          // the device runtime failed (a CUDA error), not the arguments
};

/// Thrown by planning and running; what() names the argument, e.g.
/// "expert_token_num_per_rank: counts sum to 250 but tokens has 256 rows".
class MOE_REROUTE_API Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

/// "invalid_argument", "unsupported", "out_of_range" or "backend".
MOE_REROUTE_API const char* error_code_name(ErrorCode code);

}  // namespace moe_reroute
