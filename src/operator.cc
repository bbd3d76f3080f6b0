#include "moe_reroute/operator.h"

namespace moe_reroute {
namespace {

// Both operators take the same inputs: their indices are what outputs are stored like.
constexpr InputDesc kInputs[] = {
    {"tokens"},
    {"expert_token_num_per_rank"},
    {"per_token_scales", /*optional=*/true},
    {"expert_topk_weight", /*optional=*/true},
};
constexpr int kTokens = 0, kScales = 2, kWeight = 3;

constexpr OutputDesc kRerouteOutputs[] = {
    {"permute_tokens", kTokens},
    {"permute_per_token_scales", kScales},  // [R] float32 zeros without scales
    {"permute_token_idx", kOwnSpec, false, OutputRows::kIndexRows},
    {"expert_token_num", kOwnSpec, false, OutputRows::kExperts},
    {"permute_topk_weight", kWeight, false, OutputRows::kRows, /*empty_when_absent=*/true},
};

constexpr OutputDesc kInverseOutputs[] = {
    {"restored_tokens", kTokens},
    {"restored_per_token_scales", kScales, /*optional=*/true, OutputRows::kRows, true},
    {"restored_topk_weight", kWeight, /*optional=*/true, OutputRows::kRows, true},
};

// In the order of the torch schemas, which are public and positional. The
// attributes are constexpr, so constant-initialized: the torch library reads
// them from its static initializers, which may run before this file's.
constexpr AttributeDesc kExpertTokenNumType{"expert_token_num_type", AttributeKind::kInt,
                                        kExpertTokenNumCount, &Attributes::expert_token_num_type,
                                        nullptr, "0 = cumsum, 1 = count"};
constexpr AttributeDesc kIdxType{"idx_type", AttributeKind::kInt, kIdxGather, &Attributes::idx_type,
                             nullptr, "0 = gather index, 1 = scatter index"};
constexpr AttributeDesc kTokensDType{
    "tokens_dtype", AttributeKind::kDTypeName, 0, nullptr, nullptr,
    "the logical dtype of unsigned token storage (bfloat16 for uint16; FP8, hifloat8, FP4 for "
    "uint8)"};
constexpr AttributeDesc kExpertAlignment{
    "expert_alignment", AttributeKind::kInt, 1, &Attributes::expert_alignment, nullptr,
    "k: pad each expert's segment to a multiple of k rows (docs/spec.md section 9)"};
constexpr AttributeDesc kAllowSpareRows{"allow_spare_rows", AttributeKind::kBool, 0, nullptr,
                                    &Attributes::allow_spare_rows,
                                    "the counts may sum to less than A (fixed-capacity buffers)"};

constexpr AttributeDesc kRerouteAttributes[] = {kExpertTokenNumType, kIdxType, kTokensDType,
                                            kExpertAlignment, kAllowSpareRows};
constexpr AttributeDesc kInverseAttributes[] = {kTokensDType, kExpertAlignment, kAllowSpareRows};

// moe_init_routing: (x, expert_idx) in, its outputs stored as their specs.
constexpr InputDesc kInitInputs[] = {{"x"}, {"expert_idx"}};
constexpr int kX = 0, kExpertIdx = 1;
constexpr OutputDesc kInitOutputs[] = {
    {"expanded_x", kX},
    {"expanded_row_idx"},
    {"expert_tokens_count_or_cumsum"},
    {"expert_tokens_before_capacity"},
};

using InitAttribute = AttributeDescOf<InitRoutingAttributes>;
constexpr InitAttribute kInitAttributes[] = {
    {"active_num", AttributeKind::kInt, 0, &InitRoutingAttributes::active_num, nullptr,
     "rows of expanded_x in drop_pad_mode 0 (0: T * k)"},
    {"expert_capacity", AttributeKind::kInt, 0, &InitRoutingAttributes::expert_capacity, nullptr,
     "C: rows per expert in drop_pad_mode 1"},
    {"expert_num", AttributeKind::kInt, 0, &InitRoutingAttributes::expert_num, nullptr,
     "E: the ids are in [0, E) (0: unbounded, drop_pad_mode 0 without counts)"},
    {"drop_pad_mode", AttributeKind::kInt, kDropless, &InitRoutingAttributes::drop_pad_mode,
     nullptr, "0 = dropless, 1 = by expert capacity (drops, pads)"},
    {"expert_tokens_count_or_cumsum_flag", AttributeKind::kInt, kExpertTokensNone,
     &InitRoutingAttributes::expert_tokens_count_or_cumsum_flag, nullptr,
     "0 = none, 1 = cumsum, 2 = count of each expert (drop_pad_mode 0)"},
    {"expert_tokens_before_capacity_flag", AttributeKind::kBool, 0, nullptr,
     &InitRoutingAttributes::expert_tokens_before_capacity_flag,
     "the counts of each expert before dropping (drop_pad_mode 1)"},
};

// moe_finalize_routing: the optional inputs' indices are what output_dims reads.
constexpr InputDesc kFinalizeInputs[] = {
    {"expanded_x"},
    {"expanded_row_idx"},
    {"x1", /*optional=*/true},
    {"x2", /*optional=*/true},
    {"bias", /*optional=*/true},
    {"scales", /*optional=*/true},
    {"expert_idx", /*optional=*/true},
};
constexpr int kExpandedX = 0, kRowIdx = 1, kX1 = 2, kScalesIn = 5;
constexpr OutputDesc kFinalizeOutputs[] = {{"out", kExpandedX}};

using FinalizeAttribute = AttributeDescOf<FinalizeRoutingAttributes>;
constexpr FinalizeAttribute kFinalizeAttributes[] = {
    {"drop_pad_mode", AttributeKind::kInt, kFinalizeColumnMajor,
     &FinalizeRoutingAttributes::drop_pad_mode, nullptr,
     "expanded_row_idx[j * T + t] (0, 1) or [t * k + j] (2, 3); expanded_x [T * k, H] (0, 2) "
     "or [E, C, H] (1, 3)"},
};

DimFormula dim_of(InputDim a) { return {{DimTerm{1, {a}, 1}}, 1}; }
DimFormula dim_of(std::int64_t value) { return {{DimTerm{value, {}, 0}}, 1}; }

}  // namespace

RowsFormula output_rows(const OperatorDesc& op, std::size_t output, const Attributes& attributes,
                        bool input_given) {
  const OutputDesc& desc = op.outputs[output];
  if (desc.empty_when_absent && !input_given) return {};
  // The forward's R = A + E * (k - 1), the inverse's A = R - E * (k - 1) (docs/spec.md section 9).
  const std::int64_t pad = attributes.expert_alignment - 1;
  const RowsFormula rows = &op == &reroute_desc() ? RowsFormula{1, pad} : RowsFormula{1, -pad};
  switch (desc.rows) {
    case OutputRows::kRows:
      return rows;
    case OutputRows::kIndexRows:
      return attributes.idx_type == kIdxGather ? rows : RowsFormula{1, 0};
    case OutputRows::kExperts:
      return {0, 1};
  }
  return rows;
}

std::vector<DimFormula> output_dims(const InitRoutingDesc&, std::size_t output,
                                    const InitRoutingAttributes& attributes,
                                    std::span<const bool>) {
  const bool capacity = attributes.drop_pad_mode == kDropPad;
  const std::int64_t experts = attributes.expert_num;
  const DimFormula positions{{DimTerm{1, {InputDim{kExpertIdx, 0}, InputDim{kExpertIdx, 1}}, 2}},
                             1};
  switch (output) {
    case 0: {  // expanded_x
      if (capacity) {
        return {dim_of(experts), dim_of(attributes.expert_capacity), dim_of({kX, 1})};
      }
      DimFormula rows = positions;
      if (attributes.active_num > 0) rows.at_most = attributes.active_num;
      return {rows, dim_of({kX, 1})};
    }
    case 1:
      return {positions};
    case 2:
      return {dim_of(!capacity && attributes.expert_tokens_count_or_cumsum_flag != kExpertTokensNone
                         ? experts
                         : 0)};
    default:
      return {dim_of(capacity && attributes.expert_tokens_before_capacity_flag ? experts : 0)};
  }
}

std::vector<DimFormula> output_dims(const FinalizeRoutingDesc&, std::size_t,
                                    const FinalizeRoutingAttributes&, std::span<const bool> given) {
  // T: x1's rows, else the scales' (k of them a token), else expanded_row_idx's (k = 1).
  const InputDim tokens = given[kX1]        ? InputDim{kX1, 0}
                          : given[kScalesIn] ? InputDim{kScalesIn, 0}
                                             : InputDim{kRowIdx, 0};
  return {dim_of(tokens), dim_of({kExpandedX, -1})};
}

const InitRoutingDesc& init_routing_desc() {
  static const InitRoutingDesc desc{"moe_init_routing", kInitInputs, kInitOutputs,
                                    kInitAttributes};
  return desc;
}

const FinalizeRoutingDesc& finalize_routing_desc() {
  static const FinalizeRoutingDesc desc{"moe_finalize_routing", kFinalizeInputs,
                                        kFinalizeOutputs, kFinalizeAttributes};
  return desc;
}

const OperatorDesc& reroute_desc() {
  static const OperatorDesc desc{"moe_re_routing", kInputs, kRerouteOutputs, kRerouteAttributes};
  return desc;
}

const OperatorDesc& inverse_desc() {
  static const OperatorDesc desc{"moe_re_routing_inverse", kInputs, kInverseOutputs,
                                 kInverseAttributes};
  return desc;
}

}  // namespace moe_reroute
