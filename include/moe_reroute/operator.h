#pragma once

/// The description of each operator: its inputs, outputs and attributes as
/// data (docs/spec.md section 2). Validation, the backends, the NumPy and
/// torch adapters, the torch schema and the CLI read it, so that a name is
/// spelled once.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "moe_reroute/export.h"
#include "moe_reroute/reroute.h"

namespace moe_reroute {

struct InputDesc {
  std::string_view name;
  bool optional = false;
};

/// `stored_like`: the index of the input a framework stores this output like
/// (that input's storage dtype and trailing dims, with the spec's rows), or
/// kOwnSpec: stored as its own spec, as also where that input is absent.
inline constexpr int kOwnSpec = -1;

/// What an output's dim 0 counts: the operator's output rows (R forward,
/// A inverse), the index's rows (R gather, A scatter) or the experts (E).
enum class OutputRows { kRows, kIndexRows, kExperts };

struct OutputDesc {
  std::string_view name;
  int stored_like = kOwnSpec;
  bool optional = false;  // given exactly when its stored_like input is
  OutputRows rows = OutputRows::kRows;
  bool empty_when_absent = false;  // (0,) where its stored_like input is absent
};

/// An output's rows as per_input_row * (tokens' rows) + per_expert * E: the
/// shape rules are affine in both, so graph compilers whose sizes are symbols
/// size outputs by it.
struct RowsFormula {
  std::int64_t per_input_row = 0;
  std::int64_t per_expert = 0;
  bool operator==(const RowsFormula& other) const = default;
};

/// kInt and kBool attributes are members of Attributes; kDTypeName is the
/// frameworks' logical dtype name of unsigned token storage (a str or None),
/// which the adapters read (docs/spec.md rule 11).
enum class AttributeKind { kInt, kBool, kDTypeName };

struct AttributeDesc {
  std::string_view name;
  AttributeKind kind;
  std::int64_t default_value = 0;
  std::int64_t Attributes::*int_member = nullptr;
  bool Attributes::*bool_member = nullptr;
  std::string_view help;

  /// The value in `attributes` (kInt, kBool; a bool as 0 or 1).
  std::int64_t get(const Attributes& attributes) const {
    return int_member ? attributes.*int_member : attributes.*bool_member;
  }
  void set(Attributes& attributes, std::int64_t value) const {
    if (int_member) {
      attributes.*int_member = value;
    } else {
      attributes.*bool_member = value != 0;
    }
  }
};

struct OperatorDesc {
  std::string_view name;
  std::span<const InputDesc> inputs;
  std::span<const OutputDesc> outputs;
  std::span<const AttributeDesc> attributes;  // those it reads, in schema order
};

/// Output `output` of `op` for `attributes` (valid ones), its stored_like
/// input given or not.
MOE_REROUTE_API RowsFormula output_rows(const OperatorDesc& op, std::size_t output,
                                        const Attributes& attributes, bool input_given);

/// moe_re_routing: (tokens, expert_token_num_per_rank, per_token_scales?,
/// expert_topk_weight?) -> the five outputs of RerouteOutputs.
MOE_REROUTE_API const OperatorDesc& reroute_desc();
/// moe_re_routing_inverse: the same inputs -> the three of InverseOutputs.
MOE_REROUTE_API const OperatorDesc& inverse_desc();

}  // namespace moe_reroute
