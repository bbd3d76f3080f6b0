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
    {"permute_per_token_scales", kScales},
    {"permute_token_idx"},
    {"expert_token_num"},
    {"permute_topk_weight", kWeight},
};

constexpr OutputDesc kInverseOutputs[] = {
    {"restored_tokens", kTokens},
    {"restored_per_token_scales", kScales, /*optional=*/true},
    {"restored_topk_weight", kWeight, /*optional=*/true},
};

// In the order of the torch schemas, which are public and positional.
const AttributeDesc kExpertTokenNumType{"expert_token_num_type", AttributeKind::kInt,
                                        kExpertTokenNumCount, &Attributes::expert_token_num_type,
                                        nullptr, "0 = cumsum, 1 = count"};
const AttributeDesc kIdxType{"idx_type", AttributeKind::kInt, kIdxGather, &Attributes::idx_type,
                             nullptr, "0 = gather index, 1 = scatter index"};
const AttributeDesc kTokensDType{"tokens_dtype", AttributeKind::kDTypeName, 0, nullptr, nullptr,
                                 "the logical dtype of unsigned token storage"};
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
