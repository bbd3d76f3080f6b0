#pragma once

/// The description of each operator: its inputs, outputs and attributes as
/// data (docs/spec.md section 2). Validation, the backends, the NumPy and
/// torch adapters, the torch schema and the CLI read it, so that a name is
/// spelled once.

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "moe_reroute/export.h"
#include "moe_reroute/reroute.h"
#include "moe_reroute/routing.h"

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

/// kInt and kBool attributes are members of the operator's attribute struct;
/// kDTypeName is the frameworks' logical dtype name of unsigned token storage
/// (a str or None), which the adapters read (docs/spec.md rule 11).
enum class AttributeKind { kInt, kBool, kDTypeName };

/// An attribute of an operator whose attributes are the struct `A`.
template <typename A>
struct AttributeDescOf {
  std::string_view name;
  AttributeKind kind;
  std::int64_t default_value = 0;
  std::int64_t A::*int_member = nullptr;
  bool A::*bool_member = nullptr;
  std::string_view help;

  /// The value in `attributes` (kInt, kBool; a bool as 0 or 1).
  std::int64_t get(const A& attributes) const {
    return int_member ? attributes.*int_member : attributes.*bool_member;
  }
  void set(A& attributes, std::int64_t value) const {
    if (int_member) {
      attributes.*int_member = value;
    } else {
      attributes.*bool_member = value != 0;
    }
  }
};

template <typename A>
struct OperatorDescOf {
  using AttributesType = A;
  std::string_view name;
  std::span<const InputDesc> inputs;
  std::span<const OutputDesc> outputs;
  std::span<const AttributeDescOf<A>> attributes;  // those it reads, in schema order
};

using AttributeDesc = AttributeDescOf<Attributes>;
using OperatorDesc = OperatorDescOf<Attributes>;

/// Output `output` of `op` for `attributes` (valid ones), its stored_like
/// input given or not.
MOE_REROUTE_API RowsFormula output_rows(const OperatorDesc& op, std::size_t output,
                                        const Attributes& attributes, bool input_given);

/// moe_re_routing: (tokens, expert_token_num_per_rank, per_token_scales?,
/// expert_topk_weight?) -> the five outputs of RerouteOutputs.
MOE_REROUTE_API const OperatorDesc& reroute_desc();
/// moe_re_routing_inverse: the same inputs -> the three of InverseOutputs.
MOE_REROUTE_API const OperatorDesc& inverse_desc();

/// An input dim, `dim` counted from the back where negative.
struct InputDim {
  int input = 0;
  int dim = 0;
  bool operator==(const InputDim& other) const = default;
};

/// An output dim as a formula in the inputs' dims, which graph compilers
/// whose sizes are symbols evaluate: the sum of the terms, each its
/// coefficient times the product of its factors, then at most `at_most`
/// where that is not negative.
struct DimTerm {
  std::int64_t coefficient = 1;
  std::array<InputDim, 2> factors{};
  int num_factors = 0;
  bool operator==(const DimTerm& other) const = default;
};
struct DimFormula {
  std::array<DimTerm, 2> terms{};
  int num_terms = 0;
  std::int64_t at_most = -1;
  bool operator==(const DimFormula& other) const = default;
};

using InitRoutingDesc = OperatorDescOf<InitRoutingAttributes>;
using FinalizeRoutingDesc = OperatorDescOf<FinalizeRoutingAttributes>;

/// moe_init_routing: (x, expert_idx) -> the four of InitRoutingOutputs.
MOE_REROUTE_API const InitRoutingDesc& init_routing_desc();
/// moe_finalize_routing: (expanded_x, expanded_row_idx, x1?, x2?, bias?,
/// scales?, expert_idx?) -> out.
MOE_REROUTE_API const FinalizeRoutingDesc& finalize_routing_desc();

/// The dims of output `output` for valid `attributes`, the optional inputs
/// given as `given` says (one flag per input): what the torch fake kernels
/// size outputs by.
MOE_REROUTE_API std::vector<DimFormula> output_dims(const InitRoutingDesc& op, std::size_t output,
                                                    const InitRoutingAttributes& attributes,
                                                    std::span<const bool> given);
MOE_REROUTE_API std::vector<DimFormula> output_dims(const FinalizeRoutingDesc& op,
                                                    std::size_t output,
                                                    const FinalizeRoutingAttributes& attributes,
                                                    std::span<const bool> given);

}  // namespace moe_reroute
