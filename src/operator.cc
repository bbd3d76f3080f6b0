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

// In the order of the torch schemas, which are public and positional.
const AttributeDesc kExpertTokenNumType{"expert_token_num_type", AttributeKind::kInt,
                                        kExpertTokenNumCount, &Attributes::expert_token_num_type,
                                        nullptr, "0 = cumsum, 1 = count"};
const AttributeDesc kIdxType{"idx_type", AttributeKind::kInt, kIdxGather, &Attributes::idx_type,
                             nullptr, "0 = gather index, 1 = scatter index"};
const AttributeDesc kTokensDType{
    "tokens_dtype", AttributeKind::kDTypeName, 0, nullptr, nullptr,
    "the logical dtype of unsigned token storage (bfloat16 for uint16; FP8, hifloat8, FP4 for "
    "uint8)"};
const AttributeDesc kExpertAlignment{
    "expert_alignment", AttributeKind::kInt, 1, &Attributes::expert_alignment, nullptr,
    "k: pad each expert's segment to a multiple of k rows (docs/spec.md section 9)"};
const AttributeDesc kAllowSpareRows{"allow_spare_rows", AttributeKind::kBool, 0, nullptr,
                                    &Attributes::allow_spare_rows,
                                    "the counts may sum to less than A (fixed-capacity buffers)"};

const AttributeDesc kRerouteAttributes[] = {kExpertTokenNumType, kIdxType, kTokensDType,
                                            kExpertAlignment, kAllowSpareRows};
const AttributeDesc kInverseAttributes[] = {kTokensDType, kExpertAlignment, kAllowSpareRows};

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
